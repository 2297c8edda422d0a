"""Which kernel computes each weight matmul of a narrow step, chosen at export and traced into the method.

A decode step's matmuls are bound by reading the weights: the best kernel streams each weight once at the
memory bandwidth and starts and ends quickly, since a step runs four per layer back to back. cuBLAS is close
on large weights and loses microseconds per call on small ones; which kernel wins depends on the shape and
the width, so the exporter times them on the GPU (export/linear_tuning.py) and the model traces the winner of
each (kind, N, K, M, dtype) into the method. `LinearChoices` maps those keys to a launch config
(linear_configs.py) of the Triton kernels in small_m_linear.py; a shape without an entry stays a plain matmul
(cuBLAS). Nothing is tuned at load: the config is part of the traced call.

Quantized weights (kernels/quant_linear.py) always run their own small-M kernel at these widths; the choice
there is its launch config (QuantLaunchConfig, keyed by the weight's format as the kind, e.g. int4g128-zeros),
and a weight without an entry takes the kernel's default config.

This module needs no Triton: the model imports it on machines without one, and only a chosen key loads the
kernels (which import the configs from linear_configs.py, never this module).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from pt2serve.kernels import batch_invariant
from pt2serve.kernels.linear_configs import DENSE_KINDS, LaunchConfig, QuantFormat, QuantLaunchConfig

SMALL_M_MAX = 64
GEMV_M_MAX = 4  # the gemv kernel's products grow with M: wider, tensor cores do the multiply


# gemv holds BLOCK_M x BLOCK_N x BLOCK_K fp32 products per program (two sets with SwiGLU): at most this many
# per 128 threads keeps them in registers.
GEMV_PRODUCTS_MAX = 8192
# A few tiles per kind: each config is one Triton compile (about half a second) at export.
GEMV_TILES = ((8, 256), (8, 512), (16, 256), (4, 1024))  # block_n, block_k
DOT_TILES = ((16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4))  # block_n, block_k, warps, stages


def candidates(num_rows: int, swiglu: bool, weight_bytes: int = 2) -> list[LaunchConfig]:
    """The launch configs worth timing for M = num_rows <= SMALL_M_MAX, with weights of `weight_bytes` bytes
    an element (2: bf16 / fp16, 1: e4m3)."""
    configs = []
    if num_rows <= GEMV_M_MAX:
        block_m = _next_power_of_2(num_rows)
        products_per_tile = 2 if swiglu else 1
        for block_n, block_k in _per_weight_bytes(GEMV_TILES, weight_bytes):
            for num_warps in (4, 8):
                if block_m * block_n * block_k * products_per_tile <= GEMV_PRODUCTS_MAX * num_warps // 4:
                    configs.append(LaunchConfig(False, block_m, block_n, block_k, num_warps))
    block_m = max(16, _next_power_of_2(num_rows))
    for block_n, block_k, num_warps, num_stages in _per_weight_bytes(DOT_TILES, weight_bytes):
        configs.append(LaunchConfig(True, block_m, block_n, block_k, num_warps, num_stages))
    return configs


def _per_weight_bytes(tiles: tuple[tuple[int, ...], ...], weight_bytes: int) -> list[tuple[int, ...]]:
    """The tiles (block_n, block_k, ...), sized for 2-byte weights, and for 1-byte weights those tiles again
    with twice the columns: the same bytes in flight per load. On the H200 the e4m3 gemv with bf16's tiles
    streamed its weights at 66% of the copy bandwidth where bf16's reach 85% (docs/benchmarks.md)."""
    if weight_bytes == 2:
        return list(tiles)
    wide = [(block_n, block_k * 2, *rest) for block_n, block_k, *rest in tiles]
    return list(tiles) + [tile for tile in wide if tile not in tiles]


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def choice_key(kind: str, n: int, k: int, num_rows: int, dtype: torch.dtype) -> str:
    """kind is "linear", "swiglu" or a QuantFormat's kind; n is the weight's rows, k its inputs."""
    return f"{kind} {n}x{k} m{num_rows} {str(dtype).removeprefix('torch.')}"


