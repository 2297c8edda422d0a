"""Built-in models, so the project runs with no download: one trained once and shipped in the package, the
others with weights generated from a fixed seed.

- tiny: a small Llama and its byte-level BPE tokenizer, trained on twelve Shakespeare plays by
  scripts/train_tiny.py (files in trained/tiny/): its continuations read as English, for the quickstart and demos.
- tiny-random: a few small layers with random weights and a byte-level tokenizer, for CPU tests.
- toy-greedy: weights built so that each token strongly predicts a fixed successor (see `toy_successor`),
  so greedy output is known in advance and exact token equality can be asserted anywhere.
- toy-greedy-8b: llama-3.1-8b's shape with toy-greedy's design (token ids only): the 8B's cost per step with
  output known in advance, for exact-token checks at that size and for drafters that need text that repeats.
- toy-recall: weights built so that each next token is the successor of the token RECALL_LAG positions back,
  read through attention (see `toy_recall_continuation`): output known in advance that goes wrong when a K/V
  cell it reads does (written to the wrong cell, reused from the wrong prefix, lost in a preemption), which
  toy-greedy's output, following from the newest token alone, survives.
- toy-recall-8b: llama-3.1-8b's shape with toy-recall's design (token ids only).
- toy-copy, toy-copy-8b: toy-recall's design with the token RECALL_LAG positions back copied, not succeeded
  (see `toy_copy_continuation`): the output repeats the prompt's last RECALL_LAG + 1 tokens, so drafts that
  look the text up in its context (n-gram) are right for the reason they exist, read through attention.
- llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, qwen3-8b: the published shapes with random weights, for benchmarks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

from pt2serve.errors import Pt2ServeError
from pt2serve.model.config import ModelConfig, RopeScaling
from pt2serve.model.attention import AttentionImpl
from pt2serve.model.model import Transformer, rope_inv_freq
from pt2serve.tokenizer import TokenizerFiles, byte_level_alphabet

SEED = 20261130
NUM_BYTES = 256
BOS_TEXT, EOS_TEXT = "<|bos|>", "<|eos|>"
BYTE_VOCAB_SIZE = NUM_BYTES + 2  # 256 bytes, then bos, eos
PRESET_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

_LLAMA3_SCALING_1B = RopeScaling(32.0, 1.0, 4.0, 8192)
_LLAMA3_SCALING_8B = RopeScaling(8.0, 1.0, 4.0, 8192)

CONFIGS: dict[str, ModelConfig] = {
    # The shape scripts/train_tiny.py trains (0.95M weights, 1.9 MB in bf16): a change needs a new training run.
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=2048, hidden_size=128, intermediate_size=320, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "tiny-random": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=160,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
    ),
    "toy-greedy": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB_SIZE, hidden_size=BYTE_VOCAB_SIZE + 62,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
        max_position_embeddings=512,
    ),
    "toy-recall": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB_SIZE, hidden_size=128, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512,
    ),
    "toy-copy": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB_SIZE, hidden_size=128, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512,
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
CONFIGS["toy-recall-8b"] = CONFIGS["llama-3.1-8b"]
CONFIGS["toy-copy-8b"] = CONFIGS["llama-3.1-8b"]
PRESET_NAMES = tuple(CONFIGS)
_WITH_BYTE_TOKENIZER = ("tiny-random", "toy-greedy", "toy-recall", "toy-copy")
# Presets whose tokenizer.json and model.safetensors were trained once and ship in the package (package data in
# pyproject.toml), each in TRAINED_DIR / name.
TRAINED_DIR = Path(__file__).with_name("trained")
_TRAINED = ("tiny",)


@dataclass(frozen=True)
class Preset:
    name: str
    config: ModelConfig
    tokenizer: TokenizerFiles | None


def get_preset(name: str) -> Preset:
    if name not in CONFIGS:
        raise Pt2ServeError(f"unknown preset {name!r}; available: {', '.join(PRESET_NAMES)}")
    if name in _WITH_BYTE_TOKENIZER:
        tokenizer = byte_tokenizer_files()
    elif name in _TRAINED:
        tokenizer = trained_tokenizer_files(name)
    else:
        tokenizer = None
    return Preset(name, CONFIGS[name], tokenizer)


def build_preset_model(
    name: str, dtype: torch.dtype, device: str | torch.device = "cpu", attention: AttentionImpl = AttentionImpl.MASKED
) -> Transformer:
    """The preset's model with its trained or generated weights, on `device` in `dtype`."""
    preset = get_preset(name)
    with torch.device("meta"):
        model = Transformer(preset.config, attention)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(SEED)
    with torch.no_grad():
        if name in _TRAINED:
            model.load_state_dict(load_file(TRAINED_DIR / name / "model.safetensors"))
        elif name in _DESIGNED:
            fill, signal = _DESIGNED[name]
            fill(model, generator, signal)
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


