"""An artifact's metadata document: the fields the runtime relies on, and the checks that refuse a document
the runtime could not run from (a foreign format or hash scheme, a missing or malformed field), saying which.

The document alone: archive.py reads it from its record, artifact.py checks it against this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pt2serve.contract import CONTENT_HASH_SCHEME, FORMAT_VERSION, draft_name, forward_name, is_fp8
from pt2serve.errors import Pt2ServeError

# Weights: floats, FP8 layers' e4m3 values, and the packed integers, zero points (uint8) and input orders
# (int64) of integer-quantized layers.
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "uint8": torch.uint8, "int64": torch.int64, "float8_e4m3fn": torch.float8_e4m3fn}
_KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Metadata:
    """The artifact's metadata document, with the fields the runtime relies on."""

    raw: dict[str, Any]

    @property
    def forward_sizes(self) -> tuple[int, ...]:
        return tuple(self.raw["forward_sizes"])

    @property
    def max_step_tokens(self) -> int:
        return self.raw["max_step_tokens"]

    @property
    def max_context(self) -> int:
        return self.raw["max_context"]

    @property
    def max_cells(self) -> int:
        return self.raw["max_cells"]

    @property
    def vocab_size(self) -> int:
        return self.raw["vocab_size"]

    @property
    def backend(self) -> str:
        return self.raw["backend"]

    @property
    def cache(self) -> dict[str, Any]:
        return self.raw["cache"]

    @property
    def kv_dtype(self) -> torch.dtype:
        return _KV_DTYPES[self.cache["dtype"]]

    @property
    def min_prefill_chunk(self) -> int:
        return self.raw["min_prefill_chunk"]

    def entries_of(self, width: int) -> int:
        """The fixed context index length of a static forward."""
        return self.raw["methods"][forward_name(width)]["num_entries"]

    def internal_name(self, method: str) -> str:
        return self.raw["methods"][method]["internal_name"]

    @property
    def draft(self) -> dict[str, Any] | None:
        """The DFlash draft's description (block size, mask token, pool geometry, sizes), or None."""
        return self.raw.get("draft")

    @property
    def method_names(self) -> tuple[str, ...]:
        return tuple(self.raw["methods"])

    @property
    def deterministic(self) -> bool:
        """Whether the methods were exported with --deterministic: a row's logits do not depend on what else
        shares its step, on the method or on how its prompt was cut (artifacts from before the flag: no)."""
        return self.raw.get("deterministic", False)

    @property
    def is_fp8(self) -> bool:
        """Whether the linear layers hold e4m3 weights (the quantization record's format)."""
        return is_fp8(self.raw)


_REQUIRED_FIELDS = (
    "format_version", "model_config", "vocab_size", "max_context", "cache", "max_cells", "forward_sizes",
    "max_step_tokens", "min_prefill_chunk", "dtype", "backend", "methods", "weights", "content_hash", "built_with",
)


def check_metadata(raw: Any, path: Path) -> dict[str, Any]:
    """The document read from `path`'s metadata record, refused with a message where the runtime cannot use it."""
    if not isinstance(raw, dict):
        raise Pt2ServeError(f"{path}: metadata is not a JSON object; re-export it")
    missing = [key for key in _REQUIRED_FIELDS if key not in raw]
    if missing:
        raise Pt2ServeError(f"{path}: metadata lacks {', '.join(missing)}; re-export it")
    if raw["format_version"] != FORMAT_VERSION:
        raise Pt2ServeError(
            f"{path} has artifact format {raw['format_version']}, this pt2serve reads format {FORMAT_VERSION}; "
            "re-export it with this version"
        )
    scheme = raw.get("content_hash_scheme", 1)  # artifacts from before scheme 2 lack the field
    if scheme not in range(1, CONTENT_HASH_SCHEME + 1) or isinstance(scheme, bool):
        raise Pt2ServeError(
            f"{path} has content hash scheme {scheme!r}, this pt2serve knows schemes 1 to {CONTENT_HASH_SCHEME}; "
            "load it with the pt2serve that wrote it, or re-export it with this version"
        )
    malformed = _malformed_field(raw)
    if malformed:
        raise Pt2ServeError(f"{path}: metadata field {malformed}; re-export it")
    return raw


