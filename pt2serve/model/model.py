"""A decoder-only transformer written plainly for torch.export (Llama, Mistral, Qwen2, Qwen3).

Module names follow Hugging Face's (minus the leading "model."), except that projections reading the same
input are stacked into one weight (q/k/v into qkv_proj, gate/up into gate_up_proj): one wide matmul instead
of several narrow ones, which matters most in small decode steps, where each matmul is a pass over its
weights with a fixed launch and tail cost. `stacked_projections` says which checkpoint tensors each holds.
The KV cache is not part of the model: every forward receives the pool tensors and writes the step's K/V
into the cells it is told, in place (see attention.py for how a step is described).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pt2serve.kernels import batch_invariant, rope_store  # noqa: F401  (rope_store registers rope_and_store)
from pt2serve.kernels.linear_choice import linear, swiglu_linear
from pt2serve.model.attention import AttentionImpl, StepAttention
from pt2serve.model.config import ModelConfig, RopeScaling
from pt2serve.model.kv_fp8 import KV_FP8_DTYPE, quantize_kv


class Linear(nn.Linear):
    """nn.Linear whose matmul takes the kernel the export chose for its shape and the step's width."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a stacked gate/up projection, fused into its matmul where the export chose so."""
        return swiglu_linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.is_tracing():
            out = batch_invariant.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        # Normalise in fp32 and cast back before the scale, as the reference implementations do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim/2] inverse frequencies, stretched as `scaling` says (transformers' numbers for each type)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None:
        return inv_freq.float()
    if scaling.rope_type == "linear":
        # Positions divided by the factor: the same angles as the frequencies divided by it.
        return (inv_freq / scaling.factor).float()
    if scaling.rope_type == "dynamic":
        # transformers raises the base with each forward's longest position (seq_len = max(position) + 1, at
        # least max_position_embeddings), so a sequence's angles would depend on the batch it runs in and on
        # how far it has got, while an artifact's frequencies are one constant of every compiled step. As
        # vLLM's DynamicNTKScalingRotaryEmbedding does, the base is fixed at the longest context the scaling
        # is for, max_position_embeddings * factor: transformers' numbers for a sequence of that length.
        seq_len = scaling.original_max_position_embeddings * scaling.factor
        stretch = scaling.factor * seq_len / scaling.original_max_position_embeddings - (scaling.factor - 1)
        base = theta * stretch ** (head_dim / (head_dim - 2))
        return (1.0 / base**exponents).float()
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    return _llama3_inv_freq(inv_freq, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3: wavelengths longer than the pretraining context / low_freq_factor divided by the factor, those
    shorter than it / high_freq_factor kept, a smooth blend between."""
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn more than beta_fast times over the pretraining context kept, those that turn
    less than beta_slow times divided by the factor, a linear ramp over the dimensions between."""

    def dimension(rotations: float) -> float:  # the (fractional) dimension whose wavelength fits `rotations` times
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: a ramp of no width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return (inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)).float()


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, 1 for every other type."""
    return 1.0 if scaling is None else scaling.attention_factor


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] fp32 at each token's position (the frequencies twice, the halves rotate_half pairs)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    # Scaled here, where both rope paths (the kernel and _rope_and_store) read them: q and k each get the
    # factor, so the attention logits get its square, as in transformers.
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D] in fp32."""
    x32 = x.float()
    return (x32 * cos[:, None] + rotate_half(x32) * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # FP8 cells: e4m3 K / k_scale and V / v_scale per KV head [KVH] (model/kv_fp8.py installs them).
        self.register_buffer("k_scale", None)
        self.register_buffer("v_scale", None)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        write_cells: torch.Tensor,  # [T]
        attend: StepAttention,
        k_pool: torch.Tensor,  # [C, KVH, D], written in place
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if attend.impl is AttentionImpl.KERNEL:  # GPU artifacts: norms, rope and the K/V write in one kernel
            q = torch.ops.pt2serve.rope_and_store(
                qkv, cos, sin, write_cells, k_pool, v_pool,
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                self.q_norm.eps if self.q_norm is not None else 0.0, self.num_heads, self.num_kv_heads,
                self.k_scale, self.v_scale, attend.deterministic_context is not None,
            )
        else:
            q = self._rope_and_store(qkv, cos, sin, write_cells, k_pool, v_pool)
        out = attend(q, k_pool, v_pool, self.k_scale, self.v_scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _rope_and_store(self, qkv, cos, sin, write_cells, k_pool, v_pool) -> torch.Tensor:
        """The plain path (and the reference of kernels/rope_store.py): q [T, H, D], k and v into the cells."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.k_scale is not None:  # e4m3 cells (the CPU has index_put_ for float8, not index_copy_)
            k_pool.index_put_((write_cells,), quantize_kv(k, self.k_scale))
            v_pool.index_put_((write_cells,), quantize_kv(v, self.v_scale))
            return q
        k_pool.index_copy_(0, write_cells, k.to(k_pool.dtype))
        v_pool.index_copy_(0, write_cells, v.to(v_pool.dtype))
        return q


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self.gate_up_proj, "swiglu"):  # float and FP8 projections fuse the activation
            return self.down_proj(self.gate_up_proj.swiglu(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # int8 / int4: their own operator
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, write_cells, attend, k_pool, v_pool) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, write_cells, attend, k_pool, v_pool)
        return x + self.mlp(self.post_attention_layernorm(x))


def stacked_projections(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each stacked projection of a layer -> the checkpoint projections it holds, in row order, with their rows."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "self_attn.qkv_proj": (
            ("self_attn.q_proj", q_size), ("self_attn.k_proj", kv_size), ("self_attn.v_proj", kv_size)
        ),
        "mlp.gate_up_proj": (("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)),
    }


class Embedding(nn.Embedding):
    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """The tied LM head: logits of x against every token's embedding."""
        return linear(x, self.weight)


class Transformer(nn.Module):
    """The linear layers (and optionally the LM head and embedding) may be swapped for quantized ones of the
    same interface by model/quant.py."""

    def __init__(self, cfg: ModelConfig, attention: AttentionImpl = AttentionImpl.MASKED) -> None:
        super().__init__()
        self.config = cfg
        self.attention = attention
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )
        self.rope_attention_factor = rope_attention_factor(cfg.rope_scaling)
        # Layers whose outputs a draft model reads (model/dflash.py); when set, forward also returns them.
        self.tap_layers: tuple[int, ...] = ()
        # Set by a deterministic export (--deterministic) to the max context: attention then takes its
        # batch-invariant form (model/attention.py).
        self.deterministic_context: int | None = None

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        write_cells: torch.Tensor,  # [T] int64: the cell each token's K/V goes to
        token_seq: torch.Tensor,  # [T] int64: the sequence row each token belongs to
        seq_indptr: torch.Tensor,  # [R+1] int64
        seq_cells: torch.Tensor,  # [E] int64
        logit_rows: torch.Tensor,  # [S] int64: the tokens whose next-token logits are returned
        k_pools: list[torch.Tensor],  # per layer [C, KVH, D]
        v_pools: list[torch.Tensor],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [S, vocab] fp32 (, [T, taps * hidden])
        cfg = self.config
        attend = StepAttention(
            self.attention, cfg.num_heads, cfg.num_kv_heads, positions, token_seq, seq_indptr, seq_cells,
            self.deterministic_context, fp8_cells=k_pools[0].dtype == KV_FP8_DTYPE,
        )
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_attention_factor)
        x = self.embed_tokens(tokens)
        taps = {}
        for index, (layer, k_pool, v_pool) in enumerate(zip(self.layers, k_pools, v_pools)):
            x = layer(x, cos, sin, write_cells, attend, k_pool, v_pool)
            if index in self.tap_layers:
                # Hugging Face's hidden state of the last layer is the one after the final norm.
                taps[index] = self.norm(x) if index == cfg.num_layers - 1 else x
        x = self.norm(x.index_select(0, logit_rows))
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        if not self.tap_layers:
            return logits.float()
        return logits.float(), torch.cat([taps[i] for i in self.tap_layers], dim=-1)
