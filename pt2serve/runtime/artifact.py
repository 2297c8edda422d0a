"""Opening a .pt2: check it against this machine, load its weights once, bind them to every method.

Nothing here imports model or export code: the package and its metadata are the whole contract.
Every check runs before any compiled method runs, because AOTInductor crashes (not raises) on a method
whose constants are missing and silently accepts wrong shapes.
"""

from __future__ import annotations

import json
import mmap
import struct
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._inductor.package.package import AOTICompiledModel
from tqdm import tqdm

from pt2serve.contract import (
    DRAFT_CONTEXT,
    FORMAT_VERSION,
    FORWARD_OTHERS,
    METADATA_RECORD,
    SAMPLE,
    SAMPLE_ARGMAX,
    TOKENIZER_RECORD,
    ContentHasher,
    draft_name,
    forward_name,
)
from pt2serve.errors import Pt2ServeError

# Weights: floats, plus the packed integers, zero points (uint8) and input orders (int64) of quantized layers.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
           "int64": torch.int64}
_KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes


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


_REQUIRED_FIELDS = (
    "format_version", "model_config", "vocab_size", "max_context", "cache", "max_cells", "forward_sizes",
    "max_step_tokens", "min_prefill_chunk", "dtype", "backend", "methods", "weights", "content_hash", "built_with",
)


def read_metadata(path: str | Path) -> Metadata:
    """The metadata document alone: no method or weight is loaded."""
    with _open_zip(path) as archive:
        return Metadata(_read_metadata(archive, path))


def read_tokenizer_json(path: str | Path) -> str | None:
    """The checkpoint's tokenizer.json the artifact carries (None without one); nothing else is loaded."""
    with _open_zip(path) as archive:
        return _tokenizer_json(archive)


@dataclass
class LoadReport:
    load_seconds: float = 0.0
    weight_bytes: int = 0
    methods: tuple[str, ...] = ()


