"""FP8 linear layers and `export --quantize fp8`: e4m3 weights, one scale per output channel.

The format and its kernels are kernels/fp8_linear.py's. Like model/quant.py's integer layers, an Fp8Linear
replaces a float layer by name, holds its weight and scales as buffers (stored once in the artifact like
any weight), and is filled by whoever holds FP8 weights: the round-to-nearest quantizer below, an FP8
checkpoint's loader, or the artifact's weights (the eager peer).

Only the decoder's linear layers and, on request, an untied LM head: the embedding is a row gather, which
no matmul speeds up, so its bytes are never the step's bottleneck.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pt2serve.contract import FP8_FORMAT
from pt2serve.errors import Pt2ServeError
from pt2serve.kernels.fp8_linear import FP8_DTYPE, fp8_linear, fp8_swiglu, quantize_rows

SCALE_SUFFIX = "weight_scale"


class Fp8Linear(nn.Module):
    """y = x @ (weight * weight_scale[:, None]).T (+ bias), x quantized per token."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer(SCALE_SUFFIX, torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_linear(x, self.weight, self.weight_scale)
        return out if self.bias is None else out + self.bias

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a stacked gate/up projection (model.MLP asks projections that can fuse it)."""
        return fp8_swiglu(x, self.weight, self.weight_scale)

    @torch.no_grad()
    def fill(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Store e4m3 values [out, in] and their fp32 scales [out]."""
        for target, source, what in ((self.weight, weight, "weight"), (self.weight_scale, scale, SCALE_SUFFIX)):
            if tuple(target.shape) != tuple(source.shape):
                raise Pt2ServeError(f"fp8 {what} has shape {list(source.shape)}, the layer needs {list(target.shape)}")
            target.copy_(source)

    def dequantized(self) -> torch.Tensor:
        """[out, in] fp32: the weight the layer multiplies by."""
        return self.weight.float() * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, e4m3, per-channel scales"


def install_fp8_modules(model: nn.Module, names: Iterable[str]) -> None:
    """Replace each named nn.Linear of `model` by an empty Fp8Linear on its device, bias in its dtype."""
    for name in names:
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise Pt2ServeError(f"internal: {name} is a {type(old).__name__}, not a linear layer")
        with torch.device(old.weight.device):
            new = Fp8Linear(old.in_features, old.out_features, old.bias is not None, old.weight.dtype)
        model.set_submodule(name, new)


@torch.no_grad()
def quantize_model_fp8(model: nn.Module, names: list[str]) -> None:
    """Round-to-nearest FP8 of the named linear layers, in place: each row scaled to e4m3's range."""
    for name in names:
        old = model.get_submodule(name)
        weight, bias = old.weight, old.bias
        install_fp8_modules(model, [name])
        new = model.get_submodule(name)
        new.fill(*quantize_rows(weight))
        if bias is not None:
            new.bias.copy_(bias)


def fp8_modules(model: nn.Module) -> dict[str, Fp8Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, Fp8Linear)}


def describe_fp8(model: nn.Module, method: str) -> dict[str, Any] | None:
    """The artifact's quantization record of an FP8 model (None without FP8 layers)."""
    modules = fp8_modules(model)
    if not modules:
        return None
    return {
        "method": method,
        "format": FP8_FORMAT,
        "bits": 8,
        "weight_scales": "per-channel",
        "activations": "dynamic per-token",
        "num_layers_quantized": len(modules),
        "lm_head": "lm_head" in modules,
        "embedding": False,
    }


def fp8_names_from_weights(names: Iterable[str]) -> list[str]:
    """The Fp8Linear modules an artifact's weight names describe (each has a weight_scale)."""
    suffix = "." + SCALE_SUFFIX
    return sorted(name.removesuffix(suffix) for name in names if name.endswith(suffix))