def _fill_quiet_random(model: Transformer, generator: torch.Generator) -> None:
    """Small random weights whose branches add little to the residual: o_proj and down_proj scaled by 0.05."""
    _fill_random(model, generator)
    for layer in model.layers:
        layer.self_attn.o_proj.weight.mul_(0.05)
        layer.mlp.down_proj.weight.mul_(0.05)


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
    _fill_quiet_random(model, generator)
    cfg = model.config
    designed = BYTE_VOCAB_SIZE
    device = model.embed_tokens.weight.device
    model.embed_tokens.weight.zero_()
    model.embed_tokens.weight[:designed, :designed] = torch.eye(designed, device=device) * signal
    # After the final RMSNorm the one-hot row is ~sqrt(hidden) in its own dim.
    scale = 8.0 / cfg.hidden_size**0.5
    head = torch.zeros(cfg.vocab_size, cfg.hidden_size, device=device)
    for token in range(designed):
        head[toy_successor(token), token] = scale
    model.lm_head.weight.copy_(head)


# toy-recall's design. Each token is read as a code of 32 dims (its byte's high nibble one-hot, then its low
# nibble one-hot): two codes of different bytes share at most one 1, so reading back the code that matches
# best is exact with a margin of one nibble. bos and eos take the code of their byte modulo 256, whose
# successor is theirs (toy_successor works modulo 256).
_NIBBLE = 16
_CODE_DIMS = 2 * _NIBBLE
_ONES_PER_CODE = 2
# Where the residual stream holds what (dims): the token's own code, a bias every embedding sets to the
# signal (queries and keys are read from it alone, so they are the same vector at every position), the code
# layer 0's designed head copies in, and the code layer 1's copies in (what the LM head reads).
_TOKEN_CODE = slice(0, _CODE_DIMS)
_BIAS = _CODE_DIMS
_COPIES = (slice(_BIAS + 1, _BIAS + 1 + _CODE_DIMS), slice(_BIAS + 1 + _CODE_DIMS, _BIAS + 1 + 2 * _CODE_DIMS))
# Positions each designed head looks back. Longer lags lose the margin below: the fastest rotary pair turns
# by a radian a position, so its cosine no longer rises all the way from distance 0 to the lag.
_LAYER_LAG = 3
RECALL_LAG = _LAYER_LAG * len(_COPIES)
# The designed heads' score at the lag they read, in softmax logits. Every other distance up to
# max_position_embeddings scores at least 13% lower with toy-recall's rotary frequencies (18% with the 8B's),
# so each other cell gets less than e^-13 of the weight; bf16 rounding moves a score by about 0.5.
_PEAK_SCORE = 100.0


def toy_recall_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    """toy-recall's greedy tokens: each is the successor of the token RECALL_LAG positions before the newest
    one, or of the first token while there are fewer."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(toy_successor(tokens[max(len(tokens) - 1 - RECALL_LAG, 0)]))
    return tokens[len(prompt):]


def toy_copy_continuation(prompt: list[int], num_tokens: int) -> list[int]:
    """toy-copy's greedy tokens: each is the byte of the token RECALL_LAG positions before the newest one (bos and
    eos read as their byte, as in toy-recall), or of the first token while there are fewer."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(tokens[max(len(tokens) - 1 - RECALL_LAG, 0)] % NUM_BYTES)
    return tokens[len(prompt):]


