"""The artifact contract shared by the exporter (which writes it) and the runtime (which reads it).

It imports neither side: a served artifact needs no model or export code.

Package layout (a PT2 zip archive):
    data/aotinductor/<internal name>/...   one AOTInductor model per method, weights NOT inside
    data/pt2serve/weights/<fqn>             each weight once, raw bytes (stored, uncompressed)
    extra/pt2serve.json                     metadata (this module's field names), readable without loading
    extra/tokenizer.json                    the checkpoint's tokenizer, when it had one

Cell layout of the KV pool (one tensor per layer for K and one for V, [num_cells, kv_heads, head_dim]):
    cell 0 = SCRATCH_CELL: padding tokens write here and nobody reads it
    cells 1.. : handed out to sequences, one per token position
"""

from __future__ import annotations

import hashlib
import json

FORMAT_VERSION = 1
METADATA_RECORD = "pt2serve.json"  # under the archive's extra/ folder
TOKENIZER_RECORD = "tokenizer.json"  # under extra/
WEIGHTS_PREFIX = "data/pt2serve/weights/"

SCRATCH_CELL = 0

# The quantization record's "format" of an artifact whose linear layers hold e4m3 weights (model/fp8.py).
FP8_FORMAT = "fp8-e4m3"


def is_fp8(metadata: dict) -> bool:
    """Whether an artifact's metadata describes FP8 linear layers."""
    return (metadata.get("quantization") or {}).get("format") == FP8_FORMAT


FORWARD_OTHERS = "forward_others"
SAMPLE = "sample"
SAMPLE_ARGMAX = "sample_argmax"
ACCEPT_DRAFTS = "accept_drafts"
ACCEPT_DRAFTS_SAMPLED = "accept_drafts_sampled"
DRAFT_CONTEXT = "draft_context"

# Inputs of every forward method, in order, followed by the K pools then the V pools (one per layer).
# forward_N takes exactly N tokens; forward_others takes 2 .. max_step_tokens + 1 (one padding token
# in its own sequence keeps every dynamic dim at its traced minimum). A token's own cell is also its
# sequence's entry at its position: seq_cells[seq_indptr[token_seq[t]] + positions[t]] == write_cells[t].
FORWARD_INPUTS = (
    "tokens",  # [T] int64
    "positions",  # [T] int64
    "write_cells",  # [T] int64
    "token_seq",  # [T] int64
    "seq_indptr",  # [R+1] int64
    "seq_cells",  # [E] int64
    "logit_rows",  # [S] int64
)
# `sample` takes logits [R, V] fp32, then per row: temperature, top_p, top_k (int64), uniform draw;
# `sample_argmax` takes the logits alone. Both return token ids [R] int64.
# Speculation (artifacts exported before it lack these; the runtime then refuses to speculate):
# `accept_drafts` takes logits [R, V] fp32, row_index [S, K1], drafts [S, K1], num_drafts [S] (int64);
# `accept_drafts_sampled` takes those, then per sequence temperature, top_p, top_k, and per row an acceptance
# draw and a sampling draw [S, K1] fp32. Both return num_accepted [S] and ids [S, K1] (int64): a sequence emits
# its first num_accepted + 1 ids.
#
# A DFlash draft (metadata "draft"; artifacts without one have none of this): every forward method then
# returns (logits, taps), taps [T, len(target_layer_ids) * hidden] being the step's tokens' hidden states
# after the tapped target layers. The draft has its own cell pool (K pools then V pools, one per draft
# layer, [cells, draft kv heads, draft head dim]) whose cells 0 .. target cells - 1 mirror the target's (a
# position's draft context lives in the draft cell of the same id as its target cell), followed by
# block_size block cells per draft sequence slot.
# `draft_context` takes taps, positions [T], write_cells [T], then the draft pools: it writes the draft
# context of those positions (returns a dummy [1]).
# `draft_S` (S sequences) takes last_tokens [S] (each sequence's newest known token), seq_indptr [S+1] and
# seq_cells [E] (each sequence's context cells for positions 0 .. n-1, then its slot's block_size block
# cells), then the draft pools; it returns the drafts [S, block_size - 1] (int64, argmax).


def forward_name(width: int) -> str:
    return f"forward_{width}"


def draft_name(num_seqs: int) -> str:
    return f"draft_{num_seqs}"


def internal_model_name(index: int) -> str:
    """Names of equal length, so none is a prefix of another (torch 2.11 finds models by name prefix)."""
    return f"method_{index:03d}"


# How `content_hash` is computed. Scheme 1 (artifacts without a `content_hash_scheme` field): one sha256 stream
# over the config and every weight's bytes (ContentHasher), serial by construction. Scheme 2: a sha256 per
# weight, which any number of threads compute at once, then one sha256 over the config and a line per weight
# (content_hash).
CONTENT_HASH_SCHEME = 2


class ContentHasher:
    """Scheme 1: sha256 over the model config, then each weight's name, dtype, shape and bytes, fed in name order.

    Artifacts written before scheme 2 carry this digest; the loader recomputes it for them.
    """

    def __init__(self, config: dict) -> None:
        self._digest = hashlib.sha256(_config_bytes(config))
        self._last_name = ""

    def update(self, name: str, dtype: str, shape, data) -> None:
        assert name > self._last_name, "weights must be hashed in name order"
        self._last_name = name
        self._digest.update(f"{name}|{dtype}|{tuple(shape)}".encode())
        self._digest.update(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def content_hash(config: dict, weight_digests: dict[str, tuple[str, tuple[int, ...], str]]) -> str:
    """Scheme 2: sha256 over the config, then one `name|dtype|shape|sha256 of its bytes` line per weight, in name
    order. `weight_digests` maps each weight's name to (dtype, shape, hex sha256 of its bytes)."""
    digest = hashlib.sha256(_config_bytes(config))
    for name in sorted(weight_digests):
        dtype, shape, weight_digest = weight_digests[name]
        digest.update(f"{name}|{dtype}|{tuple(shape)}|{weight_digest}\n".encode())
    return digest.hexdigest()


def _config_bytes(config: dict) -> bytes:
    return json.dumps(config, sort_keys=True).encode()
