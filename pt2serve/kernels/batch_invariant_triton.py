"""The CUDA kernels of deterministic artifacts: a matmul and an RMSNorm whose every row runs the same
instructions in the same order at any number of rows (kernels/batch_invariant.py says why).

- matmul: one tile config for every M (BLOCK_M x BLOCK_N, K walked in BLOCK_K steps from 0), so a row meets
  the same tensor-core instructions in the same order whether it is alone or one of 4,096; K is split over
  `k_splits(N, K)` programs, a function of the weight's shape alone, so a decode step still fills the GPU,
  and the splits' fp32 partial sums are added by a second kernel in split order. The LM head is a matmul too.
- RMSNorm: one program per row, the hidden size walked in fixed chunks, whatever the number of rows
  (Inductor picks a reduction's tiles from the number of rows: torch 2.11 has no switch against it).
Both are registered with torch.library.triton_op, so AOTInductor compiles them into the artifact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

# One tile for every M. 64 rows: the prefill tile a wide step needs (narrower tiles would read the weight once
# per 16 rows); a decode row pays the tile's unused rows in tensor-core work, not in weight bytes.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3
# K is split until a one-tile-high step has about this many programs (two per SM of an H200), at most
# MAX_K_SPLITS ways and never below MIN_K_PER_SPLIT inputs per split.
TARGET_PROGRAMS = 264
MAX_K_SPLITS = 8
MIN_K_PER_SPLIT = 512
NORM_BLOCK = 1024


def k_splits(n: int, k: int) -> int:
    """How many programs share a weight's K: a function of its shape alone, never of the step's width."""
    column_blocks = triton.cdiv(n, BLOCK_N)
    return max(1, min(MAX_K_SPLITS, TARGET_PROGRAMS // column_blocks, k // MIN_K_PER_SPLIT))


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    """Program (m, n, s): rows m*BLOCK_M.., columns n*BLOCK_N.. of x @ W.T over K's split s; PARTIAL: its fp32
    sum goes to out[s] ([S, M, N]), else the whole sum in out's dtype."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    offsets = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + split.to(tl.int64) * M * N + offsets, acc, mask=mask)
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = partial[0] + partial[1] + ... in that order, element by element."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    partial = partial_ptr + offsets
    total = tl.load(partial, mask=ok, other=0.0)
    for _ in tl.static_range(1, SPLITS):
        partial += numel  # a 64-bit pointer: S x M x N may pass 2^31
        total += tl.load(partial, mask=ok, other=0.0)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=ok)


def launch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in x's dtype."""
    num_rows, k = x.shape
    n = weight.shape[0]
    splits = k_splits(n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    out = torch.empty((num_rows, n), device=x.device, dtype=x.dtype)
    partial = out if splits == 1 else torch.empty((splits, num_rows, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(num_rows, BLOCK_M), triton.cdiv(n, BLOCK_N), splits)
    wrap_triton(_matmul_kernel)[grid](
        x, weight, partial, num_rows, n, k, x.stride(0), weight.stride(0), k_per_split,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        # fp32 artifacts are compared token for token with fp32 references: no tf32 in their dots.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PARTIAL=splits > 1,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if splits > 1:
        block = 1024
        wrap_triton(_sum_splits_kernel)[(triton.cdiv(num_rows * n, block),)](
            partial, out, num_rows * n, SPLITS=splits, BLOCK=block, num_warps=4)
    return out


@triton_op("pt2serve::batch_invariant_linear", mutates_args=())
def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight.T with a row's sums taken in the same order at every M."""
    return launch_linear(x.contiguous(), weight)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, EPS: tl.constexpr, BLOCK: tl.constexpr):
    """One row: out = w * (x * rsqrt(mean(x^2) + eps)), normalised in fp32 and rounded to x's dtype before the
    scale (as the model's RMSNorm); the sum of squares over fixed BLOCK chunks, added in order."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / N + EPS)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton_op("pt2serve::batch_invariant_rms_norm", mutates_args=())
def batch_invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [M, N], one program per row."""
    x = x.contiguous()
    num_rows, n = x.shape
    out = torch.empty_like(x)
    block = min(NORM_BLOCK, triton.next_power_of_2(n))
    wrap_triton(_rms_norm_kernel)[(num_rows,)](x, weight, out, n, x.stride(0), EPS=eps, BLOCK=block, num_warps=4)
    return out
