"""Rope scaling computes transformers' numbers for every type pt2serve reads (default, linear, dynamic, yarn,
llama3): the inverse frequencies and attention factor against transformers' ROPE_INIT_FUNCTIONS, and tiny
random models written by transformers, loaded into our eager model, compared on logits at positions well past
the pretraining context (32 positions, factor 4). Each model case also checks that the same comparison fails
with the scaling (or yarn's attention factor) left out, so its parity means something.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from pt2serve.errors import Pt2ServeError  # noqa: E402
from pt2serve.model.checkpoint import load_checkpoint  # noqa: E402
from pt2serve.model.config import ModelConfig, RopeScaling  # noqa: E402
from pt2serve.model.dflash import load_draft, read_dflash_config, write_random_draft  # noqa: E402
from pt2serve.model.eager import EagerSequence  # noqa: E402
from pt2serve.model.model import rope_attention_factor, rope_cos_sin, rope_inv_freq  # noqa: E402
from test_hf_parity import SMALL, build_hf  # noqa: E402

ORIGINAL = 32  # the pretraining context of the tiny models
FACTOR = 4.0
YARN = {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIGINAL}

# name -> (config class name, extra config fields, prompt length). The scaled models' max_position_embeddings
# is ORIGINAL * FACTOR, except dynamic's: there it is the pretraining context itself, and the prompt is exactly
# max_position_embeddings * FACTOR long, the one length where transformers' per-forward base is the fixed one.
MODEL_CASES = {
    "linear": ("LlamaConfig", {"max_position_embeddings": 128,
                               "rope_scaling": {"rope_type": "linear", "factor": FACTOR}}, 100),
    "dynamic": ("LlamaConfig", {"max_position_embeddings": ORIGINAL,
                                "rope_scaling": {"rope_type": "dynamic", "factor": FACTOR}}, 128),
    "yarn": ("LlamaConfig", {"max_position_embeddings": 128, "rope_scaling": YARN}, 100),
    "yarn-qwen2": ("Qwen2Config", {"max_position_embeddings": 128, "use_sliding_window": False,
                                   "rope_scaling": {**YARN, "type": "yarn"}}, 100),
    "yarn-mscale": ("LlamaConfig", {"max_position_embeddings": 128, "rope_scaling": {
        **YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2, "truncate": False}}, 100),
    "yarn-attention-factor": ("LlamaConfig", {"max_position_embeddings": 128,
                                              "rope_scaling": {**YARN, "attention_factor": 1.3}}, 100),
    "llama3": ("LlamaConfig", {"max_position_embeddings": 128, "rope_scaling": {
        "rope_type": "llama3", "factor": FACTOR, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL}}, 100),
}

# name -> (rope_scaling, max_position_embeddings): the tiny models' and the published ones'.
FREQUENCY_CASES = {
    **{name: (extra["rope_scaling"], extra["max_position_embeddings"]) for name, (_, extra, _) in MODEL_CASES.items()},
    "qwen2.5-yarn": ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768),
    "qwen3-yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 40960),
    "deepseek-yarn": ({"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                       "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, 163840),
    "yarn-without-factor": ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}, 16384),
    "dynamic-2x": ({"type": "dynamic", "factor": 2.0}, 4096),
    "linear-8x": ({"type": "linear", "factor": 8.0}, 2048),
    "llama-3.1": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}, 131072),
}


def parse(rope: dict | None, max_positions: int = 128, **fields) -> ModelConfig:
    hf = {**SMALL, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": max_positions, **fields}
    if rope is not None:
        hf["rope_scaling"] = rope
    return ModelConfig.from_hf(hf)


def hf_config(rope: dict, max_positions: int, head_dim: int, theta: float):
    # transformers' Llama config, as from_pretrained builds it from a config.json with this rope_scaling.
    return transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                    max_position_embeddings=max_positions, rope_theta=theta, rope_scaling=dict(rope))


# -- the numbers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim, theta", [(16, 10000.0), (128, 1000000.0)])
@pytest.mark.parametrize("case", list(FREQUENCY_CASES))
def test_inverse_frequencies_and_attention_factor_are_transformers(case, head_dim, theta):
    rope, max_positions = FREQUENCY_CASES[case]
    reference = hf_config(rope, max_positions, head_dim, theta)
    kind = reference.rope_parameters["rope_type"]
    # transformers' dynamic base grows with the forward's length; ours is its value at max_positions * factor.
    seq_len = int(max_positions * rope["factor"]) if kind == "dynamic" else None
    expected, expected_factor = ROPE_INIT_FUNCTIONS[kind](reference, seq_len=seq_len)
    scaling = parse(rope, max_positions, head_dim=head_dim, rope_theta=theta).rope_scaling
    assert scaling.rope_type == kind
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, scaling), expected, rtol=1e-6, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(expected_factor, rel=1e-12)


def test_yarn_attention_factor_multiplies_cos_and_sin():
    positions = torch.arange(100)
    inv_freq = rope_inv_freq(16, 10000.0, None)
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0)
    scaled_cos, scaled_sin = rope_cos_sin(positions, inv_freq, 1.25)
    torch.testing.assert_close(scaled_cos, 1.25 * cos)
    torch.testing.assert_close(scaled_sin, 1.25 * sin)


# -- models --------------------------------------------------------------------------------------------------


def relative_logit_error(model, expected: torch.Tensor, prompt: list[int]) -> float:
    got = EagerSequence(model, len(prompt)).extend(prompt)
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_logits_past_the_pretraining_context_match_transformers(tmp_path, case):
    config_name, extra, prompt_len = MODEL_CASES[case]
    hf = build_hf(tmp_path, config_name, extra)
    model = load_checkpoint(tmp_path, torch.float32).model
    assert model.config.rope_scaling.rope_type == hf.config.rope_parameters["rope_type"]
    prompt = torch.randint(0, SMALL["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt]), use_cache=False).logits[0].float()
    error = relative_logit_error(model, expected, prompt)
    assert error <= 1e-4, f"{case}: max relative logit error {error:.2e}"

    # The same comparison with plain frequencies, and with yarn's attention factor left at 1, fails.
    cfg = model.config
    scaled_inv_freq, attention_factor = model.inv_freq, model.rope_attention_factor
    model.inv_freq, model.rope_attention_factor = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None), 1.0
    assert relative_logit_error(model, expected, prompt) > 1e-2
    if attention_factor != 1.0:
        model.inv_freq = scaled_inv_freq
        assert relative_logit_error(model, expected, prompt) > 1e-2


# -- config.json ---------------------------------------------------------------------------------------------


def test_rope_scaling_and_rope_parameters_with_type_or_rope_type_parse_alike():
    old = parse({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, rope_theta=500000.0)
    new = parse(None, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                       "rope_theta": 500000.0})
    assert old == new
    assert new.rope_theta == 500000.0
    assert new.rope_scaling.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


@pytest.mark.parametrize("rope", [None, {"rope_type": "default"}, {"type": "default"}, {"rope_theta": 10000.0}])
def test_default_rope_has_no_scaling(rope):
    assert parse(rope).rope_scaling is None
    assert parse(None, rope_parameters=rope).rope_scaling is None


@pytest.mark.parametrize("kind", ["longrope", "mrope", "su"])
def test_an_unknown_type_is_refused_naming_the_supported_ones(kind):
    with pytest.raises(Pt2ServeError, match=f"'{kind}' is not supported; supported: default, linear, dynamic, yarn, "
                                            "llama3"):
        parse({"rope_type": kind, "factor": 4.0})


@pytest.mark.parametrize("case", list(FREQUENCY_CASES))
def test_a_scaling_survives_the_artifact_metadata_and_config_json(case):
    rope, max_positions = FREQUENCY_CASES[case]
    cfg = parse(rope, max_positions)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert parse(cfg.rope_scaling.to_hf(), max_positions) == cfg


def test_artifact_metadata_without_a_rope_type_is_llama3():
    """Artifacts exported when llama3 was the only type carry its four fields and no type."""
    cfg = parse(FREQUENCY_CASES["llama-3.1"][0], 131072)
    fields = cfg.to_dict()
    fields["rope_scaling"] = {key: fields["rope_scaling"][key] for key in (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    assert ModelConfig.from_dict(fields) == cfg
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("case", ["linear", "dynamic", "yarn-mscale", "llama3"])
def test_a_dflash_draft_written_for_a_target_has_its_rope(tmp_path, case):
    rope, max_positions = FREQUENCY_CASES[case]
    target = parse(rope, max_positions)
    path = write_random_draft(tmp_path, target)
    assert read_dflash_config(path / "config.json").layers.rope_scaling == target.rope_scaling
    draft = load_draft(path, target, torch.float32, "cpu")
    positions = torch.arange(100)
    inv_freq = rope_inv_freq(target.head_dim, target.rope_theta, target.rope_scaling)
    for ours, expected in zip(draft.rope(positions),
                              rope_cos_sin(positions, inv_freq, rope_attention_factor(target.rope_scaling))):
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("case,context", [
    ("qwen2.5-yarn", 131072), ("qwen3-yarn", 131072), ("deepseek-yarn", 163840), ("llama-3.1", 131072),
    ("linear-8x", 16384), ("dynamic-2x", 8192),
])
def test_the_context_an_export_defaults_to_is_the_scaled_one(case, context):
    """As vLLM reads these configs: yarn's original length times its factor, linear's and dynamic's
    max_position_embeddings times theirs, llama3's max_position_embeddings as written."""
    rope, max_positions = FREQUENCY_CASES[case]
    assert parse(rope, max_positions).context_length == context
    assert parse(None, max_positions).context_length == max_positions
