"""Triton kernels of the weight matmuls of narrow steps (M <= 64 rows): one pass over the weight.

The operator torch.ops.pt2serve.small_m_linear (triton_op: AOTInductor compiles it into the artifact and it
runs inside CUDA graphs like any other kernel) takes its launch config as arguments; which config, or
cuBLAS, serves each shape and width is chosen at export (kernels/linear_choice.py). Two kernels:
- gemv (M <= 4): each program owns BLOCK_N output columns and walks K, multiplying each weight into
  per-column partial products of each row of x; the products are summed once after the loop, so the loop
  holds no cross-thread reduction. K is not split: every projection of the models served here has
  thousands of output rows, enough programs to fill the GPU.
- dot: the same walk with tl.dot on tensor cores (x padded to 16 rows).
Either fuses SwiGLU on request: for a stacked gate/up weight [2I, K] the program reads gate row n and up
row I + n and writes silu(gate) * up ([M, I]) instead of the [M, 2I] projection: one kernel and one round
trip of the intermediate less per layer.
The same kernels serve FP8 weights (kernels/fp8_linear.py, operator torch.ops.pt2serve.small_m_fp8_linear):
x and W in e4m3, the fp32 sums multiplied by x's per-row and W's per-output-channel scales before the
activation; gemv widens the e4m3 values in registers, dot feeds them to FP8 tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from pt2serve.kernels.linear_configs import LaunchConfig


@triton.jit
def _load_tile(rows_ptr, k, row_mask, K):
    """[rows, BLOCK_K] of a row-major matrix at columns k, 0 outside it."""
    return tl.load(rows_ptr + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def small_m_linear_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    SWIGLU: tl.constexpr, USE_DOT: tl.constexpr, HAS_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program n: out[:, n*BLOCK_N ..] = x @ W[rows].T over all of K (with SWIGLU: silu(x @ Wg.T) * (x @ Wu.T),
    Wg = W[:N], Wu = W[N:]); with HAS_SCALES each sum is multiplied by x_scale[m] * w_scale[n] first."""
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    u_rows = w_rows + N * stride_wn  # the up half's rows (read only with SWIGLU)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # Triton pipelines these loads (num_stages): they feed tl.dot
            k = k0 + offs_k
            x = _load_tile(x_rows, k, m_mask, K)
            acc = tl.dot(x, tl.trans(_load_tile(w_rows, k, n_mask, K)), acc, input_precision=DOT_PRECISION)
            if SWIGLU:
                acc_up = tl.dot(x, tl.trans(_load_tile(u_rows, k, n_mask, K)), acc_up,
                                input_precision=DOT_PRECISION)
    else:
        # Loads that feed no tl.dot are not pipelined: each step loads the next step's weights before it
        # multiplies its own, so two steps' bytes are in flight per program.
        products = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        products_up = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        w = _load_tile(w_rows, offs_k, n_mask, K)
        u = w
        if SWIGLU:
            u = _load_tile(u_rows, offs_k, n_mask, K)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            next_k = k + BLOCK_K
            next_w = _load_tile(w_rows, next_k, n_mask, K)
            next_u = next_w
            if SWIGLU:
                next_u = _load_tile(u_rows, next_k, n_mask, K)
            x = _load_tile(x_rows, k, m_mask, K).to(tl.float32)[:, None, :]
            products += x * w.to(tl.float32)[None, :, :]
            if SWIGLU:
                products_up += x * u.to(tl.float32)[None, :, :]
            w, u = next_w, next_u
        acc = tl.sum(products, axis=2)
        acc_up = tl.sum(products_up, axis=2)
    if HAS_SCALES:
        x_scale = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
        acc = acc * x_scale * tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if SWIGLU:
            acc_up = acc_up * x_scale * tl.load(w_scale_ptr + N + offs_n, mask=n_mask, other=0.0)[None, :]
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    swiglu: bool,
    config: LaunchConfig,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight.T -> [M, N] in x's dtype (swiglu: weight [2I, K] -> silu(gate) * up [M, I]).

    With scales (x_scale [M, 1], w_scale [N or 2I], fp32): x and weight are e4m3 and the output is bf16.
    """
    num_rows, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if num_rows > config.block_m:
        raise ValueError(f"{config.name} holds {config.block_m} rows, not {num_rows}")
    out = torch.empty((num_rows, n), device=x.device, dtype=x.dtype if scales is None else torch.bfloat16)
    # Without scales the kernel never reads the scale pointers: x stands in for them.
    x_scale, w_scale = scales if scales is not None else (x, x)
    wrap_triton(small_m_linear_kernel)[(triton.cdiv(n, config.block_n),)](
        x, weight, out, x_scale, w_scale, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        SWIGLU=swiglu, USE_DOT=config.use_dot, HAS_SCALES=scales is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        # fp32 activations (fp32 exports) stay fp32 in tl.dot instead of rounding through tf32.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


@triton_op("pt2serve::small_m_linear", mutates_args=())
def small_m_linear_op(
    x: torch.Tensor, weight: torch.Tensor, swiglu: bool, use_dot: bool, block_m: int, block_n: int, block_k: int,
    num_warps: int, num_stages: int,
) -> torch.Tensor:
    """The operator behind `linear` and `swiglu_linear`; the launch config is part of the traced call."""
    config = LaunchConfig(use_dot, block_m, block_n, block_k, num_warps, num_stages)
    return launch(x.contiguous(), weight, swiglu, config)


@triton_op("pt2serve::small_m_fp8_linear", mutates_args=())
def small_m_fp8_linear_op(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, swiglu: bool,
    use_dot: bool, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
) -> torch.Tensor:
    """The small-M operator of FP8 weights (kernels/fp8_linear.py): e4m3 x and W, their scales, bf16 out."""
    config = LaunchConfig(use_dot, block_m, block_n, block_k, num_warps, num_stages)
    return launch(x_q.contiguous(), weight, swiglu, config, (x_scale.contiguous(), weight_scale))
