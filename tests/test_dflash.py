"""DFlash drafts: the draft model against the published math, export (and its refusals), and the runtime's
drafts: the ones the artifact proposes equal the eager model's, and speculation never changes greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from commands import run_in_one_interpreter
from conftest import TEST_EXPORT_JOBS, TEST_MAX_CELLS, TEST_MAX_CONTEXT, TEST_MAX_STEP_TOKENS, exported, random_prompts
from pt2serve.contract import SCRATCH_CELL
from pt2serve.errors import Pt2ServeError
from pt2serve.export.options import ExportOptions
from pt2serve.model.dflash import DraftBlockMethod, DraftContextMethod, attach_draft, write_random_draft
from pt2serve.model.presets import CONFIGS, build_preset_model

BLOCK = 6
TAPS = [0, 1]  # the tiny-random preset has two layers; tapping the last one exercises its after-norm state


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return write_random_draft(tmp_path_factory.mktemp("draft"), CONFIGS["tiny-random"], num_layers=2, block_size=BLOCK,
                              target_layer_ids=TAPS, mask_token_id=257, seed=1)


@pytest.fixture(scope="module")
def eager(draft_dir):
    model = build_preset_model("tiny-random", torch.float32).eval()
    attach_draft(model, draft_dir)
    return model


def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):  # x [L, heads, D]
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).double() / dim)).float()
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = torch.cat((freqs, freqs), -1).cos()[:, None], torch.cat((freqs, freqs), -1).sin()[:, None]
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def published_draft_hidden(weights, cfg, taps, block_embeddings, start):
    """The published DFlash forward for one sequence, written from the checkpoint's own tensors: context
    positions 0..start-1, block positions start..start+B-1, non-causal attention over [context, block]."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    heads, kv_heads, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    context = _rms(taps @ weights["fc.weight"].T, weights["hidden_norm.weight"], eps)
    positions = torch.arange(start + block_embeddings.shape[0])
    h = block_embeddings
    for layer in range(cfg["num_hidden_layers"]):
        w = {k.split(f"layers.{layer}.", 1)[1]: v for k, v in weights.items() if k.startswith(f"layers.{layer}.")}
        x = _rms(h, w["input_layernorm.weight"], eps)
        q = (x @ w["self_attn.q_proj.weight"].T).view(-1, heads, dim)
        k_proj, v_proj = w["self_attn.k_proj.weight"].T, w["self_attn.v_proj.weight"].T
        k = torch.cat((context @ k_proj, x @ k_proj)).view(-1, kv_heads, dim)
        v = torch.cat((context @ v_proj, x @ v_proj)).view(-1, kv_heads, dim)
        q = _rope(_rms(q, w["self_attn.q_norm.weight"], eps), positions[start:], theta)
        k = _rope(_rms(k, w["self_attn.k_norm.weight"], eps), positions, theta)
        groups = heads // kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        h = h + out.transpose(0, 1).reshape(h.shape[0], -1) @ w["self_attn.o_proj.weight"].T
        x = _rms(h, w["post_attention_layernorm.weight"], eps)
        gate, up = x @ w["mlp.gate_proj.weight"].T, x @ w["mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return _rms(h, weights["norm.weight"], eps)


def test_the_draft_model_computes_the_published_forward(eager, draft_dir):
    import json

    cfg = json.loads((draft_dir / "config.json").read_text())
    weights = {k: v.float() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    draft = eager.draft
    num_layers, start = draft.config.layers.num_layers, 7
    layers = draft.config.layers
    pools = [torch.zeros(40, layers.num_kv_heads, layers.head_dim) for _ in range(2 * num_layers)]
    taps = torch.randn(start, draft.fc.in_features)
    context_cells = torch.arange(3, 3 + start)  # mirrored target cells
    block_cells = torch.arange(30, 30 + BLOCK)  # a slot's block cells
    with torch.no_grad():
        DraftContextMethod(eager)(taps, torch.arange(start), context_cells, pools[:num_layers], pools[num_layers:])
        last = torch.tensor([65])
        tokens = torch.cat((last, torch.full((BLOCK - 1,), 257)))
        embeddings = eager.embed_tokens(tokens)
        seq_cells = torch.cat((context_cells, block_cells, torch.full((4,), SCRATCH_CELL)))
        indptr = torch.tensor([0, start + BLOCK])
        ours = draft.draft_hidden(embeddings, indptr, seq_cells, pools[:num_layers], pools[num_layers:],
                                  eager.attention)[0]
        reference = published_draft_hidden(weights, cfg, taps, embeddings, start)
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
        ids = DraftBlockMethod(eager)(last, indptr, seq_cells, pools[:num_layers], pools[num_layers:])
        expected = (reference[1:] @ eager.lm_head.weight.T).argmax(-1)
        assert ids.tolist() == [expected.tolist()]


def test_taps_are_the_hugging_face_hidden_states_of_the_listed_layers(eager):
    """Layer i's tap is its output; the last layer's is after the final norm (Hugging Face's hidden_states)."""
    model = eager
    cfg = model.config
    tokens = torch.tensor([5, 6, 7])
    pools = [torch.zeros(8, cfg.num_kv_heads, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    step = (tokens, torch.arange(3), torch.arange(1, 4), torch.zeros(3, dtype=torch.int64), torch.tensor([0, 3]),
            torch.arange(1, 4), torch.tensor([2]))
    with torch.no_grad():
        logits, taps = model(*step, pools[:cfg.num_layers], pools[cfg.num_layers:])
        x = model.embed_tokens(tokens)
        freqs = torch.arange(3)[:, None].float() * model.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), -1)
        from pt2serve.model.attention import StepAttention

        attend = StepAttention(model.attention, cfg.num_heads, cfg.num_kv_heads, *step[1:2], *step[3:6])
        fresh = [torch.zeros_like(p) for p in pools]
        outs = []
        for i, layer in enumerate(model.layers):
            x = layer(x, angles.cos(), angles.sin(), step[2], attend, fresh[i], fresh[cfg.num_layers + i])
            outs.append(x)
    torch.testing.assert_close(taps, torch.cat((outs[0], model.norm(outs[1])), -1))
    assert logits.shape == (1, cfg.vocab_size)


# -- export ---------------------------------------------------------------------------------------------------


MISFITS = {  # a draft that does not fit the tiny target: what it changes, what the export says
    "hidden-size": ({"hidden_size": 32}, "the draft's hidden_size (32) differs from the target's (64)"),
    "layer-ids": ({"target_layer_ids": [0, 2]}, "names layer 2, but the target has layers 0..1"),
    "rope": ({"rope_theta": 1000000.0}, "the draft's rope (theta 1000000.0"),
}


@pytest.fixture(scope="module")
def misfit_exports(tmp_path_factory) -> dict[str, tuple[Path, tuple[int, str, str]]]:
    """Each misfit's export through the CLI, all in one interpreter: its folder and (exit code, stdout, stderr)."""
    folders = {name: tmp_path_factory.mktemp(name) for name in MISFITS}
    commands = []
    for name, (changes, _) in MISFITS.items():
        changes = dict(changes)
        ids = changes.pop("target_layer_ids", TAPS)
        draft = write_random_draft(folders[name] / "draft", CONFIGS["tiny-random"], block_size=BLOCK,
                                   target_layer_ids=ids, **changes)
        commands.append(["export", "--use-offgraph-kv-cache", "--backend", "cpu", "--preset", "tiny-random", "--draft",
                         str(draft), "-o", str(folders[name] / "out.pt2"), "--max-context", "64"])
    answers = run_in_one_interpreter(commands)
    return {name: (folders[name], answer) for name, answer in zip(MISFITS, answers)}


@pytest.mark.parametrize("misfit", list(MISFITS))
def test_a_draft_that_does_not_fit_the_target_is_a_clear_export_error(misfit_exports, misfit):
    folder, (code, _, stderr) = misfit_exports[misfit]
    message = MISFITS[misfit][1]
    assert code == 2
    assert message in stderr and "Traceback" not in stderr
    assert not (folder / "out.pt2").exists()


# -- the artifact at run time ---------------------------------------------------------------------------------


DRAFT_SIZES = (1, 2)
# One static width: wide enough for a verify step of a whole block (speculation needs one that wide); the only
# step these tests run on a static method is three sequences' decodes, every other runs on forward_others.
FORWARD_SIZES = (8,)


@pytest.fixture(scope="module")
def dflash_artifact(tmp_path_factory, draft_dir) -> Path:
    def options(path: Path) -> ExportOptions:
        return ExportOptions(backend="cpu", output=path, preset="tiny-random", dtype="fp32",
                             max_context=TEST_MAX_CONTEXT, max_step_tokens=TEST_MAX_STEP_TOKENS,
                             max_cells=TEST_MAX_CELLS, jobs=TEST_EXPORT_JOBS, forward_sizes=FORWARD_SIZES,
                             draft=draft_dir, draft_sizes=DRAFT_SIZES)

    return exported("tiny-random-dflash", options, tmp_path_factory)


def _eager_drafts(model, prompts_and_pending: list[tuple[list[int], int]], num_drafts: int) -> list[list[int]]:
    """Each prompt computed by the eager target (writing the eager draft context), then its block drafted."""
    cfg, layers = model.config, model.draft.config.layers
    drafts = []
    for prompt, pending in prompts_and_pending:
        n = len(prompt)
        cells = torch.arange(1, n + 1)
        pools = [torch.zeros(n + BLOCK + 2, cfg.num_kv_heads, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
        draft_pools = [torch.zeros(n + BLOCK + 2, layers.num_kv_heads, layers.head_dim)
                       for _ in range(2 * layers.num_layers)]
        with torch.no_grad():
            logits, taps = model(torch.tensor(prompt), torch.arange(n), cells, torch.zeros(n, dtype=torch.int64),
                                 torch.tensor([0, n]), cells, torch.tensor([n - 1]), pools[:cfg.num_layers],
                                 pools[cfg.num_layers:])
            assert int(logits.argmax()) == pending
            DraftContextMethod(model)(taps, torch.arange(n), cells, draft_pools[:layers.num_layers],
                                      draft_pools[layers.num_layers:])
            seq_cells = torch.cat((cells, torch.arange(n + 1, n + 1 + BLOCK)))
            ids = DraftBlockMethod(model)(torch.tensor([pending]), torch.tensor([0, n + BLOCK]), seq_cells,
                                          draft_pools[:layers.num_layers], draft_pools[layers.num_layers:])
        drafts.append(ids[0, :num_drafts].tolist())
    return drafts


def test_the_artifact_drafts_what_the_eager_model_drafts(dflash_artifact, eager):
    """Prefill through the artifact (static and dynamic forwards write the draft context), then draft three
    sequences at once (a draft_2 call and a draft_1 call): the drafts are the eager model's."""
    from pt2serve.runtime.artifact import load_artifact
    from pt2serve.runtime.drafter import DraftRequest
    from pt2serve.runtime.executor import Executor, ExecutorConfig
    from pt2serve.runtime.sampling import SamplingParams
    from pt2serve.runtime.step import Chunk

    executor = Executor(load_artifact(dflash_artifact, "cpu"),
                        ExecutorConfig(num_cells=700, draft=True, use_static_methods=True))
    prompts = [[3, 1, 4, 1, 5], list(range(40, 70)), [9, 2, 6, 5, 3, 5, 8, 9]]
    cells = [executor.allocator.allocate(len(p)) for p in prompts]
    # Three sequences in one step (forward_others), then one more token each in a static-width step.
    first = executor.step([Chunk(c[:-1], tuple(p[:-1]), 0) for p, c in zip(prompts, cells)])
    assert first.tokens == (None, None, None)
    result = executor.step([Chunk(c, (p[-1],), len(p) - 1, SamplingParams()) for p, c in zip(prompts, cells)])
    requests = [DraftRequest(c, BLOCK - 1) for c in cells]
    drafts = executor.draft.draft_on_device(requests, torch.tensor(result.tokens), None)
    assert drafts.tolist() == _eager_drafts(eager, list(zip(prompts, result.tokens)), BLOCK - 1)


@pytest.mark.parametrize("num_draft_tokens", [1, BLOCK - 1])
def test_dflash_speculation_leaves_greedy_output_unchanged(dflash_artifact, num_draft_tokens):
    from pt2serve.runtime.drafter import Speculation
    from pt2serve.runtime.engine import open_runner
    from pt2serve.runtime.executor import ExecutorConfig
    from pt2serve.runtime.runner import RunnerConfig

    prompts = random_prompts(4, seed=7, max_length=40)
    plain = open_runner(dflash_artifact, executor_config=ExecutorConfig(num_cells=2049))
    try:
        expected = [plain.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in prompts]
    finally:
        plain.close()
    runner = open_runner(dflash_artifact, executor_config=ExecutorConfig(num_cells=2049),
                         runner_config=RunnerConfig(speculate=Speculation.DFLASH, num_draft_tokens=num_draft_tokens))
    try:
        alone = [runner.generate(p, max_new_tokens=24, ignore_eos=True) for p in prompts]
        handles = [runner.submit(p, max_new_tokens=24, ignore_eos=True) for p in prompts]
        together = [h.result(timeout=120) for h in handles]
        assert [c.token_ids for c in alone] == expected
        assert [c.token_ids for c in together] == expected
        assert runner.scheduler.num_draft_tokens > 0 and runner.scheduler.num_verify_steps > 0
    finally:
        runner.close()


def test_dflash_needs_an_artifact_with_a_draft_and_a_block_wide_enough(tiny_artifact, dflash_artifact):
    from pt2serve.runtime.drafter import Speculation
    from pt2serve.runtime.engine import open_runner
    from pt2serve.runtime.runner import RunnerConfig

    with pytest.raises(Pt2ServeError, match="this artifact has no DFlash draft: export it with --draft"):
        open_runner(tiny_artifact, runner_config=RunnerConfig(speculate=Speculation.DFLASH))
    with pytest.raises(Pt2ServeError, match=f"use at most {BLOCK - 1}"):
        open_runner(dflash_artifact, runner_config=RunnerConfig(speculate=Speculation.DFLASH,
                                                                num_draft_tokens=BLOCK))


class RecordingOracle:
    """Runs the artifact's draft and records its proposals, but proposes the known greedy continuation wrong at
    index `accept`: verifying steps accept some drafts and reject others, and the draft context must stay right.
    A device drafter: its proposals go to the device, as the real draft's do."""

    def __init__(self, truth: list[int], accept: int) -> None:
        self.dflash = None  # the runner's executor's draft, once it exists
        self.truth, self.accept = truth, accept
        self.seen: list[tuple[list[int], tuple[int, ...]]] = []
        self.shortfalls: list[int] = []  # each draft's: < 0 for one planned behind a verify that rejected drafts

    def draft_on_device(self, requests, last_tokens, shortfall):
        real = self.dflash.draft_on_device(requests, last_tokens, shortfall).tolist()  # (a test may wait for them)
        shortfall = shortfall.tolist() if shortfall is not None else [0] * len(requests)
        width = max(r.max_drafts for r in requests)
        proposals = []
        for r, drafted, last, short in zip(requests, real, last_tokens.tolist(), shortfall):
            self.shortfalls.append(short)
            position = len(r.cells) + short  # of the pending token: the truth holds every token before it
            self.seen.append((self.truth[:position] + [last], tuple(drafted[:r.max_drafts])))
            drafts = list(self.truth[position + 1:position + 1 + width])
            if self.accept < len(drafts):
                drafts[self.accept] = (drafts[self.accept] + 1) % 258
            proposals.append(drafts + [0] * (width - len(drafts)))
        return torch.tensor(proposals)


def test_the_draft_context_follows_accepted_and_rejected_drafts(dflash_artifact, eager):
    """After verifying steps that accepted 2 of 4 drafts, every block the artifact drafted is what the eager model
    drafts from a fresh computation of the same tokens: accepted rows' context came from the verify forward,
    rejected rows' was rewritten, and blocks drafted behind a verify in flight read a context moved back by
    its rejected drafts on the device."""
    from pt2serve.runtime.engine import open_runner
    from pt2serve.runtime.executor import ExecutorConfig
    from pt2serve.runtime.runner import RunnerConfig

    prompt = [7, 3, 9, 200, 14, 15, 92, 65, 35, 89]
    runner = open_runner(dflash_artifact, executor_config=ExecutorConfig(num_cells=1025, draft=True),
                         runner_config=RunnerConfig(token_budget=64))
    try:
        truth = prompt + runner.generate(prompt, max_new_tokens=30, ignore_eos=True).token_ids
    finally:
        runner.close()
    oracle = RecordingOracle(truth, accept=2)
    runner = open_runner(dflash_artifact, executor_config=ExecutorConfig(num_cells=1025, draft=True),
                         runner_config=RunnerConfig(token_budget=64, num_draft_tokens=4), drafter=oracle)
    oracle.dflash = runner.executor.draft
    try:
        result = runner.generate(prompt, max_new_tokens=30, ignore_eos=True)
        assert prompt + result.token_ids == truth
        assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens
    finally:
        runner.close()
    assert len(oracle.seen) >= 5
    # Drafted behind verifies still in flight, their contexts laid out again on the device (2 of 4 rejected).
    assert oracle.shortfalls.count(-2) >= 3
    for tokens, drafted in oracle.seen:
        expected = _eager_drafts(eager, [(tokens[:-1], tokens[-1])], len(drafted))
        assert [list(drafted)] == expected


@pytest.mark.skipif(not __import__("pt2serve.kernels.cell_attention", fromlist=["x"]).is_available(),
                    reason="needs the triton package")
def test_the_attention_kernel_drafts_like_the_masked_path(eager):
    """The GPU artifacts' attention kernel (run by Triton's interpreter here) sees the block non-causally too:
    its visibility is by position, and every block token sits at the block's last position."""
    from pt2serve.model.attention import AttentionImpl

    layers = eager.draft.config.layers
    contexts = [5, 11]
    pools = [torch.randn(80, layers.num_kv_heads, layers.head_dim) for _ in range(2 * layers.num_layers)]
    seq_cells = torch.cat((torch.arange(1, 6), torch.arange(60, 66), torch.arange(10, 21), torch.arange(66, 72),
                           torch.zeros(3, dtype=torch.int64)))
    indptr = torch.tensor([0, contexts[0] + BLOCK, sum(contexts) + 2 * BLOCK])
    embeddings = torch.randn(2 * BLOCK, layers.hidden_size)
    outputs = []
    for impl in (AttentionImpl.MASKED, AttentionImpl.KERNEL):
        copies = [p.clone() for p in pools]
        with torch.no_grad():
            outputs.append(eager.draft.draft_hidden(embeddings, indptr, seq_cells, copies[:layers.num_layers],
                                                    copies[layers.num_layers:], impl))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)


def test_the_server_reports_dflash_acceptance_in_usage_and_metrics(dflash_artifact):
    """Served with --speculate dflash (the flags' path): usage.speculation and /metrics count the draft's steps."""
    import httpx
    from conftest import served
    from test_server import metrics

    from pt2serve.runtime.engine import describe_load, open_runner
    from pt2serve.runtime.executor import ExecutorConfig
    from pt2serve.runtime.runner import RunnerConfig
    from pt2serve.runtime_flags import speculation

    config = RunnerConfig(token_budget=64, **speculation("dflash", 3))
    runner = open_runner(dflash_artifact, executor_config=ExecutorConfig(num_cells=1025), runner_config=config)
    thread = served(runner, "tiny")
    try:
        assert "speculating with DFlashDrafter, up to 3 drafts per sequence and step" in describe_load(runner)
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        usage = httpx.post(f"{thread.url}/v1/completions", json=body, timeout=60).json()["usage"]["speculation"]
        assert usage["steps"] > 0 and usage["steps"] < usage["draft_tokens"] <= 3 * usage["steps"]
        assert usage["mean_accepted_length"] == pytest.approx(1 + usage["accepted_tokens"] / usage["steps"], abs=0.01)
        samples = metrics(thread.url)
        assert samples["pt2serve_spec_verify_steps_total"] == usage["steps"]
        assert samples["pt2serve_spec_draft_tokens_total"] == usage["draft_tokens"]
    finally:
        thread.stop()
        runner.close()


def test_the_rope_check_takes_a_draft_without_the_targets_scaling_but_refuses_another():
    import dataclasses

    from pt2serve.model.config import RopeScaling
    from pt2serve.model.dflash import DFlashConfig, check_against_target

    target = CONFIGS["llama-3.2-1b"]

    def draft(**changes) -> DFlashConfig:
        return DFlashConfig(dataclasses.replace(target, num_layers=1, **changes), 16, 5, (1, 7))

    check_against_target(draft(), target, "draft")
    check_against_target(draft(rope_scaling=None), target, "draft")  # trained with plain rope: its own is used
    with pytest.raises(Pt2ServeError, match="the draft's rope"):
        check_against_target(draft(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)), target, "draft")
    with pytest.raises(Pt2ServeError, match="the draft's rope"):
        check_against_target(draft(rope_theta=10000.0), target, "draft")
