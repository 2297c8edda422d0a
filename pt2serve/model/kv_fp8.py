"""FP8 KV cells (`export --kv-dtype fp8`): e4m3 K and V with one fp32 scale per layer and KV head.

A cell stores K / k_scale and V / v_scale in float8 e4m3 (clamped to its finite range, +-448): half the
bytes of a bf16 cell, so the pool holds twice the tokens and long-context attention reads half as much.

Why one static scale per (layer, KV head), chosen at export:
- e4m3 keeps about 2 significant digits anywhere in 2^-6 .. 448 (with subnormals down to 2^-9): a scale
  only has to keep a head's largest values below 448 and its typical ones above 2^-6. Keys and values have a
  stable range per head across tokens (rotary embedding rotates a key without changing its size), and some
  heads run far larger than others (Qwen2's biased keys reach the hundreds), so one scale per head fits where
  one per tensor would not, and one per token would cost a scale pool beside every cell pool and an
  input of every method.
- The scales are constants of the model (buffers `k_scale`, `v_scale` [KVH] of each attention layer,
  stored once in the artifact like any weight), so the method contract and the runtime stay as they are.
- Calibration: one forward over CALIBRATION_TOKENS prompt tokens writes its K/V into a float pool; each
  head's scale is HEADROOM times its largest |value| over 448, so a token twice as large as any seen still
  fits. Larger values saturate at +-448 instead of overflowing to NaN.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pt2serve.contract import SCRATCH_CELL
from pt2serve.kernels.fp8_linear import E4M3_MAX, MIN_SCALE

KV_FP8_DTYPE = torch.float8_e4m3fn
CALIBRATION_TOKENS = 512
HEADROOM = 2.0


def install_kv_scales(model: nn.Module, scales: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each attention layer its (k_scale, v_scale) [KVH] fp32 buffers: its cells are e4m3 from now on."""
    device = model.norm.weight.device
    for layer, (k_scale, v_scale) in zip(model.layers, scales, strict=True):
        layer.self_attn.register_buffer("k_scale", k_scale.to(device=device, dtype=torch.float32))
        layer.self_attn.register_buffer("v_scale", v_scale.to(device=device, dtype=torch.float32))


def kv_scales_in(weights: dict[str, torch.Tensor], num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each layer's (k_scale, v_scale) among an artifact's weights; None for cells in the model's dtype."""
    if "layers.0.self_attn.k_scale" not in weights:
        return None
    return [(weights[f"layers.{i}.self_attn.k_scale"], weights[f"layers.{i}.self_attn.v_scale"])
            for i in range(num_layers)]


def has_kv_scales(model: nn.Module) -> bool:
    return getattr(model.layers[0].self_attn, "k_scale", None) is not None


def kv_pool_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the cells the model's methods read and write."""
    return KV_FP8_DTYPE if has_kv_scales(model) else model.norm.weight.dtype


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[T, KVH, D] K or V in the model's dtype -> e4m3 cells, each head divided by its scale [KVH]."""
    return (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8_DTYPE)


@torch.no_grad()
def calibrate_kv_scales(model: nn.Module, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (k_scale, v_scale) [KVH] from one prefill of random prompt tokens into a float pool."""
    if has_kv_scales(model):
        raise ValueError("the model already has KV scales: calibrate the float-cell model")
    cfg = model.config
    device, dtype = model.norm.weight.device, model.norm.weight.dtype
    num_tokens = min(CALIBRATION_TOKENS, cfg.max_position_embeddings)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=generator).to(device)
    positions = torch.arange(num_tokens, device=device)
    cells = positions + 1  # cell 0 is the scratch cell
    zero = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    seq_indptr = torch.tensor([0, num_tokens], device=device)
    logit_rows = torch.tensor([num_tokens - 1], device=device)
    pool_shape = (num_tokens + 1, cfg.num_kv_heads, cfg.head_dim)
    k_pools = [torch.zeros(pool_shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
    v_pools = [torch.zeros(pool_shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
    model(tokens, positions, cells, zero, seq_indptr, cells, logit_rows, k_pools, v_pools)
    return [(_head_scales(k[SCRATCH_CELL + 1:]), _head_scales(v[SCRATCH_CELL + 1:]))
            for k, v in zip(k_pools, v_pools)]


def _head_scales(cells: torch.Tensor) -> torch.Tensor:
    """[cells, KVH, D] -> [KVH] fp32 on the CPU."""
    amax = cells.float().abs().amax(dim=(0, 2))
    return (amax * HEADROOM / E4M3_MAX).clamp(min=MIN_SCALE).cpu()
