"""FP8 linear layers: float8 e4m3 weights with a scale per output channel, activations quantized per token.

For a linear layer with N outputs and K inputs:

    weight        float8_e4m3fn [N, K]   nn.Linear's layout
    weight_scale  float32 [N]            W[n, k] = weight[n, k] * weight_scale[n]

Each step quantizes its activations on the fly, one scale per token (row of x), so no calibration is needed
and an outlier in one token costs no other token precision:

    x_scale[t] = max_k |x[t, k]| / 448          (448: the largest finite e4m3)
    x_q[t, k]  = e4m3(x[t, k] / x_scale[t])
    y[t, n]    = (sum_k x_q[t, k] * weight[n, k]) * x_scale[t] * weight_scale[n]

The product of two e4m3 values is exact in fp32 and the sums accumulate in fp32, so every kernel below
computes the same function up to the order of its fp32 additions. On CUDA with bf16 activations:
- narrow static steps (M <= 64) run the small-M Triton kernels of small_m_linear.py on the e4m3 operands
  (gemv converts both in registers; dot feeds them to FP8 tensor cores), with the config the export timed
  fastest for the shape and width (kernels/linear_choice.py), SwiGLU fused into the gate/up projection;
- everything else runs `torch._scaled_mm` with row-wise scales (cuBLASLt / CUTLASS FP8 GEMMs).
The activation quantization is plain PyTorch, which Inductor fuses into the kernel that produces x (the
RMSNorm, the SwiGLU). Elsewhere (the CPU, fp32 exports) the same function is computed by its reference:
the e4m3 values widened to fp32 and multiplied in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pt2serve.kernels.linear_choice import dense_choice
from pt2serve.kernels.linear_configs import FP8_LINEAR, FP8_SWIGLU, LaunchConfig

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
# The smallest scale a row gets: an all-zero row quantizes to zeros with it instead of dividing by zero.
MIN_SCALE = 1e-12
# torch._scaled_mm needs both of the weight's dimensions to be multiples of 16.
SCALED_MM_MULTIPLE = 16


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], fp32 scales [N]): each row scaled so its largest |value| is 448."""
    weight = weight.float()
    scale = weight.abs().amax(dim=-1).clamp(min=MIN_SCALE) / E4M3_MAX
    return (weight / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], fp32 scales [T, 1]), one scale per token."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_SCALE) / E4M3_MAX
    return (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), scale


def reference_scaled_matmul(
    x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(x_q @ weight.T) * x_scale * weight_scale in fp32, as out_dtype: the function every kernel computes."""
    return (F.linear(x_q.float(), weight.float()) * x_scale * weight_scale).to(out_dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ W.T -> [T, N] in x's dtype, x quantized per token."""
    x_q, x_scale = quantize_per_token(x)
    if not _runs_kernels(x, weight):
        return reference_scaled_matmul(x_q, x_scale, weight, weight_scale, x.dtype)
    config = dense_choice(FP8_LINEAR, x, weight)
    if config is not None:
        return _small_m(x_q, x_scale, weight, weight_scale, False, config)
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :], out_dtype=x.dtype)


def fp8_swiglu(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a stacked gate/up weight [2I, K] in e4m3: one fused kernel where the export chose it."""
    if _runs_kernels(x, weight):
        config = dense_choice(FP8_SWIGLU, x, weight)
        if config is not None:
            x_q, x_scale = quantize_per_token(x)
            return _small_m(x_q, x_scale, weight, weight_scale, True, config)
    gate, up = fp8_linear(x, weight, weight_scale).chunk(2, dim=-1)
    return F.silu(gate) * up


def has_kernel_shape(num_rows: int, num_columns: int) -> bool:
    """Whether the GPU kernels take a weight of this shape (the others run the reference on the GPU too)."""
    return num_rows % SCALED_MM_MULTIPLE == 0 and num_columns % SCALED_MM_MULTIPLE == 0


def _runs_kernels(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The FP8 kernels serve bf16 activations on a GPU (chosen at trace time: a CPU export holds aten ops)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and has_kernel_shape(*weight.shape)


def _small_m(x_q, x_scale, weight, weight_scale, swiglu: bool, config: LaunchConfig) -> torch.Tensor:
    from pt2serve.kernels import small_m_linear  # noqa: F401  (registers torch.ops.pt2serve.small_m_fp8_linear)

    return torch.ops.pt2serve.small_m_fp8_linear(
        x_q, x_scale, weight, weight_scale, swiglu, config.use_dot, config.block_m, config.block_n, config.block_k,
        config.num_warps, config.num_stages,
    )
