"""Presets: generated weights are deterministic, toy-greedy's and toy-recall's greedy output is the designed
one (toy-recall's read from its K/V cells), and the real-shape presets have the published parameter counts."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from conftest import TEST_MAX_CONTEXT
from pt2serve.errors import Pt2ServeError
from pt2serve.model.eager import EagerSequence, greedy_generate
from pt2serve.model.presets import (
    BYTE_VOCAB_SIZE,
    CONFIGS,
    RECALL_LAG,
    build_preset_model,
    byte_tokenizer_files,
    get_preset,
    toy_copy_continuation,
    toy_greedy_continuation,
    toy_recall_continuation,
    toy_successor,
)
from pt2serve.tokenizer import Tokenizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prompt", [[256, 10, 20, 30], [256] + list(range(0, 250, 7)), [257]])
def test_toy_greedy_continuation_is_the_designed_one(dtype, prompt):
    model = build_preset_model("toy-greedy", dtype).eval()
    assert greedy_generate(model, prompt, 24) == toy_greedy_continuation(prompt, 24)


def test_toy_greedy_margin_is_wide():
    from pt2serve.model.eager import EagerSequence

    model = build_preset_model("toy-greedy", torch.float32).eval()
    logits = EagerSequence(model, 64).extend([256] + list(range(40)))
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 5.0


def test_toy_greedy_8b_keeps_the_design_through_its_32_layers_in_bf16(monkeypatch):
    """toy-greedy-8b is llama-3.1-8b's shape; its design, at that depth and a quarter of the width (the full
    model does not fit a test), gives the designed tokens in bf16 with a wide margin."""
    from pt2serve.model.eager import EagerSequence

    assert CONFIGS["toy-greedy-8b"] == CONFIGS["llama-3.1-8b"] and get_preset("toy-greedy-8b").tokenizer is None
    narrow = dataclasses.replace(CONFIGS["toy-greedy-8b"], hidden_size=1024, intermediate_size=3584, num_heads=8,
                                 num_kv_heads=2, vocab_size=1024)
    monkeypatch.setitem(CONFIGS, "toy-greedy-8b", narrow)
    model = build_preset_model("toy-greedy-8b", torch.bfloat16).eval()
    prompt = list(range(0, 258, 5))
    logits = EagerSequence(model, 64).extend(prompt)
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 5.0
    assert greedy_generate(model, prompt, 8) == toy_greedy_continuation(prompt, 8)


# toy-recall and toy-copy: the same design, the byte read back followed by its successor or by itself.
RECALLING = {"toy-recall": (toy_successor, toy_recall_continuation),
             "toy-copy": (lambda byte: byte, toy_copy_continuation)}


@pytest.fixture(scope="module", params=[(preset, dtype) for preset in RECALLING
                                        for dtype in (torch.float32, torch.bfloat16)],
                ids=lambda param: f"{param[0]}-{str(param[1]).removeprefix('torch.')}")
def recall_model(request):
    preset, dtype = request.param
    return preset, build_preset_model(preset, dtype).eval()


def test_toy_recall_reads_each_next_token_from_the_context(recall_model):
    """At every position of random prompts up to the test artifacts' max context, the next token is the
    follower (toy-recall: successor; toy-copy: the byte itself) of the one RECALL_LAG positions back (of the
    first, nearer the start), by a wide margin; and generating (each new token's K/V written and read back)
    continues as the preset's continuation."""
    preset, model = recall_model
    follower, continuation = RECALLING[preset]
    rng = random.Random(1)
    for length in (TEST_MAX_CONTEXT, 150, 40, RECALL_LAG + 1, RECALL_LAG, 2, 1):
        prompt = [rng.randrange(BYTE_VOCAB_SIZE) for _ in range(length)]
        top2 = EagerSequence(model, length).extend(prompt).topk(2, dim=-1)
        designed = [follower(prompt[max(i - RECALL_LAG, 0)] % 256) for i in range(length)]
        assert top2.indices[:, 0].tolist() == designed, length
        assert (top2.values[:, 0] - top2.values[:, 1]).min() > 5.0
    for length in (1, 3, 30):
        prompt = [256] + [rng.randrange(256) for _ in range(length - 1)]
        assert greedy_generate(model, prompt, 40) == continuation(prompt, 40)


def test_toy_copy_repeats_its_prompts_tail_so_context_lookups_draft_it():
    """toy-copy's continuation is the prompt's last RECALL_LAG + 1 tokens over and over: once that span has been
    generated once, an n-gram lookup in the context proposes every next token right."""
    from pt2serve.runtime.drafter import NgramDrafter

    prompt = [random.Random(3).randrange(256) for _ in range(50)]
    period = RECALL_LAG + 1
    out = toy_copy_continuation(prompt, 5 * period)
    assert out == (prompt[-period:] * 5)
    drafter, text = NgramDrafter(), prompt + out[:2 * period]
    for _ in range(10):
        drafts = drafter.propose(text, 4)
        want = toy_copy_continuation(text, 4)
        assert list(drafts) == want
        text += want


@pytest.mark.parametrize("preset, margin", [("toy-recall", 0.13), ("toy-recall-8b", 0.18)])
def test_toy_recall_heads_score_their_lag_highest_at_every_distance(preset, margin):
    """The designed heads' score, as rotary encoding makes it from their fixed query and key: at every distance
    up to max_position_embeddings, the lag scores highest by `margin` of its score, and shorter distances
    score more the nearer they are to it (a token with fewer predecessors reads the first position)."""
    from pt2serve.model.model import apply_rope, rope_inv_freq
    from pt2serve.model.presets import _LAYER_LAG, _lag_query_and_key

    cfg = CONFIGS[preset]
    query, key = _lag_query_and_key(cfg)
    freqs = torch.arange(cfg.max_position_embeddings)[:, None].float() * rope_inv_freq(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)[None]
    angles = torch.cat((freqs, freqs), dim=-1)
    queries = apply_rope(query.expand(len(angles), 1, -1), angles.cos(), angles.sin())[:, 0]
    scores = queries @ key * cfg.head_dim**-0.5  # a query `distance` positions after an unrotated key
    peak = scores[_LAYER_LAG]
    others = torch.cat((scores[:_LAYER_LAG], scores[_LAYER_LAG + 1:]))
    assert peak - others.max() > margin * peak
    assert (scores[1:_LAYER_LAG + 1] - scores[:_LAYER_LAG]).min() > margin * peak


def forward_writing(model, prompt: list[int], write_cells: torch.Tensor, k_pools, v_pools) -> torch.Tensor:
    """Next-token ids after each prompt token, its K/V written to `write_cells`; the prompt's context is
    cells 1 .. len(prompt) in position order (cell 0 is the scratch cell)."""
    num = len(prompt)
    positions = torch.arange(num)
    logits = model(torch.tensor(prompt), positions, write_cells, torch.zeros(num, dtype=torch.int64),
                   torch.tensor([0, num]), positions + 1, positions, k_pools, v_pools)
    return logits.argmax(-1)


@pytest.mark.parametrize("preset, continuation, reads_context", [
    ("toy-greedy", toy_greedy_continuation, False), ("toy-recall", toy_recall_continuation, True),
])
def test_only_toy_recall_notices_kv_written_to_the_scratch_cell(preset, continuation, reads_context):
    """Every token's K/V written to the scratch cell: attention reads cells nobody wrote. toy-greedy's tokens
    follow from the newest token alone and stay the designed ones; toy-recall's do not."""
    model = build_preset_model(preset, torch.float32).eval()
    cfg = model.config
    prompt = [random.Random(2).randrange(256) for _ in range(60)]
    designed = [continuation(prompt[:i + 1], 1)[0] for i in range(len(prompt))]

    def run(write_cells: torch.Tensor) -> list[int]:
        shape = (len(prompt) + 1, cfg.num_kv_heads, cfg.head_dim)
        k_pools = [torch.zeros(shape) for _ in range(cfg.num_layers)]
        v_pools = [torch.zeros(shape) for _ in range(cfg.num_layers)]
        return forward_writing(model, prompt, write_cells, k_pools, v_pools).tolist()

    assert run(torch.arange(1, len(prompt) + 1)) == designed
    scratch = run(torch.zeros(len(prompt), dtype=torch.int64))
    assert (scratch != designed) is reads_context
    if reads_context:
        assert sum(a != b for a, b in zip(scratch, designed)) > len(prompt) // 2


def test_toy_recall_follows_a_corrupted_kv_cell():
    """The value of the one cell the newest token reads (RECALL_LAG / 2 back, holding what layer 0 copied from
    RECALL_LAG back) replaced by another cell's: the next token is the successor of what that other cell holds."""
    model = build_preset_model("toy-recall", torch.float32).eval()
    prompt = list(range(100, 140))
    sequence = EagerSequence(model, len(prompt))
    sequence.extend(prompt[:-1])
    newest, half = len(prompt) - 1, RECALL_LAG // 2
    read, other = newest - half, 5
    sequence.v_pools[-1][read] = sequence.v_pools[-1][other]
    logits = sequence.extend(prompt[-1:])
    assert int(logits.argmax()) == toy_successor(prompt[other - half]) != toy_successor(prompt[newest - RECALL_LAG])


@pytest.mark.parametrize("preset", ["toy-recall", "toy-copy"])
def test_toy_recall_8b_keeps_the_design_through_its_32_layers_in_bf16(monkeypatch, preset):
    """toy-recall-8b (toy-copy-8b) is llama-3.1-8b's shape; its design, with the 8B's head size, rotary
    frequencies and depth at an eighth of the width (the full model does not fit a test), reads the designed
    tokens in bf16."""
    name, (follower, _) = f"{preset}-8b", RECALLING[preset]
    assert CONFIGS[name] == CONFIGS["llama-3.1-8b"] and get_preset(name).tokenizer is None
    narrow = dataclasses.replace(CONFIGS[name], hidden_size=512, intermediate_size=1792, num_heads=8,
                                 num_kv_heads=2, vocab_size=1024)
    monkeypatch.setitem(CONFIGS, name, narrow)
    model = build_preset_model(name, torch.bfloat16).eval()
    prompt = list(range(0, 258, 5))
    top2 = EagerSequence(model, 64).extend(prompt).topk(2, dim=-1)
    assert top2.indices[:, 0].tolist() == [follower(prompt[max(i - RECALL_LAG, 0)] % 256) for i in range(len(prompt))]
    assert (top2.values[:, 0] - top2.values[:, 1]).min() > 5.0


def test_generated_weights_are_deterministic():
    first = build_preset_model("tiny-random", torch.float32).state_dict()
    second = build_preset_model("tiny-random", torch.float32).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize("name, billions", [("llama-3.2-1b", 1.24), ("llama-3.1-8b", 8.03),
                                            ("qwen3-0.6b", 0.60), ("qwen3-8b", 8.19)])
def test_real_shape_presets_have_the_published_sizes(name, billions):
    assert CONFIGS[name].weight_count / 1e9 == pytest.approx(billions, rel=0.01)


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(Pt2ServeError, match="unknown preset 'nope'; available: tiny"):
        get_preset("nope")


def test_byte_tokenizer_round_trips_any_text():
    tokenizer = Tokenizer(byte_tokenizer_files())
    text = "héllo, wörld ✓ 🎉\n\ttabs"
    ids = tokenizer.encode(text)
    assert ids[0] == 256 and all(0 <= i < 258 for i in ids)
    assert tokenizer.decode(ids) == text
    chat = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert chat.count(256) == 1  # the template's own bos, not a second one
