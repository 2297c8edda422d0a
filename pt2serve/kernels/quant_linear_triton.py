"""Triton kernels of the weight-only quantized linear (format and reference: quant_format.py).

Registered as torch.ops.pt2serve.quant_linear with torch.library.triton_op, so torch.export keeps the op and
AOTInductor compiles its kernels (and the torch ops around them) into the artifact; it runs inside CUDA
graphs like any other kernel.

Which path serves a call is fixed when the method is traced:
- Small M (a static width <= SMALL_M_MAX: decode-sized steps). The packed weights are read once and
  dequantized in registers; the time is the packed bytes over the memory bandwidth, so every program
  streams whole runs of each row (64-256 bytes) and K is split until the GPU holds enough programs to keep
  that many bytes in flight. The splits write fp32 partial sums that one reduction adds (deterministic,
  unlike atomics). The launch config is the export's choice for the weight's shape, format and width
  (torch.ops.pt2serve.quant_linear_small_m; kernels/linear_choice.py), or else small_m_config's default
  (torch.ops.pt2serve.quant_linear). Two kernels, picked by the launch config:
  - gemv: no tensor cores; each weight is multiplied into per-column partial products of each row of x,
    summed across the tile once after the loop (the fewest instructions per weight byte, and no
    cross-thread reduction inside the loop; for M up to GEMV_M_MAX). At M = 1 the tiles keep the packed
    load's lanes of GEMV_LANE bytes per thread instead: the weights never move between threads, and a
    run's scale multiplies each lane's sum instead of each weight (_one_row_run); x reaches the threads
    through shared memory, or (x_direct) each thread loads its own from L1 with no barrier;
  - dot: every row of x rides along in one tl.dot (BLOCK_M padded to 16).
- Wide M (a static width > SMALL_M_MAX, and the dynamic method forward_others, whose width is data):
  one kernel dequantizes the whole weight into x's dtype (reading each packed byte once, writing the bf16
  matrix once), then cuBLAS multiplies. For M in the hundreds the matmul costs more than the dequantization,
  so this runs near the bf16 rate; forward_others serves narrow steps too when CUDA graphs are off, and
  then pays the dequantization on every call.

A run (one nibble, or the byte, of BLOCK_B consecutive bytes: consecutive columns, see quant_format.py)
lies inside one group whenever the group size is a multiple of BLOCK_B (UNIFORM_GROUPS); then the kernels
load one scale and zero per row and run instead of per weight, and the dot kernel multiplies x by the
exact q - zero (an integer of at most 9 bits: exact in bf16 and fp16) and scales the run's product once
per row. Otherwise each weight is scaled with its own column's group.

When BLOCK_B divides the row's bytes (EVEN_B, decided on the host), every step is whole or lies past
the end, so whether its bytes exist is one compare per step instead of one per byte (the loads are
16-byte vectors either way: the sizes' divisibility by 16 tells Triton so). The row masks are constant
along the byte axis and do not stop whole-vector loads.

Integers become floats by the exponent trick (OR into the mantissa of 2**23, then subtract 2**23, folded
with the zero, which becomes zero + 2**23 by the same OR): two full-rate instructions instead of an
int-to-float conversion, which runs at a fraction of the rate and would cap int4 below the bandwidth.
scripts/quant_kernel_ptx.py counts the small-M loop's instructions per weight, compiled for sm_90.

Kernels take sizes as plain ints (constexpr sizes would be specialized silently); the format's constants
(bits, group size, whether zeros and perm exist) are constexpr: they never change for a weight.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.library import triton_op, wrap_triton

from pt2serve.kernels.linear_configs import QuantLaunchConfig
from pt2serve.kernels.quant_format import INT4_BLOCK_COLUMNS

SMALL_M_MAX = 64
GEMV_M_MAX = 8  # the gemv kernel's broadcast product grows with M: above this, tensor cores win
# Streaming multiprocessors assumed off the GPU (kernels run under TRITON_INTERPRET in tests): an H200's.
DEFAULT_NUM_SMS = 132
INT4_HALF_BLOCK_BYTES = INT4_BLOCK_COLUMNS // 2
# Globals a kernel reads must be constexpr.
HALF_BLOCK_BYTES = tl.constexpr(INT4_HALF_BLOCK_BYTES)
# Bytes of a row per thread in the one-row gemv: one 16-byte load, whose 16 products (per nibble run) one
# thread sums before scaling them. 8 measured more instructions per weight (scripts/quant_kernel_ptx.py).
GEMV_LANE = tl.constexpr(16)
MAGIC = tl.constexpr(8388608.0)  # 2**23: a float32 whose mantissa holds any integer below 2**23 exactly


# ------------------------------------------------------------------------------------------------ shared pieces


@triton.jit
def _int4_run_starts(b0, K):
    """First columns of the low- and high-nibble runs of the bytes b0.. (a run never crosses a block)."""
    block = b0 // HALF_BLOCK_BYTES
    block_column = block * 2 * HALF_BLOCK_BYTES
    half = tl.minimum(2 * HALF_BLOCK_BYTES, K - block_column) // 2  # a short last block is split in its middle
    low = block_column + (b0 - block * HALF_BLOCK_BYTES)
    return low, low + half


@triton.jit
def _byte_mask(b0, b_end, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr):
    """Which bytes b0 .. b0 + BLOCK_B of a row exist, broadcast along the bytes. With EVEN_B a step is
    whole or past the end (the gemv loop loads one step past its split), so one mask holds for the step
    ([1]); otherwise one per byte ([BLOCK_B])."""
    if EVEN_B:
        offs = b0 + tl.arange(0, 1)
    else:
        offs = b0 + tl.arange(0, BLOCK_B)
    return offs < b_end


@triton.jit
def _run_columns(start, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr):
    """The columns start .. start + BLOCK_B of a run. With EVEN_B every run starts at a multiple of BLOCK_B
    (steps start at multiples of BLOCK_B, and a short int4 block's halves are whole steps), which lets
    Triton load x in whole vectors."""
    columns = start + tl.arange(0, BLOCK_B)
    if EVEN_B:
        columns = tl.max_contiguous(tl.multiple_of(columns, BLOCK_B), BLOCK_B)
    return columns


@triton.jit
def _plus_magic(q):
    """MAGIC + q exactly, as float32, for int32 q in [0, 2**23): the exponent trick (see above)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _run_weights(
    q, start, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask, num_groups,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, UNIFORM_GROUPS: tl.constexpr,
    BLOCK_B: tl.constexpr, LANES: tl.constexpr,
):
    """q [BLOCK_N, BLOCK_B] int32 values of columns start.. -> (w fp32, scale [BLOCK_N]): W = w * scale[:, None].
    LANES: q and b_mask are lane-shaped instead ([BLOCK_N, BLOCK_B // GEMV_LANE, GEMV_LANE], see _lane_offsets).

    With UNIFORM_GROUPS the run lies in one group: w = q - zero exactly, the scale is the run's. Otherwise
    w is already scaled per column and the returned scale is 1.
    """
    MIDPOINT: tl.constexpr = 1 << (BITS - 1)  # the zero of a symmetric format
    as_float = _plus_magic(q)
    if UNIFORM_GROUPS:
        group = offs_n * num_groups + start // GROUP_SIZE
        scale = tl.load(scales_ptr + group, mask=n_mask, other=0).to(tl.float32)
        if HAS_ZEROS:
            zero_plus_magic = _plus_magic(tl.load(zeros_ptr + group, mask=n_mask, other=0).to(tl.int32))
        else:
            zero_plus_magic = tl.zeros_like(scale) + (MAGIC + MIDPOINT)
        if LANES:
            w = as_float - zero_plus_magic[:, None, None]
        else:
            w = as_float - zero_plus_magic[:, None]
    else:
        if LANES:
            column_groups = (start + _lane_offsets(BLOCK_B)) // GROUP_SIZE
            group = offs_n[:, None, None] * num_groups + column_groups[None, :, :]
            mask = n_mask[:, None, None] & b_mask[None, :, :]
        else:
            columns = start + tl.arange(0, BLOCK_B)
            group = offs_n[:, None] * num_groups + columns[None, :] // GROUP_SIZE
            mask = n_mask[:, None] & b_mask[None, :]
        column_scale = tl.load(scales_ptr + group, mask=mask, other=0).to(tl.float32)
        if HAS_ZEROS:
            w = as_float - _plus_magic(tl.load(zeros_ptr + group, mask=mask, other=0).to(tl.int32))
        else:
            w = as_float - (MAGIC + MIDPOINT)
        w = w * column_scale
        scale = tl.zeros_like(offs_n).to(tl.float32) + 1.0
    return w, scale


@triton.jit
def _load_x_run(x_ptr, perm_ptr, start, offs_m, m_mask, b_mask, stride_xm,
                HAS_PERM: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr):
    """x[offs_m, input features of columns start .. start + BLOCK_B] ([BLOCK_M, BLOCK_B]; 0 past the row)."""
    columns = _run_columns(start, BLOCK_B, EVEN_B)
    if HAS_PERM:
        columns = tl.load(perm_ptr + columns, mask=b_mask, other=0)
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + columns[None, :],
                   mask=m_mask[:, None] & b_mask[None, :], other=0)


