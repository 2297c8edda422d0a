"""GPTQ and AWQ checkpoints: recognised from config.json's quantization_config, converted to our packed format.

Published layouts (int32 words, values packed from the least significant bits; pf = 32 / bits per word):

GPTQ (AutoGPTQ, GPTQModel; checkpoint_format "gptq" or "gptq_v2"), for a layer [out N, in K]:
    qweight  [K / pf, N]   word (i, n) holds rows k = i*pf .. i*pf + pf-1 of column n, in order
    qzeros   [G, N / pf]   word (g, c) holds columns n = c*pf .. c*pf + pf-1, in order
    scales   [G, N]        fp16
    g_idx    [K]           the group of each input k (act-order: not k // group_size)
    W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]
    "gptq" stores zero - 1 (so zero = stored + 1, unmasked as AutoGPTQ's and exllama's dequantization read
    it); "gptq_v2" stores the zero itself.
AWQ (AutoAWQ, version "gemm"), 4 bits:
    qweight  [K, N / 8]    word (k, c) holds columns 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i] in nibble i
    qzeros   [G, N / 8]    the same column order
    scales   [G, N]
    W[n, k] = (q[k, n] - zero[k // group_size, n]) * scale[k // group_size, n]

Act-order becomes a permutation of the inputs: columns are sorted by group, so each group is contiguous,
and the kernel reads x through `perm`. Projections we stack (q/k/v, gate/up) are concatenated by rows;
they read the same input, so act-order checkpoints must give them the same g_idx (GPTQ computes it from
the same inputs, so they do).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pt2serve.errors import Pt2ServeError
from pt2serve.model.quant import LinearFormat, install_quantized_modules

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its eight
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> offset added to the stored zero
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_TENSORS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True)
class CheckpointQuantization:
    """A quantized checkpoint's quantization_config, checked."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int | None  # None: one group per output row
    symmetric: bool
    act_order: bool
    zero_offset: int  # added to each stored zero

    @property
    def tensor_suffixes(self) -> tuple[str, ...]:
        return GPTQ_TENSORS if self.method == "gptq" else AWQ_TENSORS


def read_quantization_config(hf: dict[str, Any], source: str) -> CheckpointQuantization | None:
    """None for a float checkpoint; a clear error for any layout we do not read."""
    config = hf.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise Pt2ServeError(f"{source}: quantization_config must be an object")
    method = config.get("quant_method")
    bits, group_size = config.get("bits"), config.get("group_size", -1)
    if not isinstance(group_size, int) or (group_size != -1 and group_size < 2):
        raise Pt2ServeError(f"{source}: quantization_config.group_size must be -1 or an integer >= 2, got {group_size!r}")
    groups = None if group_size == -1 else group_size
    if method == "gptq":
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in GPTQ_FORMATS:
            raise Pt2ServeError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported (only "
                                f"{', '.join(GPTQ_FORMATS)}); re-save the model in the gptq format")
        if bits not in (4, 8):
            raise Pt2ServeError(f"{source}: GPTQ with {bits} bits is not supported (only 4 and 8)")
        if config.get("dynamic"):
            raise Pt2ServeError(f"{source}: GPTQ 'dynamic' per-layer settings are not supported")
        return CheckpointQuantization("gptq", bits, groups, bool(config.get("sym", True)),
                                      bool(config.get("desc_act", False)), GPTQ_FORMATS[fmt])
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise Pt2ServeError(f"{source}: AWQ version {version!r} is not supported (only the GEMM layout)")
        if bits != 4:
            raise Pt2ServeError(f"{source}: AWQ with {bits} bits is not supported (only 4)")
        if not config.get("zero_point", True):
            raise Pt2ServeError(f"{source}: AWQ without zero points is not supported (GEMM checkpoints have them)")
        return CheckpointQuantization("awq", 4, groups, symmetric=False, act_order=False, zero_offset=0)
    raise Pt2ServeError(f"{source}: quantization method {method!r} is not supported (supported: gptq, awq, "
                        "compressed-tensors and fp8)")


@dataclass(frozen=True)
class Part:
    """One checkpoint projection inside one of our layers: its name prefix and first row."""

    prefix: str  # e.g. "model.layers.0.self_attn.k_proj"
    start: int
    rows: int


def install_checkpoint_layers(
    model: nn.Module, layout: dict, keys: set[str], quant: CheckpointQuantization
) -> dict[str, list[Part]]:
    """Swap in a quantized layer wherever the checkpoint holds quantized tensors; returns their parts.

    `layout` is checkpoint_layout of the float model (checkpoint name -> Destination); `keys` every tensor
    name in the checkpoint.
    """
    parts: dict[str, list[Part]] = defaultdict(list)
    for name, destination in layout.items():
        module = destination.name.removesuffix(".weight")
        if name.endswith(".weight") and isinstance(model.get_submodule(module), nn.Linear):
            parts[module].append(Part(name.removesuffix(".weight"), destination.start, destination.shape[0]))
    quantized = {}
    for module, module_parts in parts.items():
        have = [f"{part.prefix}.qweight" in keys for part in module_parts]
        if not any(have):
            continue  # a float layer missing from the checkpoint: the float loader reports it
        if not all(have):
            missing = next(part.prefix for part, ok in zip(module_parts, have) if not ok)
            raise Pt2ServeError(f"{missing} is not quantized but the projections stacked with it are; "
                                "pt2serve needs q/k/v (and gate/up) quantized alike")
        quantized[module] = sorted(module_parts, key=lambda part: part.start)
    if not quantized:
        raise Pt2ServeError(f"config.json says the checkpoint is {quant.method}-quantized, but no tensor ends in .qweight")
    has_perm = quant.act_order and quant.group_size is not None
    fmt = LinearFormat(quant.bits, quant.group_size, has_zeros=not quant.symmetric, has_perm=has_perm)
    install_quantized_modules(model, {module: fmt for module in quantized})
    return quantized