@dataclass
class Artifact:
    """A loaded artifact: its metadata, device weights, and one runner per method."""

    path: Path
    metadata: Metadata
    device: torch.device
    weights: dict[str, torch.Tensor]
    runners: dict[str, Any]  # method name -> torch._C._aoti.AOTIModelPackageLoader
    tokenizer_json: str | None
    report: LoadReport = field(default_factory=LoadReport)

    def run(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.runners[method].run(inputs)


def load_artifact(
    path: str | Path, device: str | None = None, verify_hash: bool = True, show_progress: bool = False
) -> Artifact:
    """Open, check and load an artifact onto `device` (default: the one it was built for)."""
    started = time.perf_counter()
    path = Path(path)
    with _open_zip(path) as archive:
        metadata = Metadata(_read_metadata(archive, path))
        target = torch.device(device or ("cuda" if metadata.backend == "cuda" else "cpu"))
        check_machine(metadata, target)
        records = _check_records(archive, metadata, path)
        tokenizer_json = _tokenizer_json(archive)
    weights = _load_weights(path, metadata, records, target, verify_hash, show_progress)
    runners = {}
    device_index = target.index if target.index is not None else (0 if target.type == "cuda" else -1)
    for method in tqdm(metadata.method_names, desc="loading methods", disable=not show_progress):
        runner = torch._C._aoti.AOTIModelPackageLoader(
            str(path), metadata.internal_name(method), True, 1, device_index
        )
        _bind_weights(runner, method, weights, path)
        runners[method] = runner
    report = LoadReport(
        load_seconds=time.perf_counter() - started,
        weight_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
        methods=metadata.method_names,
    )
    return Artifact(path, metadata, target, weights, runners, tokenizer_json, report)


def check_machine(metadata: Metadata, device: torch.device) -> None:
    """Refuse an artifact this machine cannot run, saying how to fix it."""
    built = metadata.raw["built_with"]
    if device.type == "cuda":  # first: without a GPU, nothing else about the artifact matters
        if not torch.cuda.is_available():
            raise Pt2ServeError("no CUDA GPU is visible here (torch.cuda.is_available() is False): serve on a machine "
                                "with a GPU, or export the model with --backend cpu and serve that on the CPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise Pt2ServeError(f"there is no GPU {device}: this machine has {torch.cuda.device_count()}")
    if metadata.backend == "cuda" and device.type != "cuda":
        raise Pt2ServeError("this artifact was exported for cuda; serve it on a GPU, or re-export with --backend cpu")
    if metadata.backend == "cpu" and device.type != "cpu":
        raise Pt2ServeError("this artifact was exported for cpu; re-export with --backend cuda to run on a GPU")
    if built.get("libstdcxx_mismatch"):
        raise Pt2ServeError(
            f"this artifact's compiled methods were built against a different libstdc++ ({built['libstdcxx_mismatch']}); "
            "loading them would crash the process: re-export with CXX=/usr/bin/g++"
        )
    if _major_minor(built["torch"]) != _major_minor(torch.__version__):
        raise Pt2ServeError(
            f"this artifact was built with torch {built['torch']}, but this machine has torch {torch.__version__}; "
            "compiled methods only load under the torch release that built them: re-export it here"
        )
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        here = f"sm_{major}{minor}"
        if built.get("gpu_arch") and built["gpu_arch"] != here:
            raise Pt2ServeError(
                f"this artifact was built for {built['gpu_arch']} ({built.get('gpu_name')}), but this GPU is {here}; "
                "re-export it on this GPU"
            )


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def _open_zip(path: str | Path) -> zipfile.ZipFile:
    path = Path(path)
    if not path.is_file():
        raise Pt2ServeError(f"artifact {str(path)!r} does not exist")
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise Pt2ServeError(f"{path} is not a readable .pt2 package ({err}); it may be truncated: re-export it") from None


def _find_record(archive: zipfile.ZipFile, suffix: str) -> str | None:
    """The record whose name is <archive root>/<suffix> (the root folder is the name it was written under)."""
    for name in archive.namelist():
        if name.split("/", 1)[-1] == suffix:
            return name
    return None


def _tokenizer_json(archive: zipfile.ZipFile) -> str | None:
    name = _find_record(archive, "extra/" + TOKENIZER_RECORD)
    return archive.read(name).decode() if name else None


def _read_metadata(archive: zipfile.ZipFile, path: Path) -> dict[str, Any]:
    name = _find_record(archive, "extra/" + METADATA_RECORD)
    if name is None:
        raise Pt2ServeError(f"{path} has no pt2serve metadata: it was not written by `pt2serve export`")
    try:
        raw = json.loads(archive.read(name))
    except (zipfile.BadZipFile, json.JSONDecodeError, OSError) as err:
        raise Pt2ServeError(f"{path}: metadata is unreadable ({err}); re-export it") from None
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
        return f"weights is not a list of {{name, dtype ({', '.join(_DTYPES)}), shape, record}}"
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
            and entry.get("dtype") in _DTYPES and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"]))


def _check_records(archive: zipfile.ZipFile, metadata: Metadata, path: Path) -> dict[str, zipfile.ZipInfo]:
    """Every method and weight the metadata names is present, and the method files are intact."""
    expected = {forward_name(n) for n in metadata.forward_sizes} | {FORWARD_OTHERS, SAMPLE, SAMPLE_ARGMAX}
    if metadata.draft is not None:
        expected |= {DRAFT_CONTEXT} | {draft_name(n) for n in metadata.draft["sizes"]}
    absent = sorted(expected - set(metadata.method_names))
    if absent:
        raise Pt2ServeError(f"{path} is incomplete: metadata lists no method {', '.join(absent)}")
    by_suffix = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
    for method in metadata.method_names:
        prefix = f"data/aotinductor/{metadata.internal_name(method)}/"
        files = [info for suffix, info in by_suffix.items() if suffix.startswith(prefix)]
        if not any(info.filename.endswith(".so") for info in files):
            raise Pt2ServeError(f"{path} is incomplete: method {method} has no compiled library; re-export it")
        for info in files:
            try:
                archive.read(info.filename)  # zipfile checks each record's CRC as it reads
            except (zipfile.BadZipFile, OSError) as err:
                raise Pt2ServeError(f"{path}: method {method} is damaged ({err}); re-export it") from None
    records = {}
    for entry in metadata.raw["weights"]:
        info = by_suffix.get(entry["record"])
        if info is None:
            raise Pt2ServeError(f"{path} is incomplete: weight {entry['name']} is missing; re-export it")
        records[entry["name"]] = info
    return records


def _load_weights(
    path: Path,
    metadata: Metadata,
    records: dict[str, zipfile.ZipInfo],
    device: torch.device,
    verify_hash: bool,
    show_progress: bool,
) -> dict[str, torch.Tensor]:
    """Each weight read straight from its (uncompressed) record via mmap, checked, and moved to `device`."""
    weights: dict[str, torch.Tensor] = {}
    hasher = ContentHasher(metadata.raw["model_config"]) if verify_hash else None
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        entries = sorted(metadata.raw["weights"], key=lambda entry: entry["name"])
        for entry in tqdm(entries, desc="loading weights", disable=not show_progress):
            name, shape = entry["name"], tuple(entry["shape"])
            dtype = _DTYPES[entry["dtype"]]
            info = records[name]
            expected_bytes = dtype.itemsize * _numel(shape)
            if info.compress_type != zipfile.ZIP_STORED:
                raise Pt2ServeError(f"{path}: weight {name} is stored compressed, and weights are read in place "
                                    "from the file; re-export it (or rewrite the zip without compression)")
            if info.file_size != expected_bytes:
                raise Pt2ServeError(f"{path}: weight {name} has {info.file_size} bytes, but its dtype and shape "
                                    f"need {expected_bytes}; re-export it")
            offset = _data_offset(mapped, info, path)
            if offset + expected_bytes > len(mapped):
                raise Pt2ServeError(f"{path} is truncated inside weight {name}; re-export it")
            data = memoryview(mapped)[offset:offset + expected_bytes]
            host = bytearray(data)
            data.release()
            if hasher is not None:
                hasher.update(name, entry["dtype"], shape, host)
            weights[name] = torch.frombuffer(host, dtype=torch.uint8).view(dtype).reshape(shape).to(device)
    if hasher is not None and hasher.hexdigest() != metadata.raw["content_hash"]:
        raise Pt2ServeError(f"{path}: weights do not match the artifact's content hash (tampered or damaged)")
    return weights


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _data_offset(mapped: mmap.mmap, info: zipfile.ZipInfo, path: Path) -> int:
    header = mapped[info.header_offset:info.header_offset + _LOCAL_HEADER.size]
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise Pt2ServeError(f"{path}: record {info.filename} is damaged; re-export it")
    fields = _LOCAL_HEADER.unpack(header)
    name_length, extra_length = fields[-2], fields[-1]
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def _bind_weights(runner, method: str, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Hand the method the shared device weights (no copies); refuse before AOTInductor can crash."""
    needed = runner.get_constant_fqns()
    missing = [name for name in needed if name not in weights]
    if missing:
        raise Pt2ServeError(f"{path}: method {method} needs weights the package lacks: {', '.join(missing[:5])}")
    if needed:
        # user_managed: the method keeps pointers to our tensors, so every method shares one copy.
        AOTICompiledModel(runner).load_constants(
            {name: weights[name] for name in needed}, check_full_update=True, user_managed=True
        )