@triton.jit
def _load_packed(qweight_ptr, offs_n, n_mask, offs_b, b_mask, stride_qn, BLOCK_B: tl.constexpr):
    """[BLOCK_N, BLOCK_B] bytes as int32: each row's run is contiguous (and starts at a multiple of BLOCK_B)."""
    offs_b = tl.max_contiguous(tl.multiple_of(offs_b, BLOCK_B), BLOCK_B)
    packed = tl.load(qweight_ptr + offs_n[:, None] * stride_qn + offs_b[None, :],
                     mask=n_mask[:, None] & b_mask[None, :], other=0)
    return packed.to(tl.int32)


# ------------------------------------------------------------------------------------------------ small M


@triton.jit
def _accumulate_run(
    acc, q, start, x_ptr, perm_ptr, scales_ptr, zeros_ptr, offs_m, m_mask, offs_n, n_mask, b_mask,
    num_groups, stride_xm,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    UNIFORM_GROUPS: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Adds x[:, run's inputs] @ W[offs_n, run].T for one run of BLOCK_B columns to acc.

    dot: acc [BLOCK_M, BLOCK_N]. gemv: acc [BLOCK_M, BLOCK_N, BLOCK_B] holds per-column products, summed
    once after the loop, so the loop has no cross-thread reduction: one multiply-add per weight and row.
    """
    w, scale = _run_weights(q, start, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask, num_groups,
                            BITS, GROUP_SIZE, HAS_ZEROS, UNIFORM_GROUPS, BLOCK_B, LANES=False)
    x = _load_x_run(x_ptr, perm_ptr, start, offs_m, m_mask, b_mask, stride_xm, HAS_PERM, BLOCK_B, EVEN_B)
    if USE_DOT:
        acc = acc + tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION) * scale[None, :]
    else:
        if UNIFORM_GROUPS:
            w = w * scale[:, None]
        acc = acc + w[None, :, :] * x.to(tl.float32)[:, None, :]
    return acc


@triton.jit
def _accumulate_step(
    acc, packed, b0, b_mask, K, x_ptr, perm_ptr, scales_ptr, zeros_ptr, offs_m, m_mask, offs_n, n_mask,
    num_groups, stride_xm,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    UNIFORM_GROUPS: tl.constexpr, USE_DOT: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Adds the products of one step's packed bytes (b0 .. b0 + BLOCK_B of each row) to acc."""
    if BITS == 4:
        low, high = _int4_run_starts(b0, K)
        acc = _accumulate_run(acc, packed & 15, low, x_ptr, perm_ptr, scales_ptr, zeros_ptr,
                              offs_m, m_mask, offs_n, n_mask, b_mask, num_groups, stride_xm, BITS, GROUP_SIZE,
                              HAS_ZEROS, HAS_PERM, UNIFORM_GROUPS, USE_DOT, BLOCK_B, EVEN_B, DOT_PRECISION)
        acc = _accumulate_run(acc, packed >> 4, high, x_ptr, perm_ptr, scales_ptr, zeros_ptr,
                              offs_m, m_mask, offs_n, n_mask, b_mask, num_groups, stride_xm, BITS, GROUP_SIZE,
                              HAS_ZEROS, HAS_PERM, UNIFORM_GROUPS, USE_DOT, BLOCK_B, EVEN_B, DOT_PRECISION)
    else:
        acc = _accumulate_run(acc, packed, b0, x_ptr, perm_ptr, scales_ptr, zeros_ptr,
                              offs_m, m_mask, offs_n, n_mask, b_mask, num_groups, stride_xm, BITS, GROUP_SIZE,
                              HAS_ZEROS, HAS_PERM, UNIFORM_GROUPS, USE_DOT, BLOCK_B, EVEN_B, DOT_PRECISION)
    return acc


@triton.jit
def _lane_offsets(BLOCK_B: tl.constexpr):
    """Offsets 0 .. BLOCK_B of a step's bytes as [BLOCK_B // GEMV_LANE, GEMV_LANE] (lanes of consecutive bytes)."""
    return tl.arange(0, BLOCK_B // GEMV_LANE)[:, None] * GEMV_LANE + tl.arange(0, GEMV_LANE)[None, :]


@triton.jit
def _lane_mask(b0, b_end, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr):
    """_byte_mask in the lane shape: [1, 1] with EVEN_B, else [BLOCK_B // GEMV_LANE, GEMV_LANE]."""
    if EVEN_B:
        offs = b0 + tl.zeros((1, 1), dtype=tl.int32)
    else:
        offs = b0 + _lane_offsets(BLOCK_B)
    return offs < b_end


@triton.jit
def _load_packed_lanes(qweight_ptr, offs_n, n_mask, b0, b_mask, stride_qn, BLOCK_B: tl.constexpr):
    """Bytes b0 .. b0 + BLOCK_B of each row as int32 [BLOCK_N, BLOCK_B // GEMV_LANE, GEMV_LANE]: a thread
    loads whole lanes (b0 is a multiple of BLOCK_B)."""
    offs_b = tl.max_contiguous(tl.multiple_of(b0 + _lane_offsets(BLOCK_B), [1, GEMV_LANE]), [1, GEMV_LANE])
    packed = tl.load(qweight_ptr + offs_n[:, None, None] * stride_qn + offs_b[None, :, :],
                     mask=n_mask[:, None, None] & b_mask[None, :, :], other=0)
    return packed.to(tl.int32)


@triton.jit
def _one_row_run(
    acc, q, start, x_ptr, perm_ptr, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask, num_groups,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    UNIFORM_GROUPS: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr, X_DIRECT: tl.constexpr,
):
    """Adds x[0, run] * W[offs_n, run], summed per lane, for one run of BLOCK_B columns (q: [BLOCK_N, lanes,
    GEMV_LANE]) to acc [BLOCK_N, lanes]. X_DIRECT: see QuantLaunchConfig.x_direct.

    The products keep the packed load's layout (no exchange of weights between threads), and each lane's
    products are summed in the thread that loaded them: with UNIFORM_GROUPS the exact q - zero is summed
    and the run's scale multiplies the lane's sum, once per GEMV_LANE weights instead of once per weight.
    """
    w, scale = _run_weights(q, start, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask, num_groups,
                            BITS, GROUP_SIZE, HAS_ZEROS, UNIFORM_GROUPS, BLOCK_B, LANES=True)
    columns = start + _lane_offsets(BLOCK_B)
    if EVEN_B:
        columns = tl.max_contiguous(tl.multiple_of(columns, [1, GEMV_LANE]), [1, GEMV_LANE])
    if HAS_PERM:
        columns = tl.load(perm_ptr + columns, mask=b_mask, other=0)
    if X_DIRECT:
        # x loaded in the weights' own shape: each thread reads (from L1) the x its weights meet, with no
        # shared memory or barrier, and converts it to fp32 itself. The addresses do not depend on the row
        # (x is the same for all), so a thread holding several rows of a lane loads and converts it once.
        same_for_every_row = tl.zeros_like(offs_n)[:, None, None]
        x = tl.load(x_ptr + columns[None, :, :] + same_for_every_row, mask=b_mask[None, :, :], other=0)
        lane_sums = tl.sum(w * x.to(tl.float32), axis=2)
    else:
        # x's run as [lanes, GEMV_LANE], broadcast over the rows: Triton loads it once per program and hands
        # it to the threads through shared memory, a few instructions per step.
        x = tl.load(x_ptr + columns, mask=b_mask, other=0).to(tl.float32)
        lane_sums = tl.sum(w * x[None, :, :], axis=2)
    if UNIFORM_GROUPS:
        lane_sums = lane_sums * scale[:, None]
    return acc + lane_sums


@triton.jit
def _one_row_step(
    acc, packed, b0, b_mask, K, x_ptr, perm_ptr, scales_ptr, zeros_ptr, offs_n, n_mask, num_groups,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    UNIFORM_GROUPS: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr, X_DIRECT: tl.constexpr,
):
    """_accumulate_step of the gemv kernel at M = 1, on lane-shaped tiles (packed: [BLOCK_N, lanes, GEMV_LANE])."""
    if BITS == 4:
        low, high = _int4_run_starts(b0, K)
        acc = _one_row_run(acc, packed & 15, low, x_ptr, perm_ptr, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask,
                           num_groups, BITS, GROUP_SIZE, HAS_ZEROS, HAS_PERM, UNIFORM_GROUPS, BLOCK_B, EVEN_B,
                           X_DIRECT)
        acc = _one_row_run(acc, packed >> 4, high, x_ptr, perm_ptr, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask,
                           num_groups, BITS, GROUP_SIZE, HAS_ZEROS, HAS_PERM, UNIFORM_GROUPS, BLOCK_B, EVEN_B,
                           X_DIRECT)
    else:
        acc = _one_row_run(acc, packed, b0, x_ptr, perm_ptr, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask,
                           num_groups, BITS, GROUP_SIZE, HAS_ZEROS, HAS_PERM, UNIFORM_GROUPS, BLOCK_B, EVEN_B,
                           X_DIRECT)
    return acc


@triton.jit
def quant_linear_small_m_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, perm_ptr, out_ptr,
    M, N, K, row_bytes, num_groups, bytes_per_split, stride_xm, stride_qn,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    UNIFORM_GROUPS: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr,
    DOT_PRECISION: tl.constexpr, X_DIRECT: tl.constexpr,
):
    """Program (n, s): outputs n*BLOCK_N.. of all M rows over the packed bytes of split s, into out[s]
    ([splits, M, N]); each step takes BLOCK_B bytes of BLOCK_N rows (row_bytes = K * BITS / 8, passed in
    so that Triton sees its divisibility). EVEN_B: BLOCK_B divides row_bytes. X_DIRECT: one-row gemv only."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_start = pid_k * bytes_per_split
    b_end = tl.minimum(b_start + bytes_per_split, row_bytes)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b0 in range(b_start, b_end, BLOCK_B):  # Triton pipelines these loads (num_stages): they feed tl.dot
            offs_b = b0 + tl.arange(0, BLOCK_B)
            b_mask = _byte_mask(b0, b_end, BLOCK_B, EVEN_B)
            packed = _load_packed(qweight_ptr, offs_n, n_mask, offs_b, b_mask, stride_qn, BLOCK_B)
            acc = _accumulate_step(acc, packed, b0, b_mask, K, x_ptr, perm_ptr, scales_ptr, zeros_ptr,
                                   offs_m, m_mask, offs_n, n_mask, num_groups, stride_xm, BITS, GROUP_SIZE,
                                   HAS_ZEROS, HAS_PERM, UNIFORM_GROUPS, USE_DOT, BLOCK_B, EVEN_B, DOT_PRECISION)
    elif BLOCK_M == 1:
        # As below, but on lane-shaped tiles: see _one_row_run.
        lane_acc = tl.zeros((BLOCK_N, BLOCK_B // GEMV_LANE), dtype=tl.float32)
        b_mask = _lane_mask(b_start, b_end, BLOCK_B, EVEN_B)
        packed = _load_packed_lanes(qweight_ptr, offs_n, n_mask, b_start, b_mask, stride_qn, BLOCK_B)
        for b0 in range(b_start, b_end, BLOCK_B):
            next_b_mask = _lane_mask(b0 + BLOCK_B, b_end, BLOCK_B, EVEN_B)
            next_packed = _load_packed_lanes(qweight_ptr, offs_n, n_mask, b0 + BLOCK_B, next_b_mask, stride_qn,
                                             BLOCK_B)
            lane_acc = _one_row_step(lane_acc, packed, b0, b_mask, K, x_ptr, perm_ptr, scales_ptr, zeros_ptr,
                                     offs_n, n_mask, num_groups, BITS, GROUP_SIZE, HAS_ZEROS, HAS_PERM,
                                     UNIFORM_GROUPS, BLOCK_B, EVEN_B, X_DIRECT)
            b_mask, packed = next_b_mask, next_packed
        acc = tl.sum(lane_acc, axis=1)[None, :]
    else:
        # Loads that feed no tl.dot are not pipelined: each step loads the next step's bytes before it
        # works on its own, so two steps are in flight per program (a few registers: the packed bytes).
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_B), dtype=tl.float32)
        offs_b = b_start + tl.arange(0, BLOCK_B)
        b_mask = _byte_mask(b_start, b_end, BLOCK_B, EVEN_B)
        packed = _load_packed(qweight_ptr, offs_n, n_mask, offs_b, b_mask, stride_qn, BLOCK_B)
        for b0 in range(b_start, b_end, BLOCK_B):
            next_offs_b = offs_b + BLOCK_B
            next_b_mask = _byte_mask(b0 + BLOCK_B, b_end, BLOCK_B, EVEN_B)
            next_packed = _load_packed(qweight_ptr, offs_n, n_mask, next_offs_b, next_b_mask, stride_qn, BLOCK_B)
            acc = _accumulate_step(acc, packed, b0, b_mask, K, x_ptr, perm_ptr, scales_ptr, zeros_ptr,
                                   offs_m, m_mask, offs_n, n_mask, num_groups, stride_xm, BITS, GROUP_SIZE,
                                   HAS_ZEROS, HAS_PERM, UNIFORM_GROUPS, USE_DOT, BLOCK_B, EVEN_B, DOT_PRECISION)
            offs_b, b_mask, packed = next_offs_b, next_b_mask, next_packed
        acc = tl.sum(acc, axis=2)
    out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ------------------------------------------------------------------------------------------------ wide M


@triton.jit
def _store_run(out_ptr, q, start, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask, num_groups, K,
               BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr,
               UNIFORM_GROUPS: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr):
    w, scale = _run_weights(q, start, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask, num_groups,
                            BITS, GROUP_SIZE, HAS_ZEROS, UNIFORM_GROUPS, BLOCK_B, LANES=False)
    columns = _run_columns(start, BLOCK_B, EVEN_B)
    out = out_ptr + offs_n[:, None] * K + columns[None, :]
    tl.store(out, (w * scale[:, None]).to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & b_mask[None, :])


@triton.jit
def dequantize_kernel(
    qweight_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, num_groups, stride_qn,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, UNIFORM_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_B: tl.constexpr,
):
    """Program (n, b): writes W[n*BLOCK_N.., columns of packed bytes b*BLOCK_B..] into out [N, K].
    EVEN_B: BLOCK_B divides the row's bytes."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b0 = tl.program_id(1) * BLOCK_B
    offs_b = b0 + tl.arange(0, BLOCK_B)
    b_mask = _byte_mask(b0, K * BITS // 8, BLOCK_B, EVEN_B)
    packed = _load_packed(qweight_ptr, offs_n, n_mask, offs_b, b_mask, stride_qn, BLOCK_B)
    if BITS == 4:
        low, high = _int4_run_starts(b0, K)
        _store_run(out_ptr, packed & 15, low, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask, num_groups, K,
                   BITS, GROUP_SIZE, HAS_ZEROS, UNIFORM_GROUPS, BLOCK_B, EVEN_B)
        _store_run(out_ptr, packed >> 4, high, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask, num_groups, K,
                   BITS, GROUP_SIZE, HAS_ZEROS, UNIFORM_GROUPS, BLOCK_B, EVEN_B)
    else:
        _store_run(out_ptr, packed, b0, scales_ptr, zeros_ptr, offs_n, n_mask, b_mask, num_groups, K,
                   BITS, GROUP_SIZE, HAS_ZEROS, UNIFORM_GROUPS, BLOCK_B, EVEN_B)


# ------------------------------------------------------------------------------------------------ launching


# Programs per SM the split aims for: a program keeps BLOCK_N x BLOCK_B bytes in flight per step, and the
# memory system needs tens of KB in flight per SM to reach its bandwidth.
PROGRAMS_PER_SM = {False: 8, True: 4}

# Tiles that compile for sm_90 without spilling registers (checked with Triton's ptxas at 4 and 8 bits):
# gemv holds BLOCK_M x BLOCK_N x BLOCK_B fp32 products per program, so its N shrinks as M grows; the dot
# kernel holds two dequantized [BLOCK_N, BLOCK_B] runs (int4) next to its accumulator.
GEMV_PRODUCTS_MAX = 32 * 128  # BLOCK_M x BLOCK_N x BLOCK_B per 128 threads
DOT_TILES = (  # block_n, block_bytes, num_warps; the first is the default
    (64, 64, 4), (32, 128, 4), (64, 128, 4), (128, 128, 8), (128, 64, 8),
)


def small_m_candidates(num_rows: int, n: int, k: int, bits: int, num_sms: int) -> list[QuantLaunchConfig]:
    """The launch configs worth timing for M = num_rows <= SMALL_M_MAX; the first is the default.

    scripts/device/quant_kernels.py --configs times every one of them; a tuned export times tuning_candidates,
    a few of them (export/linear_tuning.py). Reorder to change the default of untuned exports.
    """
    tiles = []
    if num_rows <= GEMV_M_MAX:
        block_m = triton.next_power_of_2(num_rows)
        for block_bytes in (128, 256) if bits == 8 else (128,):
            for block_n in (16, 8, 32, 64) if block_m == 1 else (8, 16, 32):
                for num_warps in (4, 8):
                    if block_m * block_n * block_bytes > GEMV_PRODUCTS_MAX * num_warps // 4:
                        continue
                    tile = QuantLaunchConfig(False, block_m, block_n, block_bytes, num_warps, num_stages=1)
                    direct = block_m == 1 and num_warps == 4  # the tiles tuning_candidates takes
                    tiles += [tile, replace(tile, x_direct=True)] if direct else [tile]
    block_m = max(16, triton.next_power_of_2(num_rows))
    for block_n, block_bytes, num_warps in DOT_TILES:
        for num_stages in (4, 3):
            tiles.append(QuantLaunchConfig(True, block_m, block_n, block_bytes, num_warps, num_stages))
    return [with_split(tile, num_rows, n, k, bits, num_sms) for tile in tiles]


# Configs an export times per quantized weight and width. Each is a Triton compile of its own (about a second),
# and an export times every weight at every static width: with all of small_m_candidates (20-26 each) a toy
# model's tuning took over 10 minutes on a loaded H200 machine.
TUNED_CONFIGS = 4


def tuning_candidates(num_rows: int, n: int, k: int, bits: int, num_sms: int) -> list[QuantLaunchConfig]:
    """A short, varied subset of small_m_candidates for export-time tuning, the default first: the default
    and the widest gemv tile (where M allows: wider tiles take fewer instructions per weight,
    scripts/quant_kernel_ptx.py --candidates 1), then tl.dot tiles at four pipeline stages; at M = 1 also
    both gemv tiles with x loaded directly (QuantLaunchConfig.x_direct), beside the others."""
    configs = small_m_candidates(num_rows, n, k, bits, num_sms)
    gemv = [c for c in configs if not c.use_dot and c.num_warps == 4 and not c.x_direct]
    if gemv:
        widest = max(gemv, key=lambda c: c.block_n)
        gemv = [gemv[0]] + ([widest] if widest != gemv[0] else [])
    dot = [c for c in configs if c.use_dot and c.num_stages == 4]
    direct = [replace(c, x_direct=True) for c in gemv if c.block_m == 1]
    return (gemv + dot)[:TUNED_CONFIGS] + direct


def small_m_config(num_rows: int, n: int, k: int, bits: int, num_sms: int) -> QuantLaunchConfig:
    return small_m_candidates(num_rows, n, k, bits, num_sms)[0]


def with_split(tile: QuantLaunchConfig, num_rows: int, n: int, k: int, bits: int, num_sms: int) -> QuantLaunchConfig:
    """Split K until the GPU holds PROGRAMS_PER_SM programs per SM.

    A split's partial sums (M x N fp32, written and read once) must stay small next to the packed
    weights it saves reading in parallel (at most half their bytes), so wider M splits less.
    """
    row_bytes = k * bits // 8
    programs_n = triton.cdiv(n, tile.block_n)
    wanted = triton.cdiv(PROGRAMS_PER_SM[tile.use_dot] * num_sms, programs_n)
    affordable = max(1, (k * bits) // (64 * num_rows))  # split * M * N * 4 bytes <= N * K * bits / 16
    split = max(1, min(wanted, affordable, triton.cdiv(row_bytes, tile.block_bytes)))
    return replace(tile, split_k=triton.cdiv(row_bytes, _bytes_per_split(row_bytes, split, tile.block_bytes)))


def _bytes_per_split(row_bytes: int, split: int, block_bytes: int) -> int:
    # Whole steps per split: a step never crosses a split, nor (int4) a 128-byte block.
    return triton.cdiv(triton.cdiv(row_bytes, split), block_bytes) * block_bytes


def _whole_steps(row_bytes: int, block_bytes: int) -> bool:
    """Whether every step of every split holds block_bytes bytes of the row (EVEN_B): splits are whole
    steps (_bytes_per_split), so only the row's end can cut one."""
    return row_bytes % block_bytes == 0


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _uniform_groups(bits: int, k: int, group_size: int, block_bytes: int) -> bool:
    """Whether every nibble (int4) or byte (int8) run of block_bytes columns lies inside one group."""
    if group_size >= k:
        return True
    # Runs start at multiples of block_bytes columns; an int4 short last block starts its high run at L / 2.
    tail_half = (k % INT4_BLOCK_COLUMNS) // 2 if bits == 4 else 0
    return group_size % block_bytes == 0 and tail_half % block_bytes == 0


def _format_args(qweight, scales, zeros, bits, group_size) -> tuple[list, dict]:
    """The weight's tensor arguments (scales stand in for absent zeros: never read) and constexprs."""
    tensors = [qweight, scales, zeros if zeros is not None else scales]
    constants = {"BITS": bits, "GROUP_SIZE": group_size, "HAS_ZEROS": zeros is not None}
    return tensors, constants


def launch_small_m(
    x, qweight, scales, zeros, perm, bits: int, group_size: int, config: QuantLaunchConfig
) -> torch.Tensor:
    """The small-M kernel: x [M, K] @ W.T -> [M, N] in x's dtype."""
    num_rows, k = x.shape
    n = qweight.shape[0]
    if bits == 4 and INT4_HALF_BLOCK_BYTES % config.block_bytes:
        raise ValueError(f"int4 steps must divide the format's {INT4_HALF_BLOCK_BYTES}-byte block: {config.name}")
    if not config.use_dot and config.block_m == 1 and config.block_bytes % GEMV_LANE.value:
        raise ValueError(f"one-row gemv steps must be whole lanes of {GEMV_LANE.value} bytes: {config.name}")
    if config.x_direct and (config.use_dot or config.block_m != 1):
        raise ValueError(f"x_direct is a one-row gemv config: {config.name}")
    row_bytes = k * bits // 8
    bytes_per_split = _bytes_per_split(row_bytes, config.split_k, config.block_bytes)
    num_splits = triton.cdiv(row_bytes, bytes_per_split)
    if num_splits == 1:
        target = x.new_empty((num_rows, n))
    else:
        target = x.new_empty((num_splits, num_rows, n), dtype=torch.float32)
    tensors, constants = _format_args(qweight, scales, zeros, bits, group_size)
    wrap_triton(quant_linear_small_m_kernel)[(triton.cdiv(n, config.block_n), num_splits)](
        x, *tensors, perm if perm is not None else qweight, target,  # qweight stands in for an absent perm
        num_rows, n, k, row_bytes, scales.shape[1], bytes_per_split, x.stride(0), qweight.stride(0),
        HAS_PERM=perm is not None, UNIFORM_GROUPS=_uniform_groups(bits, k, group_size, config.block_bytes),
        USE_DOT=config.use_dot, EVEN_B=_whole_steps(row_bytes, config.block_bytes), X_DIRECT=config.x_direct,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_B=config.block_bytes,
        # fp32 activations (fp32 exports) stay fp32 in tl.dot instead of rounding through tf32.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **constants,
    )
    if num_splits == 1:
        return target
    return target.sum(0).to(x.dtype)


DEQUANTIZE_BLOCK_N = 32
DEQUANTIZE_BLOCK_BYTES = 64


def dequantize_weight(qweight, scales, zeros, bits: int, group_size: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in dtype, columns in stored order: one pass over the packed bytes."""
    n = qweight.shape[0]
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    tensors, constants = _format_args(qweight, scales, zeros, bits, group_size)
    grid = (triton.cdiv(n, DEQUANTIZE_BLOCK_N), triton.cdiv(qweight.shape[1], DEQUANTIZE_BLOCK_BYTES))
    wrap_triton(dequantize_kernel)[grid](
        *tensors, out, n, k, scales.shape[1], qweight.stride(0),
        UNIFORM_GROUPS=_uniform_groups(bits, k, group_size, DEQUANTIZE_BLOCK_BYTES),
        BLOCK_N=DEQUANTIZE_BLOCK_N, BLOCK_B=DEQUANTIZE_BLOCK_BYTES,
        EVEN_B=_whole_steps(qweight.shape[1], DEQUANTIZE_BLOCK_BYTES), num_warps=4, **constants,
    )
    return out


def dequantize_and_multiply(x, qweight, scales, zeros, perm, bits: int, group_size: int) -> torch.Tensor:
    """The wide-M path: x [M, K] @ dequantize(W).T through cuBLAS."""
    weight = dequantize_weight(qweight, scales, zeros, bits, group_size, x.shape[1], x.dtype)
    if perm is not None:
        x = x.index_select(1, perm)
    return torch.mm(x, weight.t())


@triton_op("pt2serve::quant_linear_small_m", mutates_args=())
def quant_linear_small_m_op(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    perm: torch.Tensor | None, bits: int, group_size: int,
    use_dot: bool, block_m: int, block_n: int, block_bytes: int, num_warps: int, num_stages: int, split_k: int,
    x_direct: bool,
) -> torch.Tensor:
    """The small-M kernel with the launch config the export chose (kernels/linear_choice.py), as arguments:
    part of the traced call, so compiling the method reads no tuning state."""
    config = QuantLaunchConfig(use_dot, block_m, block_n, block_bytes, num_warps, num_stages, split_k, x_direct)
    return launch_small_m(x.contiguous(), qweight, scales, zeros, perm, bits, group_size, config)


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
    """x [M, K] @ W.T -> [M, N] in x's dtype; at static widths <= SMALL_M_MAX, the default small-M config."""
    x = x.contiguous()
    num_rows, k = x.shape
    if is_concrete_int(num_rows) and num_rows <= SMALL_M_MAX:
        config = small_m_config(num_rows, qweight.shape[0], k, bits, sm_count(x.device))
        return launch_small_m(x, qweight, scales, zeros, perm, bits, group_size, config)
    return dequantize_and_multiply(x, qweight, scales, zeros, perm, bits, group_size)