class LinearChoices:
    """The kernel the export chose for each key it timed; keys it lacks stay plain matmuls."""

    def __init__(self, configs: dict[str, LaunchConfig | QuantLaunchConfig]) -> None:
        self.configs = configs

    def lookup(self, kind: str, x: torch.Tensor, weight: torch.Tensor) -> LaunchConfig | None:
        return self._lookup(kind, x, weight.shape[0], weight.shape[1])

    def lookup_quant(self, fmt: QuantFormat, x: torch.Tensor, n: int) -> QuantLaunchConfig | None:
        return self._lookup(fmt.kind, x, n, x.shape[-1])

    def _lookup(self, kind: str, x: torch.Tensor, n: int, k: int):
        num_rows = x.shape[0]
        if not self.configs or x.dim() != 2 or not is_concrete_int(num_rows) or int(num_rows) > SMALL_M_MAX:
            return None  # forward_others' width is data: it keeps the plain matmul
        return self.configs.get(choice_key(kind, n, k, int(num_rows), x.dtype))

    def to_dict(self) -> dict[str, dict]:
        return {key: config.to_dict() for key, config in self.configs.items()}

    @classmethod
    def from_dict(cls, raw: dict[str, dict]) -> "LinearChoices":
        return cls({key: _config_class(key)(**fields) for key, fields in raw.items()})


def _config_class(key: str) -> type:
    kind = key.split(" ", 1)[0]
    return LaunchConfig if kind in DENSE_KINDS else QuantLaunchConfig


_active = LinearChoices({})


@contextlib.contextmanager
def using(choices: LinearChoices) -> Iterator[None]:
    """Trace the model with these choices (read at trace time by `linear`, `swiglu_linear` and
    kernels/quant_linear.py's `quant_linear`)."""
    global _active
    previous, _active = _active, choices
    try:
        yield
    finally:
        _active = previous


def dense_choice(kind: str, x: torch.Tensor, weight: torch.Tensor) -> LaunchConfig | None:
    """The small-M kernel config the export chose for this kind of weight at x's width, if any."""
    return _active.lookup(kind, x, weight)


def quant_choice(fmt: QuantFormat, x: torch.Tensor, n: int) -> QuantLaunchConfig | None:
    """The config the export chose for a quantized weight of n rows in this format at x's width, if any."""
    return _active.lookup_quant(fmt, x, n)


def _call(x: torch.Tensor, weight: torch.Tensor, swiglu: bool, config: LaunchConfig) -> torch.Tensor:
    from pt2serve.kernels import small_m_linear  # noqa: F401  (registers torch.ops.pt2serve.small_m_linear)

    return torch.ops.pt2serve.small_m_linear(x, weight, swiglu, config.use_dot, config.block_m, config.block_n,
                                             config.block_k, config.num_warps, config.num_stages)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the small-M kernel where the export chose it for this shape and width (in a
    deterministic method: the batch-invariant formulation, at every width)."""
    if batch_invariant.is_tracing() and x.dim() == 2:
        return batch_invariant.linear(x, weight, bias)
    config = dense_choice("linear", x, weight)
    if config is None:
        return _cublas_linear(x, weight, bias)
    out = _call(x, weight, False, config)
    return out if bias is None else out + bias


def _cublas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, with a 2-D x passed as [1, T, K]. Given [T, K], Inductor turns the matmul and an add after it
    (the residual, after o_proj and down_proj) into one addmm, which on the GPU first copies the residual into
    its output: a device copy per call (64 a step for the 8B when both run on cuBLAS, 0.09 ms at T=32 on the
    H200). Through the view the add stays pointwise and joins the next RMSNorm's kernel, rounded as eager
    PyTorch rounds it."""
    if x.dim() == 2:
        return F.linear(x[None], weight, bias)[0]
    return F.linear(x, weight, bias)


def swiglu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a stacked gate/up projection weight [2I, K]: one fused kernel where chosen."""
    if batch_invariant.is_tracing() and x.dim() == 2:
        gate, up = batch_invariant.linear(x, weight).chunk(2, dim=-1)
        return F.silu(gate) * up
    config = dense_choice("swiglu", x, weight)
    if config is None:
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        return F.silu(gate) * up
    return _call(x, weight, True, config)
