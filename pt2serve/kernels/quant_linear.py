"""Weight-only int8/int4 linear layers: the Triton operator on CUDA, the plain reference elsewhere.

On CUDA the operator runs Triton kernels (quant_linear_triton.py, imported on first use: CPU-only torch
builds ship without Triton), with the small-M launch config the export chose where it chose one
(kernels/linear_choice.py); everywhere else, and as the kernels' reference, it dequantizes and multiplies.
The packed format and that reference are quant_format.py's, which the kernels import too: nothing they
need is here.
"""

from __future__ import annotations

import torch

from pt2serve.kernels.linear_choice import quant_choice
from pt2serve.kernels.linear_configs import QuantFormat
from pt2serve.kernels.quant_format import reference_quant_linear


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
        return triton_quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
    return reference_quant_linear(x, qweight, scales, zeros, perm, bits, group_size)


def triton_quant_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    perm: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """The Triton operator: the small-M kernel with the config chosen for this weight and width when the
    export chose one (it is traced into the call as arguments), else the operator's own default."""
    from pt2serve.kernels import quant_linear_triton  # noqa: F401  (registers the operators)

    fmt = QuantFormat(bits, group_size, zeros is not None, perm is not None)
    config = quant_choice(fmt, x, qweight.shape[0])
    if config is None:
        return torch.ops.pt2serve.quant_linear(x, qweight, scales, zeros, perm, bits, group_size)
    return torch.ops.pt2serve.quant_linear_small_m(
        x, qweight, scales, zeros, perm, bits, group_size, config.use_dot, config.block_m, config.block_n,
        config.block_bytes, config.num_warps, config.num_stages, config.split_k, config.x_direct,
    )
