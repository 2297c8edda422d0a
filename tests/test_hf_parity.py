"""Our Transformer, loaded from a Hugging Face checkpoint, computes what Hugging Face's eager model computes.

Each case builds a tiny random model with `transformers`, saves it as safetensors, loads it with
load_checkpoint and compares fp32 logits and a greedy continuation.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pt2serve.model.checkpoint import load_checkpoint  # noqa: E402
from pt2serve.model.eager import EagerSequence, greedy_generate  # noqa: E402

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    vocab_size=300,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# name -> (config class name, extra config fields, prompt length)
CASES = {
    "llama": ("LlamaConfig", {}, 20),
    # Prompt past original_max_position_embeddings, so the scaled long-wavelength frequencies matter.
    "llama3-scaling-tied": ("LlamaConfig", {"rope_scaling": LLAMA3_SCALING, "tie_word_embeddings": True}, 70),
    "llama-wide-head": ("LlamaConfig", {"head_dim": 32, "num_hidden_layers": 3}, 20),
    "mistral": ("MistralConfig", {"sliding_window": None}, 20),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}, 20),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "use_sliding_window": False}, 20),
    "qwen3-wide-head": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}, 20),
}
NUM_NEW = 16


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits spread out, and non-trivial norms/biases so their mapping is tested."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):  # input/post-attention/final norm and Qwen3's q_norm/k_norm
            param.copy_(1.0 + 0.3 * noise)
        else:  # includes the Qwen2 q/k/v biases, zero after Hugging Face's init
            param.copy_(0.1 * noise)


def build_hf(tmp_path, config_name: str, extra: dict, seed: int = 0):
    config = getattr(transformers, config_name)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(model, seed)
    model.save_pretrained(tmp_path)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    for _ in range(num_new):
        token = int(model(ids, use_cache=False).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hugging_face(tmp_path, case):
    config_name, extra, prompt_len = CASES[case]
    hf = build_hf(tmp_path, config_name, extra)
    loaded = load_checkpoint(tmp_path, torch.float32)
    model, cfg = loaded.model, loaded.config

    assert cfg.architecture == type(hf).__name__
    assert cfg.head_dim == extra.get("head_dim", SMALL["hidden_size"] // SMALL["num_attention_heads"])
    assert (model.lm_head is None) == bool(extra.get("tie_word_embeddings", False))
    if "rope_scaling" in extra:
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0

    prompt = torch.randint(0, SMALL["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt]), use_cache=False).logits[0].float()
    got = EagerSequence(model, prompt_len).extend(prompt)
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel <= 1e-4, f"{case}: max relative logit error {rel:.2e}"

    assert greedy_generate(model, prompt, NUM_NEW) == hf_greedy(hf, prompt, NUM_NEW)


def test_llama3_scaling_matters(tmp_path):
    """Sanity check on the case above: without the scaling the logits would differ, so parity means something."""
    hf = build_hf(tmp_path, "LlamaConfig", {"rope_scaling": LLAMA3_SCALING})
    plain = build_hf(tmp_path / "plain", "LlamaConfig", {})
    prompt = list(range(70))
    with torch.no_grad():
        scaled_logits = hf(torch.tensor([prompt]), use_cache=False).logits[0]
        plain_logits = plain(torch.tensor([prompt]), use_cache=False).logits[0]
    # Same seed, same weights: any difference comes from the rotary frequencies.
    assert (scaled_logits - plain_logits).abs().max() > 1e-2
