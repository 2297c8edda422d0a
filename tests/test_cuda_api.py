"""The API features computed on the device, under CUDA graphs and one step in flight, on the tiny-random preset exported
for cuda in fp32: logprobs, penalties and logit bias, n > 1 choices, grammar masks; and what each costs a decode
step of 32 sequences (printed: pytest -rA shows it).

Marked `cuda`: skipped without a GPU; the CPU path of the same features is tested in test_logprobs.py,
test_choices.py, test_structured.py and the server's tests. The grammar check needs xgrammar.
"""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import torch

from conftest import TEST_MAX_CONTEXT, TEST_MAX_STEP_TOKENS, exported
from pt2serve.export.options import ExportOptions
from pt2serve.runtime.sampling import SamplingParams

pytestmark = pytest.mark.cuda

TOLERANCE = 1e-3  # on a log probability


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    def options(path):
        return ExportOptions(backend="cuda", output=path, preset="tiny-random", dtype="fp32", max_context=TEST_MAX_CONTEXT,
                             max_step_tokens=TEST_MAX_STEP_TOKENS, max_cells=8192)

    return exported("tiny-cuda-fp32", options, tmp_path_factory)


@pytest.fixture(scope="module")
def runner(tiny_cuda):
    from pt2serve.runtime.engine import open_runner
    from pt2serve.runtime.runner import RunnerConfig

    runner = open_runner(tiny_cuda, runner_config=RunnerConfig(token_budget=256))
    assert runner.executor.uses_cuda_graphs
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def model(runner):
    from pt2serve.model.presets import build_preset_model

    return build_preset_model("tiny-random", torch.float32, device=runner.executor.device).eval()


def test_logprobs_are_the_eager_models_log_softmax(runner, model):
    """Sampled and echoed-prompt log probabilities, and the top alternative, against the eager model's logits."""
    from pt2serve.model.eager import EagerSequence

    prompt = [256, *range(40, 90)]
    done = runner.generate(prompt, max_new_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5,
                           sampling=SamplingParams(temperature=1.0, seed=1))
    tokens = prompt + done.token_ids
    expected = EagerSequence(model, len(tokens) + 1).extend(tokens).log_softmax(-1).to("cpu")
    worst = 0.0
    for position, scored in enumerate(done.prompt_logprobs):
        worst = max(worst, abs(scored.logprob - expected[position, tokens[position + 1]].item()))
    for k, scored in enumerate(done.logprobs):
        worst = max(worst, abs(scored.logprob - expected[len(prompt) - 1 + k, scored.token].item()))
        assert [t for t, _ in scored.top][:1] == [expected[len(prompt) - 1 + k].argmax().item()], k
    assert worst < TOLERANCE


def reference_greedy(model, prompt: list[int], params: SamplingParams, num: int) -> list[int]:
    """Greedy tokens with the penalties and logit bias of `params` applied on the host, in fp64."""
    from pt2serve.model.eager import EagerSequence

    sequence = EagerSequence(model, len(prompt) + num + 1)
    logits = sequence.extend(prompt)[-1].double().cpu()
    generated: list[int] = []
    for _ in range(num):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=logits.numel()).double()
        seen = (counts > 0) | torch.isin(torch.arange(logits.numel()), torch.tensor(prompt))
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
        for token, value in params.logit_bias:
            x[token] += value
        generated.append(int(x.argmax()))
        logits = sequence.extend([generated[-1]])[-1].double().cpu()
    return generated


def test_penalties_and_logit_bias_match_a_host_reference(runner, model):
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.4,
                            logit_bias=((65, 3.0), (10, -5.0)))
    prompts = [[256, *range(10 + i, 30 + i)] for i in range(8)]
    handles = [runner.submit(p, max_new_tokens=24, ignore_eos=True, sampling=params) for p in prompts]
    for prompt, handle in zip(prompts, handles):
        assert handle.result(timeout=120).token_ids == reference_greedy(model, prompt, params, 24), prompt


def test_choices_sharing_a_prompt_equal_their_seeds_run_alone(runner):
    prompt = [256, *range(100, 160)]
    parent = runner.submit(prompt, max_new_tokens=20, ignore_eos=True, sampling=SamplingParams(1.0, seed=50))
    children = [runner.submit(prompt, max_new_tokens=20, ignore_eos=True, parent=parent,
                              sampling=SamplingParams(1.0, seed=50 + j)) for j in (1, 2, 3)]
    for j, handle in enumerate([parent, *children]):
        alone = runner.generate(prompt, max_new_tokens=20, ignore_eos=True, sampling=SamplingParams(1.0, seed=50 + j))
        assert handle.result(timeout=120).token_ids == alone.token_ids, f"choice {j}"


def test_random_json_schemas_sampled_at_temperature_one_always_parse(runner):
    pytest.importorskip("xgrammar")
    from pt2serve.runtime.grammar import GrammarSpec

    rng = random.Random(0)
    for i in range(16):
        names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))
        schema = {"type": "object", "required": names, "additionalProperties": False,
                  "properties": {n: rng.choice([{"type": "integer", "minimum": 0, "maximum": 999},
                                                {"type": "string", "maxLength": 5}, {"type": "boolean"}])
                                 for n in names}}
        done = runner.generate([256, 1, 2], max_new_tokens=120, sampling=SamplingParams(1.0, seed=i),
                               grammar=GrammarSpec("json_schema", json.dumps(schema)))
        value = json.loads(done.text)  # raises on anything but JSON
        assert set(value) == set(names), (i, done.text)


def step_ms(runner, **kwargs) -> float:
    """Mean ms (device time) of the steps where 32 sequences decode together, with `kwargs` on every request."""
    first = runner.scheduler.step
    handles = [runner.submit([256, *range(i, i + 16)], max_new_tokens=48, ignore_eos=True, **kwargs)
               for i in range(32)]
    for handle in handles:
        handle.result(timeout=300)
    steps = [r.device_seconds if r.device_seconds is not None else r.seconds for r in runner.step_history
             if r.step > first and r.num_decode == 32 and r.num_tokens == 32]
    return statistics.mean(steps) * 1e3 if steps else float("nan")


def test_what_each_feature_costs_a_decode_step(runner):
    sampled = SamplingParams(1.0, seed=1)
    timings = {"plain": step_ms(runner, sampling=sampled),
               "logprobs=20": step_ms(runner, sampling=sampled, logprobs=20),
               "penalties": step_ms(runner, sampling=SamplingParams(1.0, seed=1, frequency_penalty=0.5,
                                                                    repetition_penalty=1.2))}
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        pass
    else:
        from pt2serve.runtime.grammar import GrammarSpec

        # A grammar no row can finish within the 48 tokens, so every step keeps all 32 rows constrained.
        timings["regex grammar"] = step_ms(runner, sampling=sampled, grammar=GrammarSpec("regex", "[a-z ]{100}"))
    print(f"{'32 decodes':<14} {'ms/step':>9}")
    for name, ms in timings.items():
        print(f"{name:<14} {ms:>9.3f}")
    assert all(math.isfinite(ms) and ms > 0 for ms in timings.values()), timings
