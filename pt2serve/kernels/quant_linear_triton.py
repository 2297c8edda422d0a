"""Triton kernels of the weight-only quantized linear (format and reference: quant_linear.py).

Registered as torch.ops.pt2serve.quant_linear with torch.library.triton_op, so torch.export keeps the op and
AOTInductor compiles its kernels into the artifact; it runs inside CUDA graphs like any other kernel.

- Small M (decode-sized steps, M <= SMALL_M_MAX): each program owns BLOCK_N outputs of one K split, so the
  packed weights are read once and dequantized in registers; every row of x rides along in one tl.dot. K is
  split when N alone gives too few programs to keep the memory system busy; the splits write fp32 partial
  sums that one reduction adds (deterministic, unlike atomics).
- Wide M: a tiled matmul whose weight tiles are dequantized in registers before tl.dot.

A static method's width is known when it is traced, so it gets the one kernel that suits it. In the dynamic
method (forward_others) the width is data: both kernels are launched and each returns at once unless the
width is in its range.

Kernels take sizes as plain ints (constexpr sizes would be specialized silently); the format's constants
(bits, group size, whether zeros and perm exist) are constexpr: they never change for a weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.library import triton_op, wrap_triton

SMALL_M_MAX = 64
# Streaming multiprocessors assumed off the GPU (kernels run under TRITON_INTERPRET in tests): an H200's.
DEFAULT_NUM_SMS = 132


@triton.jit
def _accumulate_tile(
    acc, x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr,
    offs_m, m_mask, offs_n, n_mask, k0, K, num_groups, stride_xm, stride_qn,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] += x[offs_m, k0 : k0 + BLOCK_K] @ W[offs_n, k0 : k0 + BLOCK_K].T"""
    PER_BYTE: tl.constexpr = 8 // BITS
    BLOCK_B: tl.constexpr = BLOCK_K // PER_BYTE  # packed bytes of one row in this tile
    MIDPOINT: tl.constexpr = 1 << (BITS - 1)  # the zero of a symmetric format
    offs_b = k0 // PER_BYTE + tl.arange(0, BLOCK_B)
    b_mask = offs_b < K // PER_BYTE
    w_mask = b_mask[:, None] & n_mask[None, :]
    # [BLOCK_B, BLOCK_N]: W's tile already transposed for tl.dot; each row's bytes are contiguous.
    packed = tl.load(qweight_ptr + offs_n[None, :] * stride_qn + offs_b[:, None], mask=w_mask, other=0)
    if GROUP_SIZE % BLOCK_K == 0:
        # The tile lies in one group (k0 is a multiple of BLOCK_K): one scale per output.
        group_offs = offs_n[None, :] * num_groups + k0 // GROUP_SIZE
        group_mask = n_mask[None, :]
    else:
        # A byte's columns share a group (the group size is even for 4 bits): one scale per byte.
        group_offs = offs_n[None, :] * num_groups + (offs_b[:, None] * PER_BYTE) // GROUP_SIZE
        group_mask = w_mask
    scale = tl.load(scales_ptr + group_offs, mask=group_mask, other=0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + group_offs, mask=group_mask, other=0).to(tl.float32)
    else:
        zero = MIDPOINT
    x_dtype = x_ptr.dtype.element_ty
    x_mask = m_mask[:, None] & b_mask[None, :]
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    if BITS == 4:
        w_low = (((packed & 15).to(tl.float32) - zero) * scale).to(x_dtype)
        w_high = (((packed >> 4).to(tl.float32) - zero) * scale).to(x_dtype)
        # The low nibble holds column 2b, the high one 2b + 1; perm says which input feature each column is.
        columns = offs_b * 2
        if HAS_PERM:
            in_low = tl.load(perm_ptr + columns, mask=b_mask, other=0)
            in_high = tl.load(perm_ptr + columns + 1, mask=b_mask, other=0)
        else:
            in_low = columns
            in_high = columns + 1
        x_low = tl.load(x_rows + in_low[None, :], mask=x_mask, other=0)
        x_high = tl.load(x_rows + in_high[None, :], mask=x_mask, other=0)
        acc = tl.dot(x_low, w_low, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(x_high, w_high, acc, input_precision=DOT_PRECISION)
    else:
        w = ((packed.to(tl.float32) - zero) * scale).to(x_dtype)
        if HAS_PERM:
            inputs = tl.load(perm_ptr + offs_b, mask=b_mask, other=0)
        else:
            inputs = offs_b
        x = tl.load(x_rows + inputs[None, :], mask=x_mask, other=0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def quant_linear_small_m_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, out_ptr,
    M, N, K, num_groups, k_per_split, m_limit, stride_xm, stride_qn,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (n, s): outputs n*BLOCK_N.. of all M rows over K split s, into out[s] ([splits, M, N])."""
    if M > m_limit:  # a dynamic width too wide for this kernel: the wide one computes it
        return
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        acc = _accumulate_tile(
            acc, x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr,
            offs_m, m_mask, offs_n, n_mask, k0, K, num_groups, stride_xm, stride_qn,
            BITS, GROUP_SIZE, HAS_ZEROS, HAS_PERM, BLOCK_K, DOT_PRECISION,
        )
    out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def quant_linear_wide_m_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, out_ptr,
    M, N, K, num_groups, m_floor, stride_xm, stride_qn,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of out per program."""
    if M <= m_floor:  # a dynamic width narrow enough for the small-M kernel, which computes it
        return
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: TILE_GROUP_M row tiles in a row take the same weight tile while it is in L2.
    num_pid_in_group = TILE_GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * TILE_GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, TILE_GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_rows
    pid_n = (pid % num_pid_in_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _accumulate_tile(
            acc, x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr,
            offs_m, m_mask, offs_n, n_mask, k0, K, num_groups, stride_xm, stride_qn,
            BITS, GROUP_SIZE, HAS_ZEROS, HAS_PERM, BLOCK_K, DOT_PRECISION,
        )
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch shape of one kernel call (chosen from the shapes; not yet tuned on a GPU)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # small-M kernel only


def small_m_config(num_rows: int, n: int, k: int, bits: int, num_sms: int) -> LaunchConfig:
    """For M <= SMALL_M_MAX rows: every row in one tl.dot; split K until the GPU has two programs per SM.

    A split's partial sums (M x N fp32, written and read once) must stay small next to the packed
    weights it saves reading in parallel, so wider M splits less.
    """
    block_m = max(16, triton.next_power_of_2(num_rows))
    block_n = 32
    block_k = 256 if bits == 4 else 128  # 128 bytes of each weight row per tile: one cache line
    programs_n = triton.cdiv(n, block_n)
    wanted = triton.cdiv(2 * num_sms, programs_n)
    affordable = max(1, (k * bits) // (512 * num_rows))  # partial bytes <= 1/8 of the weight bytes
    split = max(1, min(wanted, affordable, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return LaunchConfig(block_m, block_n, block_k, num_warps=4, num_stages=3, split_k=triton.cdiv(k, k_per_split))


def wide_m_config(bits: int) -> LaunchConfig:
    """For M > SMALL_M_MAX: a standard bf16 tensor-core tile (one config: AOTInductor tunes on the traced
    example width, not on the widths the dynamic method later runs)."""
    return LaunchConfig(block_m=128, block_n=128, block_k=64 if bits == 4 else 32, num_warps=8, num_stages=3)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _format_args(x, qweight, scales, zeros, perm, bits, group_size) -> tuple[list, dict]:
    """Tensor arguments (a present tensor stands in for an absent zeros / perm: never read) and constexprs."""
    tensors = [x, qweight, scales, zeros if zeros is not None else scales, perm if perm is not None else qweight]
    constants = {
        "BITS": bits, "GROUP_SIZE": group_size, "HAS_ZEROS": zeros is not None, "HAS_PERM": perm is not None,
        # fp32 activations (fp32 exports) stay fp32 in tl.dot instead of rounding through tf32.
        "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
    }
    return tensors, constants


def launch_small_m(
    x, qweight, scales, zeros, perm, bits: int, group_size: int, config: LaunchConfig, m_limit: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The small-M kernel; returns out [M, N] (allocated unless given, which needs split_k == 1)."""
    num_rows, k = x.shape
    n = qweight.shape[0]
    tensors, constants = _format_args(x, qweight, scales, zeros, perm, bits, group_size)
    if config.split_k == 1:
        target = out if out is not None else x.new_empty((num_rows, n))
    else:
        target = x.new_empty((config.split_k, num_rows, n), dtype=torch.float32)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    wrap_triton(quant_linear_small_m_kernel)[grid](
        *tensors, target,
        num_rows, n, k, scales.shape[1], k_per_split, m_limit, x.stride(0), qweight.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **constants,
    )
    if config.split_k == 1:
        return target
    return target.sum(0).to(x.dtype)


def launch_wide_m(
    x, qweight, scales, zeros, perm, bits: int, group_size: int, config: LaunchConfig, m_floor: int,
    out: torch.Tensor,
) -> None:
    """The wide-M kernel, writing out [M, N]."""
    num_rows, k = x.shape
    n = qweight.shape[0]
    tensors, constants = _format_args(x, qweight, scales, zeros, perm, bits, group_size)
    grid = (triton.cdiv(num_rows, config.block_m) * triton.cdiv(n, config.block_n),)
    wrap_triton(quant_linear_wide_m_kernel)[grid](
        *tensors, out,
        num_rows, n, k, scales.shape[1], m_floor, x.stride(0), qweight.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, TILE_GROUP_M=8,
        num_warps=config.num_warps, num_stages=config.num_stages, **constants,
    )


@triton_op("pt2serve::quant_linear", mutates_args=())
def quant_linear_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype."""
    x = x.contiguous()
    num_rows, k = x.shape
    n = qweight.shape[0]
    if is_concrete_int(num_rows):
        if num_rows <= SMALL_M_MAX:
            config = small_m_config(num_rows, n, k, bits, _num_sms(x.device))
            return launch_small_m(x, qweight, scales, zeros, perm, bits, group_size, config, m_limit=num_rows)
        out = x.new_empty((num_rows, n))
        launch_wide_m(x, qweight, scales, zeros, perm, bits, group_size, wide_m_config(bits), 0, out)
        return out
    # A dynamic width: both kernels write the same output; exactly one of them finds work.
    out = x.new_empty((num_rows, n))
    small = small_m_config(SMALL_M_MAX, n, k, bits, _num_sms(x.device))
    unsplit = LaunchConfig(small.block_m, small.block_n, small.block_k, small.num_warps, small.num_stages)
    launch_small_m(x, qweight, scales, zeros, perm, bits, group_size, unsplit, m_limit=SMALL_M_MAX, out=out)
    launch_wide_m(x, qweight, scales, zeros, perm, bits, group_size, wide_m_config(bits), SMALL_M_MAX, out)
    return out
