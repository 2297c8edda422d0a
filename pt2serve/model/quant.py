"""Weight-only quantized layers and `export --quantize`: the model's linear layers become one operator.

A quantized layer holds the packed format of kernels/quant_format.py as buffers (qweight, scales, zeros,
perm), so the exporter stores them once in the artifact like any weight. Layers are swapped in place of
the float ones by name (install_quantized_modules): the model code builds float layers, and whoever holds
quantized weights (the RTN quantizer below, a GPTQ/AWQ checkpoint, the artifact's weights) replaces them.

RTN (round to nearest), as `export --quantize` does it:
- int8: symmetric, one scale per output row by default (the zero is 128).
- int4: asymmetric, one scale and zero per group of 128 inputs by default; the range always contains 0,
  so zero weights (and the padding of a short last group) stay exact.
Scales are rounded to the model's dtype BEFORE the weights are rounded, so the stored scale is the one the
levels were chosen for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pt2serve.errors import Pt2ServeError
from pt2serve.contract import FP8_FORMAT
from pt2serve.kernels.quant_format import INT4_BLOCK_COLUMNS, SUPPORTED_BITS, dequantize, pack, values_per_byte
from pt2serve.kernels.quant_linear import quant_linear
from pt2serve.model.fp8 import describe_fp8, fp8_names_from_weights, install_fp8_modules, quantize_model_fp8

SCHEMES = {"int8": 8, "int4": 4, "fp8": 8}  # fp8: model/fp8.py's e4m3 layers, activations quantized too
DEFAULT_GROUP_SIZE = {8: None, 4: 128}  # None: one group per output row
QUANTIZED_SUFFIXES = ("qweight", "scales", "zeros", "perm")
# How qweight's bytes hold the values (kernels/quant_format.py), recorded in the artifact: the eager peer
# rebuilds layers from an artifact's weights and must not read another layout as this one.
PACKING = {8: "bytes", 4: f"split-halves-{INT4_BLOCK_COLUMNS}"}


@dataclass(frozen=True)
class QuantScheme:
    """What `export --quantize` asks for."""

    bits: int
    group_size: int | None  # None: one group per output row
    lm_head: bool = False  # quantize the LM head too (with tied embeddings: the shared matrix)
    embedding: bool = False  # quantize the input embedding too (with tied embeddings: the shared matrix)
    is_fp8: bool = False  # e4m3 weights with per-channel scales (model/fp8.py) instead of integers

    @property
    def symmetric(self) -> bool:
        # int8 loses nothing measurable without zero points; int4 needs them to use all 16 levels.
        return self.bits == 8

    @classmethod
    def from_flags(cls, name: str, group_size: int | None, lm_head: bool, embedding: bool) -> "QuantScheme":
        if name not in SCHEMES:
            raise Pt2ServeError(f"--quantize must be one of {', '.join(SCHEMES)}, got {name!r}")
        bits = SCHEMES[name]
        if name == "fp8":
            if group_size is not None:
                raise Pt2ServeError("--group-size does not apply to --quantize fp8: its weights have one scale per "
                                    "output channel and its activations one per token")
            if embedding:
                raise Pt2ServeError("--quantize-embedding does not apply to --quantize fp8: the embedding is a row "
                                    "gather, whose bytes no step is bound by; use int8 or int4 to shrink it")
            return cls(bits, None, lm_head, False, is_fp8=True)
        if group_size is not None:
            if group_size < 2:
                raise Pt2ServeError(f"--group-size must be at least 2, got {group_size}")
            if bits == 4 and group_size % 2:
                raise Pt2ServeError(f"--group-size must be even for int4 (two weights share a byte), got {group_size}")
        return cls(bits, group_size if group_size is not None else DEFAULT_GROUP_SIZE[bits], lm_head, embedding)


@dataclass(frozen=True)
class LinearFormat:
    """The packed format of one layer."""

    bits: int
    group_size: int | None  # None: one group per output row
    has_zeros: bool
    has_perm: bool = False


def _num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


class _PackedRows(nn.Module):
    """The buffers of an [out, in] packed matrix; see kernels/quant_format.py for the format."""

    def __init__(self, in_features: int, out_features: int, fmt: LinearFormat) -> None:
        super().__init__()
        if fmt.bits not in SUPPORTED_BITS:
            raise Pt2ServeError(f"{fmt.bits}-bit weights are not supported (only {SUPPORTED_BITS})")
        if in_features % values_per_byte(fmt.bits):
            raise Pt2ServeError(f"{fmt.bits}-bit packing needs an even number of inputs, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.format = fmt
        self.bits = fmt.bits
        self.group_size = fmt.group_size or in_features  # as the operator takes it
        num_groups = _num_groups(in_features, self.group_size)
        packed = in_features // values_per_byte(fmt.bits)
        self.register_buffer("qweight", torch.empty(out_features, packed, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, num_groups))
        self.register_buffer("zeros", torch.empty(out_features, num_groups, dtype=torch.uint8) if fmt.has_zeros else None)
        self.register_buffer("perm", torch.empty(in_features, dtype=torch.int64) if fmt.has_perm else None)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.qweight, self.scales, self.zeros, self.perm, self.bits, self.group_size)

    def dequantized(self) -> torch.Tensor:
        """[out, in] in the scales' dtype, columns in input order."""
        weight = dequantize(self.qweight, self.scales, self.zeros, self.bits, self.group_size)
        if self.perm is None:
            return weight
        return torch.empty_like(weight).index_copy_(1, self.perm, weight)

    @torch.no_grad()
    def fill(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             perm: torch.Tensor | None = None) -> None:
        """Store unsigned values q [out, in] (columns in stored order) with their scales, zeros and perm."""
        _copy_checked(self.qweight, pack(q, self.bits), "qweight")
        _copy_checked(self.scales, scales, "scales")
        if (zeros is None) != (self.zeros is None) or (perm is None) != (self.perm is None):
            raise Pt2ServeError("internal: quantized tensors do not match the layer's format")
        if zeros is not None:
            _copy_checked(self.zeros, zeros, "zeros")
        if perm is not None:
            _copy_checked(self.perm, perm, "perm")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group_size}"


