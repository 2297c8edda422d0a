"""Weight-only int8/int4 linear layers: the packed format, its plain PyTorch reference, and the dispatch.

One format serves every source (quantized at export, GPTQ, AWQ). For a linear layer with N outputs and
K inputs, in groups of `group_size` inputs (G = ceil(K / group_size) groups per row):

    qweight  uint8 [N, K]       8 bits: one unsigned value per byte
             uint8 [N, K / 2]   4 bits: byte j of a row holds column 2j in its low nibble, 2j+1 in its high one
    scales   [N, G]             in the activation dtype
    zeros    uint8 [N, G]       the integer zero point; None when symmetric (then the zero is 2**(bits-1))
    perm     int64 [K]          None, or the input feature each column holds (GPTQ act-order)

    W[n, perm[k]] = (q[n, k] - zero[n, k // group_size]) * scale[n, k // group_size]

Rows are independent (an embedding gathers them), the layout is nn.Linear's [out, in], and columns of a
group are adjacent, so a kernel reads each packed byte once and dequantizes it in registers. The zero is
a byte, not a nibble: GPTQ's zero offset can make it 2**bits (see model/quantized_checkpoint.py).

On CUDA the operator runs Triton kernels (quant_linear_triton.py, imported on first use: CPU-only torch
builds ship without Triton); everywhere else, and as the kernels' reference, it dequantizes and multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_BITS = (4, 8)


def values_per_byte(bits: int) -> int:
    return 8 // bits


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [N, K] (each < 2**bits) -> qweight [N, K * bits / 8] uint8."""
    q = q.to(torch.uint8)
    if bits == 8:
        return q.contiguous()
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """qweight [N, K * bits / 8] uint8 -> unsigned values [N, K] uint8."""
    if bits == 8:
        return qweight
    return torch.stack((qweight & 15, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)


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


def quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """x [T, K] @ W.T -> [T, N]: the Triton operator on CUDA tensors, the reference elsewhere.

    Chosen by device at trace time, so a CPU export holds plain aten ops and a CUDA export the kernels.
    """
    if x.is_cuda:
        from pt2serve.kernels import quant_linear_triton  # noqa: F401  (registers torch.ops.pt2serve.quant_linear)

        return torch.ops.pt2serve.quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
    return reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