def owned_keys(layers: dict[str, list[Part]], quant: CheckpointQuantization) -> set[str]:
    return {f"{part.prefix}.{suffix}" for parts in layers.values() for part in parts for suffix in quant.tensor_suffixes}


@torch.no_grad()
def load_quantized_layers(
    model: nn.Module, layers: dict[str, list[Part]], files: list[Path], quant: CheckpointQuantization
) -> None:
    """Read every quantized layer's tensors and store them in our format."""
    where = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            where.update({key: file for key in reader.keys()})
    for module_name, parts in layers.items():
        module = model.get_submodule(module_name)
        converted = [_read_part(part, module.in_features, where, quant) for part in parts]
        perm = converted[0][3]
        for _, _, _, other in converted[1:]:
            if (other is None) != (perm is None) or (perm is not None and not torch.equal(other, perm)):
                raise Pt2ServeError(f"{module_name}: its stacked projections have different g_idx (act-order); "
                                    "pt2serve needs one input order per stacked layer")
        if module.perm is None and perm is not None:
            raise Pt2ServeError(f"{module_name}: g_idx is not in group order, but quantization_config has desc_act=false")
        if module.perm is not None and perm is None:
            perm = torch.arange(module.in_features)  # act-order in the config, but this layer is in order
        q = torch.cat([c[0] for c in converted])
        scales = torch.cat([c[1] for c in converted]).to(module.scales.dtype)
        zeros = None if quant.symmetric else torch.cat([c[2] for c in converted])
        module.fill(q, scales, zeros, perm)


def _read_part(part: Part, in_features: int, where: dict[str, Path], quant: CheckpointQuantization):
    """(q [rows, K] uint8 in stored column order, scales [rows, G], zeros [rows, G] or None, perm or None)."""
    tensors = {}
    for suffix in quant.tensor_suffixes:
        key = f"{part.prefix}.{suffix}"
        if key not in where:
            if suffix == "g_idx":
                continue  # optional: without it the groups are in order
            raise Pt2ServeError(f"{part.prefix}.qweight is in the checkpoint but {key} is missing")
        with safe_open(str(where[key]), framework="pt", device="cpu") as reader:
            tensors[suffix] = reader.get_tensor(key)
    group_size = quant.group_size or in_features
    num_groups = -(-in_features // group_size)
    per_word = 32 // quant.bits
    rows = part.rows
    if quant.method == "gptq":
        expected = {"qweight": (in_features // per_word, rows), "qzeros": (num_groups, rows // per_word),
                    "scales": (num_groups, rows), "g_idx": (in_features,)}
    else:
        expected = {"qweight": (in_features, rows // per_word), "qzeros": (num_groups, rows // per_word),
                    "scales": (num_groups, rows)}
    for suffix, tensor in tensors.items():
        if tuple(tensor.shape) != expected[suffix]:
            raise Pt2ServeError(f"{part.prefix}.{suffix} has shape {list(tensor.shape)}, expected "
                                f"{list(expected[suffix])} for {quant.method} {quant.bits}-bit, group size "
                                f"{quant.group_size or 'per channel'} and the shapes in config.json")
    zeros = _unpack_words(tensors["qzeros"], quant.bits, dim=1) + quant.zero_offset  # [G, rows]
    if quant.method == "gptq":
        q = _unpack_words(tensors["qweight"], quant.bits, dim=0)  # [K, rows]
    else:
        q = _unpack_words(tensors["qweight"], quant.bits, dim=1)  # [K, rows], AWQ's column order
        reverse = torch.tensor(AWQ_ORDER).argsort()
        q = q.view(in_features, -1, 8)[:, :, reverse].reshape(in_features, rows)
        zeros = zeros.view(num_groups, -1, 8)[:, :, reverse].reshape(num_groups, rows)
    q, zeros, scales = q.T, zeros.T, tensors["scales"].T
    perm = _group_order(tensors.get("g_idx"), in_features, group_size, part.prefix)
    if perm is not None:
        q = q[:, perm]
    if quant.symmetric:
        if not bool((zeros == 2 ** (quant.bits - 1)).all()):
            raise Pt2ServeError(f"{part.prefix}: quantization_config says sym=true, but its zero points are not "
                                f"all {2 ** (quant.bits - 1)}")
        zeros = None
    return q.to(torch.uint8).contiguous(), scales.contiguous(), None if zeros is None else zeros.to(torch.uint8), perm


def _unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their values along `dim` (least significant first), as int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = words.to(torch.int32)
    if dim == 0:
        values = (words[:, None, :] >> shifts[None, :, None]) & (2**bits - 1)  # [W, pf, C]
        return values.reshape(-1, words.shape[1])
    values = (words[:, :, None] >> shifts[None, None, :]) & (2**bits - 1)  # [R, W, pf]
    return values.reshape(words.shape[0], -1)


def _group_order(g_idx: torch.Tensor | None, in_features: int, group_size: int, prefix: str) -> torch.Tensor | None:
    """None when the inputs are already in group order, else the permutation that sorts them into groups."""
    in_order = torch.arange(in_features) // group_size
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, in_order):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], in_order):
        raise Pt2ServeError(f"{prefix}.g_idx does not put exactly group_size={group_size} inputs in each group; "
                            "this GPTQ layout is not supported")
    return perm
