"""On a GPU: the API features computed on the device are right under CUDA graphs and one step in flight, and
what each costs per step.

Usage: python scripts/device/api_check.py ARTIFACT.pt2 (a tiny-random export for cuda, --dtype fp32)

Checks (each prints ok or what differed):
  logprobs      sampled and echoed-prompt log probabilities equal log_softmax of the eager model's logits
  penalties     greedy tokens with presence/frequency/repetition penalties and logit_bias equal a host reference
  choices       n > 1 children sharing a prompt equal their seeds run alone
  grammar       random JSON schemas sampled at temperature 1 always parse (needs xgrammar)
Then a table: mean ms per decode step of 32 sequences (device time on a GPU), plain and with each feature on
every row.
"""

from __future__ import annotations

import json
import random
import statistics
import sys

import torch

from pt2serve.model.eager import EagerSequence
from pt2serve.model.presets import build_preset_model
from pt2serve.runtime.engine import open_runner
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.runtime.sampling import SamplingParams

TOLERANCE = 1e-3


def check_logprobs(runner, model) -> str:
    prompt = [256, *range(40, 90)]
    done = runner.generate(prompt, max_new_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5,
                           sampling=SamplingParams(temperature=1.0, seed=1))
    tokens = prompt + done.token_ids
    device = model.norm.weight.device
    expected = EagerSequence(model, len(tokens) + 1).extend(tokens).log_softmax(-1).to("cpu")
    worst = 0.0
    for position, scored in enumerate(done.prompt_logprobs):
        worst = max(worst, abs(scored.logprob - expected[position, tokens[position + 1]].item()))
    for k, scored in enumerate(done.logprobs):
        worst = max(worst, abs(scored.logprob - expected[len(prompt) - 1 + k, scored.token].item()))
        if [t for t, _ in scored.top][:1] != [expected[len(prompt) - 1 + k].argmax().item()]:
            return f"top alternative differs at token {k} ({device})"
    return "ok" if worst < TOLERANCE else f"max logprob error {worst:.2e}"


def reference_greedy(model, prompt, params, num) -> list[int]:
    sequence = EagerSequence(model, len(prompt) + num + 1)
    logits = sequence.extend(prompt)[-1].double().cpu()
    generated = []
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


def check_penalties(runner, model) -> str:
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.4,
                            logit_bias=((65, 3.0), (10, -5.0)))
    prompts = [[256, *range(10 + i, 30 + i)] for i in range(8)]
    handles = [runner.submit(p, max_new_tokens=24, ignore_eos=True, sampling=params) for p in prompts]
    for prompt, handle in zip(prompts, handles):
        if handle.result(timeout=120).token_ids != reference_greedy(model, prompt, params, 24):
            return "tokens differ from the host reference"
    return "ok"


def check_choices(runner) -> str:
    prompt = [256, *range(100, 160)]
    parent = runner.submit(prompt, max_new_tokens=20, ignore_eos=True, sampling=SamplingParams(1.0, seed=50))
    children = [runner.submit(prompt, max_new_tokens=20, ignore_eos=True, parent=parent,
                              sampling=SamplingParams(1.0, seed=50 + j)) for j in (1, 2, 3)]
    for j, handle in enumerate([parent, *children]):
        alone = runner.generate(prompt, max_new_tokens=20, ignore_eos=True, sampling=SamplingParams(1.0, seed=50 + j))
        if handle.result(timeout=120).token_ids != alone.token_ids:
            return f"choice {j} differs from its seed alone"
    return "ok"


def check_grammar(runner) -> str:
    try:
        from pt2serve.runtime.grammar import GrammarSpec
        import xgrammar  # noqa: F401
    except ImportError:
        return "skipped (no xgrammar)"
    rng = random.Random(0)
    for i in range(16):
        names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))
        schema = {"type": "object", "required": names, "additionalProperties": False,
                  "properties": {n: rng.choice([{"type": "integer", "minimum": 0, "maximum": 999},
                                                {"type": "string", "maxLength": 5}, {"type": "boolean"}])
                                 for n in names}}
        done = runner.generate([256, 1, 2], max_new_tokens=120, sampling=SamplingParams(1.0, seed=i),
                               grammar=GrammarSpec("json_schema", json.dumps(schema)))
        try:
            value = json.loads(done.text)
        except ValueError:
            return f"schema {i}: not JSON: {done.text!r}"
        if set(value) != set(names):
            return f"schema {i}: keys {sorted(value)} != {sorted(names)}"
    return "ok"


def step_ms(runner, **kwargs) -> float:
    """Mean ms of the steps where 32 sequences decode together, with `kwargs` on every request (device time on
    a GPU; on the CPU, launch to ids)."""
    first = runner.scheduler.step
    handles = [runner.submit([256, *range(i, i + 16)], max_new_tokens=48, ignore_eos=True, **kwargs)
               for i in range(32)]
    for handle in handles:
        handle.result(timeout=300)
    steps = [r.device_seconds if r.device_seconds is not None else r.seconds for r in runner.step_history
             if r.step > first and r.num_decode == 32 and r.num_tokens == 32]
    return statistics.mean(steps) * 1e3 if steps else float("nan")


def main() -> None:
    artifact = sys.argv[1]
    runner = open_runner(artifact, runner_config=RunnerConfig(token_budget=256))
    model = build_preset_model("tiny-random", torch.float32, device=runner.executor.device).eval()
    results = {
        "logprobs": check_logprobs(runner, model),
        "penalties": check_penalties(runner, model),
        "choices": check_choices(runner),
        "grammar": check_grammar(runner),
    }
    timings = {"plain": step_ms(runner, sampling=SamplingParams(1.0, seed=1)),
               "logprobs=20": step_ms(runner, sampling=SamplingParams(1.0, seed=1), logprobs=20),
               "penalties": step_ms(runner, sampling=SamplingParams(1.0, seed=1, frequency_penalty=0.5,
                                                                    repetition_penalty=1.2))}
    if results["grammar"] == "ok":
        from pt2serve.runtime.grammar import GrammarSpec

        # A grammar no row can finish within the 48 tokens, so every step keeps all 32 rows constrained.
        timings["regex grammar"] = step_ms(runner, sampling=SamplingParams(1.0, seed=1),
                                           grammar=GrammarSpec("regex", "[a-z ]{100}"))
    runner.close()
    print(f"{'check':<12} result")
    for name, result in results.items():
        print(f"{name:<12} {result}")
    print(f"{'32 decodes':<14} {'ms/step':>15}")
    for name, ms in timings.items():
        print(f"{name:<14} {ms:>15.3f}")


if __name__ == "__main__":
    main()