def _copy_checked(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise Pt2ServeError(f"quantized {what} has shape {list(source.shape)}, the layer needs {list(target.shape)}")
    target.copy_(source)


class QuantizedLinear(_PackedRows):
    """y = x @ dequantize(W).T (+ bias), through the quant_linear operator."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: LinearFormat) -> None:
        super().__init__(in_features, out_features, fmt)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out if self.bias is None else out + self.bias


class QuantizedEmbedding(_PackedRows):
    """Token embedding from packed rows; `attend` makes it the tied LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: LinearFormat) -> None:
        if fmt.has_perm:
            raise Pt2ServeError("internal: an embedding has no input permutation")
        super().__init__(embedding_dim, num_embeddings, fmt)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        zeros = None if self.zeros is None else self.zeros.index_select(0, tokens)
        return dequantize(
            self.qweight.index_select(0, tokens), self.scales.index_select(0, tokens), zeros, self.bits,
            self.group_size,
        )

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


# ------------------------------------------------------------------------------------------------ swapping


def install_quantized_modules(model: nn.Module, formats: dict[str, LinearFormat]) -> None:
    """Replace each named nn.Linear or nn.Embedding of `model` by an empty quantized module of its format.

    The new module is made on the old one's device (meta included) with the old dtype for its scales and
    bias; fill it afterwards (or load a state dict into it).
    """
    for name, fmt in formats.items():
        old = model.get_submodule(name)
        device, dtype = old.weight.device, old.weight.dtype
        with torch.device(device):
            if isinstance(old, nn.Embedding):
                new = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, fmt)
            elif isinstance(old, nn.Linear):
                new = QuantizedLinear(old.in_features, old.out_features, old.bias is not None, fmt)
            else:
                raise Pt2ServeError(f"internal: {name} is a {type(old).__name__}, not a linear layer or embedding")
        model.set_submodule(name, new.to(dtype))


def quantizable_linears(model: nn.Module) -> list[str]:
    """Every linear layer of the decoder layers (the LM head and the embedding are opt-in)."""
    return [name for name, module in model.named_modules()
            if name.startswith("layers.") and isinstance(module, nn.Linear)]


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: QuantScheme) -> None:
    """RTN-quantize the model's linear layers (and the head / embedding when the scheme says so) in place."""
    names = quantizable_linears(model)
    tied = model.lm_head is None
    if scheme.is_fp8:
        if scheme.lm_head and tied:
            raise Pt2ServeError("--quantize-lm-head with fp8 needs an untied LM head: this model's head is its "
                                "embedding, which fp8 leaves unquantized")
        quantize_model_fp8(model, names + ["lm_head"] * scheme.lm_head)
        return
    if scheme.embedding or (tied and scheme.lm_head):
        names.append("embed_tokens")
    if scheme.lm_head and not tied:
        names.append("lm_head")
    fmt = LinearFormat(scheme.bits, scheme.group_size, has_zeros=not scheme.symmetric)
    for name in names:
        old = model.get_submodule(name)
        weight, bias = old.weight, getattr(old, "bias", None)
        install_quantized_modules(model, {name: fmt})
        new = model.get_submodule(name)
        q, scales, zeros = quantize_weight(weight, scheme.bits, new.group_size, scheme.symmetric, weight.dtype)
        new.fill(q, scales, zeros)
        if bias is not None:
            new.bias.copy_(bias)


