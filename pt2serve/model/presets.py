"""Built-in models whose weights are generated from a fixed seed, so the project runs with no download.

- tiny: a few small layers and a byte-level tokenizer, for CPU demos and tests.
- toy-greedy: weights built so that each token strongly predicts a fixed successor (see `toy_successor`),
  so greedy output is known in advance and exact token equality can be asserted anywhere.
- toy-greedy-8b: llama-3.1-8b's shape with toy-greedy's design (token ids only): the 8B's cost per step with
  output known in advance, for exact-token checks at that size and for drafters that need text that repeats.
- llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, qwen3-8b: the published shapes with random weights, for benchmarks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from pt2serve.errors import Pt2ServeError
from pt2serve.model.config import ModelConfig, RopeScaling
from pt2serve.model.attention import AttentionImpl
from pt2serve.model.model import Transformer, rope_inv_freq
from pt2serve.tokenizer import TokenizerFiles, byte_level_alphabet

SEED = 20261130
NUM_BYTES = 256
BOS_TEXT, EOS_TEXT = "<|bos|>", "<|eos|>"
BYTE_VOCAB_SIZE = NUM_BYTES + 2  # 256 bytes, then bos, eos
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

_LLAMA3_SCALING_1B = RopeScaling(32.0, 1.0, 4.0, 8192)
_LLAMA3_SCALING_8B = RopeScaling(8.0, 1.0, 4.0, 8192)

CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=160,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
    ),
    "toy-greedy": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB_SIZE, hidden_size=BYTE_VOCAB_SIZE + 62,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
        max_position_embeddings=512,
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_1B, tie_word_embeddings=True,
    ),
    "llama-3.1-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_8B,
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, qk_norm=True,
    ),
    "qwen3-8b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
    ),
}
CONFIGS["toy-greedy-8b"] = CONFIGS["llama-3.1-8b"]
PRESET_NAMES = tuple(CONFIGS)
# The designed presets, and the size of the one-hot signal their embedding writes into the residual stream:
# it must outweigh what every layer's small random branches add (see _fill_toy_greedy).
_DESIGNED_SIGNAL = {"toy-greedy": 1.0, "toy-greedy-8b": 64.0}
_WITH_BYTE_TOKENIZER = ("tiny", "toy-greedy")


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig
    tokenizer: TokenizerFiles | None


def get_preset(name: str) -> Preset:
    if name not in CONFIGS:
        raise Pt2ServeError(f"unknown preset {name!r}; available: {', '.join(PRESET_NAMES)}")
    tokenizer = byte_tokenizer_files() if name in _WITH_BYTE_TOKENIZER else None
    return Preset(name, CONFIGS[name], tokenizer)


def build_preset_model(
    name: str, dtype: torch.dtype, device: str | torch.device = "cpu", attention: AttentionImpl = AttentionImpl.MASKED
) -> Transformer:
    """The preset's model with its generated weights, on `device` in `dtype`."""
    preset = get_preset(name)
    with torch.device("meta"):
        model = Transformer(preset.config, attention)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(SEED)
    with torch.no_grad():
        if name in _DESIGNED_SIGNAL:
            _fill_toy_greedy(model, generator, _DESIGNED_SIGNAL[name])
        else:
            _fill_random(model, generator)
    model = model.to(dtype)
    # Rotary frequencies stay fp32 whatever the weights' dtype, as when loading a checkpoint.
    cfg = preset.config
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model


def _fill_random(model: Transformer, generator: torch.Generator) -> None:
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)


def toy_successor(token: int) -> int:
    """The token toy-greedy's weights make follow `token` (bos and eos map into bytes; eos never follows)."""
    return (token * 7 + 3) % NUM_BYTES


def toy_greedy_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    out, token = [], prompt[-1]
    for _ in range(num_tokens):
        token = toy_successor(token)
        out.append(token)
    return out


def _fill_toy_greedy(model: Transformer, generator: torch.Generator, signal: float) -> None:
    """Embeddings one-hot (times `signal`) in the first BYTE_VOCAB_SIZE dims; lm_head maps token t's direction
    to successor(t). Only those tokens are designed: the others embed to zero and are never the successor.

    Attention and MLP get small random weights, so the path through them is exercised, while the
    successor logit leads every other by a wide margin, so greedy output is the same in fp32, bf16 and any
    batch composition. Each layer's branches add about 0.14 per dim to the residual whatever its input (they
    read it normalised; o_proj and down_proj are scaled by 0.05), so after L layers about 0.14 sqrt(L): the
    signal must stay well above that (toy-greedy: 2 layers, signal 1, margin about 8 in logit units;
    toy-greedy-8b: 32 layers, noise about 0.8 a dim, signal 64, margin about 6).
    """
    _fill_random(model, generator)
    cfg = model.config
    designed = BYTE_VOCAB_SIZE
    for layer in model.layers:
        layer.self_attn.o_proj.weight.mul_(0.05)
        layer.mlp.down_proj.weight.mul_(0.05)
    device = model.embed_tokens.weight.device
    model.embed_tokens.weight.zero_()
    model.embed_tokens.weight[:designed, :designed] = torch.eye(designed, device=device) * signal
    # After the final RMSNorm the one-hot row is ~sqrt(hidden) in its own dim.
    scale = 8.0 / cfg.hidden_size**0.5
    head = torch.zeros(cfg.vocab_size, cfg.hidden_size, device=device)
    for token in range(designed):
        head[toy_successor(token), token] = scale
    model.lm_head.weight.copy_(head)


def byte_tokenizer_files() -> TokenizerFiles:
    """A byte-level tokenizer: every byte is a token (no merges), plus bos and eos."""
    # The byte-level pre-tokenizer maps each byte to a printable character; enumerate them in byte order.
    byte_chars = byte_level_alphabet()
    vocab = {byte_chars[b]: b for b in range(NUM_BYTES)}
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": NUM_BYTES + i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, text in enumerate((BOS_TEXT, EOS_TEXT))
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": []},
    }
    return TokenizerFiles(
        tokenizer_json=json.dumps(tokenizer_json),
        bos_token_id=NUM_BYTES,
        eos_token_ids=(NUM_BYTES + 1,),
        chat_template=BYTE_CHAT_TEMPLATE,
        special_tokens={"bos_token": BOS_TEXT, "eos_token": EOS_TEXT},
    )