def _byte_code(token: int) -> torch.Tensor:
    code = torch.zeros(_CODE_DIMS)
    byte = token % NUM_BYTES
    code[byte // _NIBBLE] = 1.0
    code[_NIBBLE + byte % _NIBBLE] = 1.0
    return code


def _lag_query_and_key(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A query and a key [head_dim] whose score, for a query `distance` positions after the key, is
    sum_j w_j cos((distance - _LAYER_LAG) theta_j) over the rotary pairs j (theta_j their frequencies, w_j
    proportional to theta_j), scaled to _PEAK_SCORE at distance _LAYER_LAG.

    Rotary position encoding turns a fixed query and key into a score that depends on the distance alone.
    The fast pairs make the peak sharp; the slow ones keep far distances from lining up with it again. Below
    the peak every pair's cosine rises with the distance, so a token with fewer than _LAYER_LAG predecessors
    reads the first position: the nearest to the lag it has.
    """
    half = cfg.head_dim // 2
    theta = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).double()
    weight = theta * (_PEAK_SCORE * cfg.head_dim**0.5 / theta.sum())  # sum_j w_j = the peak's raw score
    amplitude = weight.sqrt()
    # Pair j of the query, (cos, -sin) of _LAYER_LAG theta_j, against the key's (1, 0): rotated to positions
    # m and n they score w_j cos((m - n - _LAYER_LAG) theta_j).
    query = torch.cat((amplitude * torch.cos(_LAYER_LAG * theta), -amplitude * torch.sin(_LAYER_LAG * theta)))
    key = torch.cat((amplitude, torch.zeros(half, dtype=amplitude.dtype)))
    return query.float(), key.float()


def _fill_toy_recall(
    model: Transformer, generator: torch.Generator, signal: float, follower: Callable[[int], int] = toy_successor
) -> None:
    """Embeddings hold the token's code and the bias, each entry `signal`. In layer l, query head 0 and its
    KV head 0 look _LAYER_LAG positions back (see _lag_query_and_key): the value is the code held there (the
    token's own in layer 0, layer 0's copy in layer 1), which o_proj adds, times `signal`, at _COPIES[l]. The
    LM head maps the code at _COPIES[-1] to its byte's follower (toy-recall: its successor; toy-copy: the byte
    itself): logit 16 against at most 8 for any other.

    Every other weight is small and random as in toy-greedy, so those paths are exercised (toy-recall-8b: 32
    layers and signal 64, as toy-greedy-8b). How many designed entries the residual holds is known at each
    layer's input, and noise is small beside them, so RMSNorm puts each at sqrt(hidden / count): the weights
    that read them divide by that.
    """
    _fill_quiet_random(model, generator)
    cfg = model.config
    device = model.embed_tokens.weight.device
    head_dim, q_size, kv_size = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    designed = min(cfg.vocab_size, BYTE_VOCAB_SIZE)
    codes = torch.stack([_byte_code(token) for token in range(designed)]).to(device)
    model.embed_tokens.weight.zero_()
    model.embed_tokens.weight[:designed, _TOKEN_CODE] = codes * signal
    model.embed_tokens.weight[:designed, _BIAS] = signal

    def normalised(num_copies: int) -> float:
        """Each designed entry after RMSNorm, once `num_copies` codes were copied in (the bias is one entry)."""
        return (cfg.hidden_size / (_ONES_PER_CODE * (1 + num_copies) + 1)) ** 0.5

    query, key = (vector.to(device) for vector in _lag_query_and_key(cfg))
    copy = torch.eye(_CODE_DIMS, device=device)
    reads = (_TOKEN_CODE,) + _COPIES[:-1]
    for index, (layer, copy_to, read) in enumerate(zip(model.layers, _COPIES, reads)):
        entry = normalised(index)
        qkv, o_proj = layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight
        q_rows, k_rows = slice(0, head_dim), slice(q_size, q_size + head_dim)
        v_rows = slice(q_size + kv_size, q_size + kv_size + head_dim)
        for rows in (q_rows, k_rows, v_rows):
            qkv[rows] = 0.0
        qkv[q_rows, _BIAS] = query / entry
        qkv[k_rows, _BIAS] = key / entry
        qkv[v_rows.start:v_rows.start + _CODE_DIMS, read] = copy / entry
        o_proj[:, :head_dim] = 0.0
        o_proj[copy_to, :_CODE_DIMS] = copy * signal
    # The successor's logit is twice `margin`; a byte sharing one nibble with it gets `margin`.
    margin = 8.0
    model.lm_head.weight.zero_()
    for byte in range(NUM_BYTES):
        model.lm_head.weight[follower(byte), _COPIES[-1]] = codes[byte] * margin / normalised(len(_COPIES))


def _fill_toy_copy(model: Transformer, generator: torch.Generator, signal: float) -> None:
    _fill_toy_recall(model, generator, signal, follower=lambda byte: byte)


# The designed presets: how their weights are filled, and the size of the signal their embedding writes into
# the residual stream: it must outweigh what every layer's small random branches add (see _fill_toy_greedy).
_DESIGNED = {
    "toy-greedy": (_fill_toy_greedy, 1.0),
    "toy-greedy-8b": (_fill_toy_greedy, 64.0),
    "toy-recall": (_fill_toy_recall, 1.0),
    "toy-recall-8b": (_fill_toy_recall, 64.0),
    "toy-copy": (_fill_toy_copy, 1.0),
    "toy-copy-8b": (_fill_toy_copy, 64.0),
}
# Each designed preset's greedy tokens: continuation(prompt, count).
DESIGNED_CONTINUATIONS: dict[str, Callable[[list[int], int], list[int]]] = {
    "toy-greedy": toy_greedy_continuation,
    "toy-greedy-8b": toy_greedy_continuation,
    "toy-recall": toy_recall_continuation,
    "toy-recall-8b": toy_recall_continuation,
    "toy-copy": toy_copy_continuation,
    "toy-copy-8b": toy_copy_continuation,
}


def trained_tokenizer_files(name: str) -> TokenizerFiles:
    """A trained preset's tokenizer: its tokenizer.json, whose added tokens are bos and eos."""
    tokenizer_json = (TRAINED_DIR / name / "tokenizer.json").read_text()
    added = {token["content"]: token["id"] for token in json.loads(tokenizer_json)["added_tokens"]}
    return TokenizerFiles(
        tokenizer_json=tokenizer_json,
        bos_token_id=added[BOS_TEXT],
        eos_token_ids=(added[EOS_TEXT],),
        chat_template=PRESET_CHAT_TEMPLATE,
        special_tokens={"bos_token": BOS_TEXT, "eos_token": EOS_TEXT},
    )


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
        chat_template=PRESET_CHAT_TEMPLATE,
        special_tokens={"bos_token": BOS_TEXT, "eos_token": EOS_TEXT},
    )