def quantize_weight(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[N, K] float -> (unsigned values [N, K] uint8, scales [N, G] in scale_dtype, zeros [N, G] uint8 or None)."""
    num_rows, num_columns = weight.shape
    num_groups = _num_groups(num_columns, group_size)
    padded = F.pad(weight.float(), (0, num_groups * group_size - num_columns))  # zeros: exact in every format
    groups = padded.view(num_rows, num_groups, group_size)
    top = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scales = groups.abs().amax(-1) / (half - 1)
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scales = (high - low) / top
    scales = scales.to(scale_dtype)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)  # an all-zero group: any scale is exact
    step = scales.float()[..., None]
    if symmetric:
        zeros = None
        q = (groups / step).round().clamp(-half, half - 1) + half
    else:
        zeros = (-low[..., None] / step).round().clamp(0, top)
        q = ((groups / step).round() + zeros).clamp(0, top)
        zeros = zeros[..., 0].to(torch.uint8)
    q = q.view(num_rows, -1)[:, :num_columns].to(torch.uint8)
    return q, scales, zeros


# ------------------------------------------------------------------------------------------------ describing


def quantized_modules(model: nn.Module) -> dict[str, _PackedRows]:
    return {name: module for name, module in model.named_modules() if isinstance(module, _PackedRows)}


def describe_quantization(model: nn.Module, method: str) -> dict[str, Any] | None:
    """The artifact's quantization record (None for a float model): method, bits, groups, what is quantized."""
    fp8 = describe_fp8(model, method)
    if fp8 is not None:
        return fp8
    modules = quantized_modules(model)
    if not modules:
        return None
    bits = {m.bits for m in modules.values()}
    group_sizes = {m.format.group_size for m in modules.values()}
    if len(bits) != 1 or len(group_sizes) != 1:
        raise Pt2ServeError(f"layers quantized with different bits or group sizes ({sorted(bits)}, "
                            f"{sorted(group_sizes, key=str)}) are not supported")
    tied = model.lm_head is None
    bit_width = bits.pop()
    return {
        "method": method,
        "bits": bit_width,
        "packing": PACKING[bit_width],
        "group_size": group_sizes.pop(),
        "symmetric": all(m.zeros is None for m in modules.values()),
        "act_order": any(m.perm is not None for m in modules.values()),
        "num_layers_quantized": len(modules),
        "lm_head": "lm_head" in modules or (tied and "embed_tokens" in modules),
        "embedding": "embed_tokens" in modules,
    }


def install_from_record(model: nn.Module, weight_names: Iterable[str], record: dict[str, Any]) -> None:
    """Swap in the empty quantized layers an artifact's weights and quantization record describe."""
    if record.get("format") == FP8_FORMAT:
        install_fp8_modules(model, fp8_names_from_weights(weight_names))
    else:
        install_quantized_modules(model, formats_from_weights(weight_names, record))


def formats_from_weights(names: Iterable[str], record: dict[str, Any]) -> dict[str, LinearFormat]:
    """The quantized modules an artifact's weight names describe, with their formats (its quantization record)."""
    bits = record["bits"]
    # Records written before the packing was recorded: int8 bytes were the same, int4 nibbles were not.
    packing = record.get("packing", PACKING[8] if bits == 8 else "an earlier int4 layout")
    if packing != PACKING[bits]:
        raise Pt2ServeError(f"the artifact's int{bits} weights are packed as {packing}, this pt2serve reads "
                            f"{PACKING[bits]}; re-export it with this version")
    names = set(names)
    formats = {}
    for name in names:
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            formats[module] = LinearFormat(bits, record["group_size"], f"{module}.zeros" in names,
                                           f"{module}.perm" in names)
    return formats