def _malformed_field(raw: dict[str, Any]) -> str | None:
    """The first field the runtime reads that lacks the type it needs, said with what it should be.

    A damaged or hand-edited document must fail here, naming the field, not later as a KeyError or a
    TypeError inside the loader or the executor.
    """
    for key in ("vocab_size", "max_context", "max_cells", "max_step_tokens", "min_prefill_chunk"):
        if not _is_positive_int(raw[key]):
            return f"{key} is {raw[key]!r}, not a positive integer"
    sizes = raw["forward_sizes"]
    if not isinstance(sizes, list) or not sizes or not all(_is_positive_int(n) for n in sizes):
        return f"forward_sizes is {sizes!r}, not a list of positive integers"
    cache = raw["cache"]
    if (not isinstance(cache, dict) or cache.get("dtype") not in _KV_DTYPES
            or not all(_is_positive_int(cache.get(key)) for key in ("num_layers", "num_kv_heads", "head_dim"))):
        return f"cache is {cache!r}, not {{num_layers, num_kv_heads, head_dim, dtype ({', '.join(_KV_DTYPES)})}}"
    if not isinstance(raw.get("deterministic", False), bool):
        return f"deterministic is {raw['deterministic']!r}, not true or false"
    if raw["backend"] not in ("cpu", "cuda"):
        return f"backend is {raw['backend']!r}, not cpu or cuda"
    methods = raw["methods"]
    if not isinstance(methods, dict) or not all(
            isinstance(spec, dict) and isinstance(spec.get("internal_name"), str) for spec in methods.values()):
        return "methods is not an object giving each method's internal_name"
    for width in sizes:
        spec = methods.get(forward_name(width), {})
        if "internal_name" in spec and not _is_positive_int(spec.get("num_entries")):
            return f"methods.{forward_name(width)}.num_entries is {spec.get('num_entries')!r}, not a positive integer"
    draft = raw.get("draft")
    if draft is not None and not _is_draft_record(draft, methods):
        return ("draft is not {block_size, mask_token_id, target_layer_ids, sizes, cache {num_layers, num_kv_heads, "
                "head_dim}} with a draft_S method (and its num_entries) for each size")
    weights = raw["weights"]
    if not isinstance(weights, list) or not all(_is_weight_entry(entry) for entry in weights):
        return f"weights is not a list of {{name, dtype ({', '.join(WEIGHT_DTYPES)}), shape, record}}"
    if not isinstance(raw["model_config"], dict):
        return "model_config is not an object"
    if not isinstance(raw["content_hash"], str):
        return f"content_hash is {raw['content_hash']!r}, not a string"
    built = raw["built_with"]
    if not isinstance(built, dict) or not isinstance(built.get("torch"), str):
        return "built_with does not give the torch version"
    return None


def _is_draft_record(draft: Any, methods: dict[str, Any]) -> bool:
    if not isinstance(draft, dict) or not isinstance(draft.get("cache"), dict):
        return False
    sizes = draft.get("sizes")
    return (_is_positive_int(draft.get("block_size")) and draft["block_size"] >= 2
            and isinstance(draft.get("mask_token_id"), int) and isinstance(draft.get("target_layer_ids"), list)
            and all(_is_positive_int(draft["cache"].get(key)) for key in ("num_layers", "num_kv_heads", "head_dim"))
            and isinstance(sizes, list) and bool(sizes) and all(_is_positive_int(n) for n in sizes)
            and all(_is_positive_int(methods.get(draft_name(n), {}).get("num_entries")) for n in sizes))


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_weight_entry(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("record"), str)
            and entry.get("dtype") in WEIGHT_DTYPES and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"]))

