"""The fused rope + K/V write operator against the model's plain path, with and without per-head norms.

Without a GPU it runs under TRITON_INTERPRET=1 (conftest.py). Cells are written in random order into pools
that hold other data, which must stay as it was.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton")

from pt2serve.model.model import Attention, rope_inv_freq  # noqa: E402
from pt2serve.model.presets import CONFIGS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", autouse=True)
def interpreter_or_gpu():
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton was not put in interpreter mode (tests/conftest.py does that)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_operator_matches_the_plain_path(qk_norm, dtype):
    cfg = dataclasses.replace(CONFIGS["tiny-random"], qk_norm=qk_norm)
    gen = torch.Generator().manual_seed(int(qk_norm))
    attn = Attention(cfg).to(DEVICE, dtype)
    if qk_norm:  # weights away from 1, so a norm applied wrongly shows
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.data = (torch.rand(cfg.head_dim, generator=gen) + 0.5).to(DEVICE, dtype)
    num_tokens, num_cells = 11, 40
    qkv = torch.randn(num_tokens, attn.q_size + 2 * attn.kv_size, generator=gen).to(DEVICE, dtype) * 3
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    freqs = positions[:, None].float() * rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    write_cells = torch.randperm(num_cells, generator=gen)[:num_tokens].to(DEVICE)
    pools = [torch.randn(num_cells, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    want_q = attn._rope_and_store(qkv, cos, sin, write_cells, *want_pools)
    got_q = torch.ops.pt2serve.rope_and_store(
        qkv, cos, sin, write_cells, *pools, attn.q_norm.weight if qk_norm else None,
        attn.k_norm.weight if qk_norm else None, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads,
    )
    # The plain path's roundings: fp32 agrees to a few ulps (multiply-adds contracted differently); bf16 to
    # one rounding step of values up to about 8 (the norm's rsqrt may round the other way).
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.0625, "rtol": 0.016}
    torch.testing.assert_close(got_q, want_q, **tolerance)
    for got, want in zip(pools, want_pools):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cells_are_the_plain_paths_scaled_e4m3(dtype):
    """With per-head scales the operator writes what the plain path writes: K / k_scale and V / v_scale in e4m3,
    clamped to its range (one head's scale is small enough that its values saturate)."""
    from pt2serve.model.kv_fp8 import KV_FP8_DTYPE, install_kv_scales

    cfg = CONFIGS["tiny-random"]
    gen = torch.Generator().manual_seed(7)
    attn = Attention(cfg).to(DEVICE, dtype)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.layers[0].self_attn = attn
    holder.norm = torch.nn.Module()
    holder.norm.weight = torch.zeros(1, device=DEVICE)
    k_scale = torch.tensor([0.02, 0.001] * (cfg.num_kv_heads // 2))  # the second saturates values past 0.448
    install_kv_scales(holder, [(k_scale, torch.full((cfg.num_kv_heads,), 0.01))])
    num_tokens, num_cells = 9, 30
    qkv = torch.randn(num_tokens, attn.q_size + 2 * attn.kv_size, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    freqs = positions[:, None].float() * rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1).to(DEVICE)
    write_cells = torch.randperm(num_cells, generator=gen)[:num_tokens].to(DEVICE)
    pools = [torch.randn(num_cells, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(DEVICE, KV_FP8_DTYPE)
             for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    want_q = attn._rope_and_store(qkv, angles.cos(), angles.sin(), write_cells, *want_pools)
    got_q = torch.ops.pt2serve.rope_and_store(
        qkv, angles.cos(), angles.sin(), write_cells, *pools, None, None, cfg.rms_norm_eps, cfg.num_heads,
        cfg.num_kv_heads, attn.k_scale, attn.v_scale,
    )
    torch.testing.assert_close(got_q, want_q, atol=1e-5 if dtype == torch.float32 else 0.0625, rtol=0.016)
    saturated = want_pools[0][write_cells][:, 1::2].float().abs().max()
    assert saturated == 448.0  # the small scale's head did saturate, and not to NaN
    for got, want in zip(pools, want_pools):
        got, want = got.float(), want.float()
        if DEVICE == "cpu":
            # Triton's interpreter rounds an fp32 just below a power of two p, which e4m3 rounds up to p, down
            # to p / 2 (its carry into the exponent is lost); GPUs convert in hardware. Only those may differ.
            is_power_of_2 = want.abs() == torch.exp2(torch.log2(want.abs()).round())
            got = torch.where(is_power_of_2 & (got == want / 2), want, got)
        # One e4m3 rounding step at most where the two fp32 computations land either side of a midpoint.
        torch.testing.assert_close(got, want, atol=0.0, rtol=0.13)


def test_blocks_of_tokens_cover_a_dynamic_width_with_a_partial_last_block():
    """forward_others' width is symbolic when traced: its launch takes 16 tokens per program."""
    from pt2serve.kernels import rope_store

    assert rope_store.tokens_per_program(64) == 1 and rope_store.tokens_per_program(torch.SymInt) == 16
    cfg = CONFIGS["tiny-random"]
    attn = Attention(cfg).to(DEVICE)
    num_tokens, num_cells = 37, 64
    qkv = torch.randn(num_tokens, attn.q_size + 2 * attn.kv_size).to(DEVICE)
    freqs = torch.rand(num_tokens, cfg.head_dim // 2) * 6
    angles = torch.cat((freqs, freqs), dim=-1).to(DEVICE)  # as the model builds them
    cos, sin = angles.cos(), angles.sin()
    write_cells = torch.randperm(num_cells)[:num_tokens].to(DEVICE)
    pools = [torch.randn(num_cells, cfg.num_kv_heads, cfg.head_dim).to(DEVICE) for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    want_q = attn._rope_and_store(qkv, cos, sin, write_cells, *want_pools)
    got_q = rope_store.launch_rope_and_store(qkv, cos, sin, write_cells, *pools, None, None, 0.0,
                                             cfg.num_heads, cfg.num_kv_heads, block_t=16)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    for got, want in zip(pools, want_pools):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
