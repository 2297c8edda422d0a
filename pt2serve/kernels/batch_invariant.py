"""Linear layers and norms of deterministic artifacts (`export --deterministic`): each row's sums are taken in
an order fixed by the layer's shape alone, so a row's result is the same bits whatever else shares its step,
whichever method runs it and however its prompt was cut.

A BLAS matmul is not: it picks a kernel by M (one row takes a GEMV path, wider steps a blocked GEMM) and a
micro-kernel's tail rows take another path again (on the CPU, with the tiny preset, a row's logits moved by up
to 6.7e-6 between forward_1 and forward_8, and the last row of 32 differed: scripts/batch_invariance.py). So:
- on the CPU a matmul is written as a product summed over K, which Inductor compiles into a reduction loop per
  output element: every element's sum runs over K in the same (vectorised) order at any M, static or dynamic
  (bit for bit at M = 1 .. 80 in tests/test_batch_invariant_kernels.py, and through whole exports in
  tests/test_deterministic.py); RMSNorm stays Inductor's row reduction, the same kind of loop over the hidden
  size;
- on CUDA both run Triton kernels with one launch config for every M (kernels/batch_invariant_triton.py):
  the same tile and K order for a row at every width, a split of K fixed by the weight's shape, and partial
  sums added in a fixed order.

Which formulation a method traces is chosen when it is traced (`tracing()`), as linear_choice.py's kernels are.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_tracing = False


@contextlib.contextmanager
def tracing(enabled: bool = True) -> Iterator[None]:
    """Trace the model's linear layers and norms in their batch-invariant formulation (when enabled)."""
    global _tracing
    previous, _tracing = _tracing, enabled
    try:
        yield
    finally:
        _tracing = previous


def is_tracing() -> bool:
    return _tracing


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of a 2-D x whose rows do not depend on each other's presence."""
    if x.is_cuda:
        from pt2serve.kernels import batch_invariant_triton  # noqa: F401  (registers the operators)

        out = torch.ops.pt2serve.batch_invariant_linear(x, weight)
    else:
        # In fp32 whatever the dtype: Inductor keeps the product in registers, so nothing is rounded before the sum.
        out = (x.float()[:, None, :] * weight.float()[None, :, :]).sum(-1).to(x.dtype)
    return out if bias is None else out + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of each row of a 2-D x by its own Triton kernel on CUDA; None elsewhere (the model's plain
    formula is already one reduction per row there)."""
    if not x.is_cuda or x.dim() != 2:
        return None
    from pt2serve.kernels import batch_invariant_triton  # noqa: F401

    return torch.ops.pt2serve.batch_invariant_rms_norm(x, weight, eps)
