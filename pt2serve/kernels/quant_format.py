"""The packed format of weight-only int8/int4 linear layers, and its plain PyTorch reference.

One format serves every source (quantized at export, GPTQ, AWQ). For a linear layer with N outputs and
K inputs, in groups of `group_size` inputs (G = ceil(K / group_size) groups per row):

    qweight  uint8 [N, K]       8 bits: one unsigned value per byte, column k in byte k
             uint8 [N, K / 2]   4 bits: split halves, see below
    scales   [N, G]             in the activation dtype
    zeros    uint8 [N, G]       the integer zero point; None when symmetric (then the zero is 2**(bits-1))
    perm     int64 [K]          None, or the input feature each column holds (GPTQ act-order)

    W[n, perm[k]] = (q[n, k] - zero[n, k // group_size]) * scale[n, k // group_size]

4 bits, split halves: each row is cut into blocks of INT4_BLOCK_COLUMNS (256) columns, packed into 128
bytes; a short last block of L columns (K % 256, even) into L / 2 bytes. Byte j of a block holds column j
of the block in its low nibble and column j + L / 2 in its high one (L = 256 for full blocks):

    columns  | 0 1 2 ... 127 | 128 129 ... 255 |   one block of 256
    byte j   |  low nibble j |  high nibble j  |   bytes 0 .. 127

So any run of bytes inside a block unpacks into two runs of consecutive columns, one per nibble, and a
kernel multiplies each with a contiguous slice of x: no interleaving in registers. With groups of 128 (or any
multiple of the bytes a kernel takes per row), each nibble run also lies inside one group.

Rows are independent (an embedding gathers them), the layout is nn.Linear's [out, in], so a kernel reads
each packed byte once and dequantizes it in registers. The zero is a byte, not a nibble: GPTQ's zero
offset can make it 2**bits (see model/quantized_checkpoint.py).

The layer itself dispatches in quant_linear.py: the Triton kernels (quant_linear_triton.py) on CUDA, the
reference below everywhere else; the dispatch and the kernels both import the format from here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_BITS = (4, 8)
INT4_BLOCK_COLUMNS = 256  # columns of one split-halves block: 128 bytes, a cache line per row


def values_per_byte(bits: int) -> int:
    return 8 // bits


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [N, K] (each < 2**bits) -> qweight [N, K * bits / 8] uint8."""
    q = q.to(torch.uint8)
    if bits == 8:
        return q.contiguous()
    return torch.cat([low | (high << 4) for low, high in _int4_halves(q)], dim=1).contiguous()


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """qweight [N, K * bits / 8] uint8 -> unsigned values [N, K] uint8."""
    if bits == 8:
        return qweight
    num_rows, num_bytes = qweight.shape
    half_block = INT4_BLOCK_COLUMNS // 2
    full_bytes = num_bytes - num_bytes % half_block
    full = qweight[:, :full_bytes].reshape(num_rows, -1, 1, half_block)
    # [N, blocks, 2, 128]: the low nibbles are the block's first half of columns, the high ones its second.
    columns = [torch.cat((full & 15, full >> 4), dim=2).reshape(num_rows, -1)]
    tail = qweight[:, full_bytes:]
    columns.append(torch.cat((tail & 15, tail >> 4), dim=1))
    return torch.cat(columns, dim=1)


def _int4_halves(q: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each run of blocks of the same width: (its first halves, its second halves), [N, bytes] each."""
    num_rows, num_columns = q.shape
    full_columns = num_columns - num_columns % INT4_BLOCK_COLUMNS
    full = q[:, :full_columns].reshape(num_rows, -1, 2, INT4_BLOCK_COLUMNS // 2)
    tail = q[:, full_columns:]
    half = tail.shape[1] // 2
    return [
        (full[:, :, 0].reshape(num_rows, -1), full[:, :, 1].reshape(num_rows, -1)),
        (tail[:, :half], tail[:, half:]),
    ]


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """[N, K] weights in scales' dtype, columns in stored order (apply perm to the input, not here)."""
    q = unpack(qweight, bits).float()
    num_columns = q.shape[1]
    # Each column's group: repeat every group's scale over its columns (the last group may be short).
    scale = scales.float().repeat_interleave(group_size, dim=1)[:, :num_columns]
    if zeros is None:
        zero = 2 ** (bits - 1)
    else:
        zero = zeros.float().repeat_interleave(group_size, dim=1)[:, :num_columns]
    return ((q - zero) * scale).to(scales.dtype)


def reference_quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N]: dequantize, then one matmul (Inductor fuses the dequantization)."""
    if perm is not None:
        x = x.index_select(-1, perm)
    return F.linear(x, dequantize(qweight, scales, zeros, bits, group_size).to(x.dtype))
