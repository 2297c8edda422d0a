"""Deterministic artifacts (`export --deterministic`): one sequence's logits are the same bits alone, beside
1-63 others at every static width and on forward_others, chunked at random boundaries and resumed from a
cached prefix; a default export differs in one of those ways (so the property is real); seeded sampled
requests through the server return the same text cold and warm, streamed or not, alone and under load; and the
runtime's --deterministic refuses an artifact built without it.

The ways are pt2serve/bench/invariance.py's (scripts/batch_invariance.py prints them as a table).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from commands import run_in_one_interpreter
from conftest import served
from pt2serve.bench.invariance import OTHER_CELLS, OTHERS_FROM, PoolRuns, decode, prompt_chunk
from pt2serve.errors import Pt2ServeError
from pt2serve.export.options import ExportOptions
from pt2serve.runtime.engine import open_runner
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.runner import RunnerConfig


@pytest.fixture(scope="module")
def runs(deterministic_artifact) -> PoolRuns:
    return PoolRuns(deterministic_artifact, seed=0)


def random_cuts(rng: np.random.Generator, length: int, longest: int) -> list[int]:
    """Chunk lengths of 1 .. longest that add up to `length`."""
    cuts = []
    while sum(cuts) < length:
        cuts.append(int(min(rng.integers(1, longest + 1), length - sum(cuts))))
    return cuts


def with_company(target, others: list, rng: np.random.Generator) -> tuple[list, int]:
    """The target chunk placed at a random index among the others: (chunks, the target's index)."""
    place = int(rng.integers(0, len(others) + 1))
    return [*others[:place], target, *others[place:]], place


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_prompts_logits_are_the_same_bits_every_way(runs, seed):
    assert_the_same_bits_every_way(runs, seed)


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [1, 2])
def test_a_prompts_logits_are_the_same_bits_every_way_on_the_gpu(seed):
    """The same on a CUDA artifact exported with --deterministic (PT2SERVE_CUDA_DETERMINISTIC_ARTIFACT)."""
    path = os.environ.get("PT2SERVE_CUDA_DETERMINISTIC_ARTIFACT")
    if not path:
        pytest.skip("set PT2SERVE_CUDA_DETERMINISTIC_ARTIFACT to a CUDA artifact exported with --deterministic")
    assert_the_same_bits_every_way(PoolRuns(path, seed=0), seed)


def assert_the_same_bits_every_way(runs: PoolRuns, seed: int) -> None:
    """A random prompt's last logit row prefilled whole (forward_others) equals, bit for bit: the prompt in random
    chunks (forward_others, the widest static width, a token at a time on the narrowest), and its last token
    after a cached prefix alone on every method, among 1 .. widest - 1 others on the widest width, among up to
    63 others and beside a prefill chunk on forward_others; the K/V cells written are the same bits too."""
    rng = np.random.default_rng(seed)
    widths = runs.artifact.metadata.forward_sizes
    narrowest, widest = widths[0], widths[-1]
    length = int(rng.integers(12, 90))
    prompt = runs.random_tokens(length)
    whole, whole_state = runs.prefill(prompt, [length])  # on forward_others
    ways, states = {}, {}
    for name, cuts, width in (("random chunks, forward_others", random_cuts(rng, length, 40), None),
                              (f"chunks of up to {widest}, forward_{widest}", random_cuts(rng, length, widest), widest),
                              (f"a token at a time, forward_{narrowest}", [1] * length, narrowest)):
        ways[name], states[name] = runs.prefill(prompt, cuts, width)

    # A prefix-cache hit: all but the last token computed earlier (in chunks), the last one then a decode.
    _, prefix = runs.prefill(prompt[:-1], random_cuts(rng, length - 1, 30))
    last = decode(1, length - 1, prompt[-1])
    for width in (*widths, None):
        method = f"forward_{width}" if width else "forward_others"
        ways[f"cached prefix, last token alone, {method}"] = runs.logits([last], width, prefix.clone())[0]
    for count in range(1, widest):
        chunks, place = with_company(last, runs.others(count), rng)
        ways[f"cached prefix, last token among {count} others, forward_{widest}"] = runs.logits(
            chunks, widest, prefix.clone())[place]
    for count in (widest, 31, 63):
        chunks, place = with_company(last, runs.others(count), rng)
        ways[f"cached prefix, last token among {count} others, forward_others"] = runs.logits(
            chunks, None, prefix.clone())[place]
    # Beside another sequence's prefill chunk (its cells past the others').
    chunk = prompt_chunk(OTHERS_FROM + OTHER_CELLS * 64, 20, runs.random_tokens(30))
    ways["cached prefix, last token beside a prefill chunk, forward_others"] = runs.logits(
        [chunk, last], None, prefix.clone())[1]

    assert {name: torch.equal(row, whole) for name, row in ways.items()} == {name: True for name in ways}
    written = runs.cells_of(whole_state, length)
    for name, state in states.items():
        assert all(torch.equal(a, b) for a, b in zip(written, runs.cells_of(state, length))), name


def test_a_default_export_is_not_batch_invariant(tiny_artifact):
    """The same decode alone on forward_1 (one-row matmuls) and on forward_8 differs in the last bits in a
    default export of the same preset."""
    runs = PoolRuns(tiny_artifact, seed=0)
    target = decode(1, 40, 7)
    assert not torch.equal(runs.logits([target], 1)[0], runs.logits([target], 8)[0])


def test_export_refuses_what_it_cannot_make_deterministic(tmp_path):
    options = ExportOptions(backend="cpu", output=tmp_path / "q.pt2", preset="tiny-random", quantize="int8",
                            deterministic=True)
    with pytest.raises(Pt2ServeError, match="--deterministic with --quantize"):
        options.validate()


def test_the_runtime_refuses_an_artifact_not_built_for_it(tiny_artifact, deterministic_artifact):
    with pytest.raises(Pt2ServeError, match="not exported with --deterministic"):
        open_runner(tiny_artifact, executor_config=ExecutorConfig(deterministic=True))
    (inspected, shown, _), (code, _, err) = run_in_one_interpreter([
        ["inspect", str(deterministic_artifact)],
        ["generate", str(tiny_artifact), "--prompt", "Hi", "--max-new-tokens", "1", "--deterministic"],
    ])
    assert inspected == 0 and "deterministic" in shown and "yes:" in shown
    assert code == 2 and "not exported with --deterministic" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def deterministic_client(deterministic_artifact):
    """A server over the deterministic artifact: its static widths forced, small steps (prompts prefill in
    several chunks beside others' decodes), the prefix cache on."""
    openai = pytest.importorskip("openai")
    runner = open_runner(deterministic_artifact,
                         executor_config=ExecutorConfig(num_cells=4097, use_static_methods=True, deterministic=True),
                         runner_config=RunnerConfig(token_budget=16, min_prefill_chunk=4))
    thread = served(runner, "tiny")
    with openai.OpenAI(base_url=f"{thread.url}/v1", api_key="x", timeout=120, max_retries=0) as client:
        yield client
    thread.stop()
    runner.close()


def test_seeded_samples_repeat_cold_warm_streamed_and_under_load(deterministic_client):
    """The issue's request (temperature 0.7, top_p 0.9, seed 781711784, 110 tokens): its text cold, from the
    prefix cache, streamed, and among other sampled requests arriving with it, is one text."""
    client = deterministic_client
    request = dict(model="tiny", messages=[{"role": "user", "content": "Tell me about the sea, in a few lines."}],
                   max_tokens=110, temperature=0.7, top_p=0.9, seed=781711784, extra_body={"ignore_eos": True})

    def whole() -> tuple[str, int]:
        answer = client.chat.completions.create(**request)
        return answer.choices[0].message.content, answer.usage.prompt_tokens_details.cached_tokens

    def streamed() -> str:
        chunks = client.chat.completions.create(**request, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    cold, cached_cold = whole()
    warm, cached_warm = whole()
    assert cached_cold == 0 and cached_warm > 0
    texts = {"cold": cold, "warm": warm, "streamed": streamed()}

    def other(number: int) -> None:
        client.completions.create(model="tiny", prompt=f"request {number}: " + "waves " * number, max_tokens=40,
                                  temperature=1.0, seed=number, extra_body={"ignore_eos": True})

    for name, ask in (("under load", lambda: whole()[0]), ("streamed under load", streamed)):
        load = [threading.Thread(target=other, args=(n,)) for n in range(1, 7)]
        for thread in load:
            thread.start()
        texts[name] = ask()
        for thread in load:
            thread.join()
    assert len(cold) > 0 and {name: text == cold for name, text in texts.items()} == {name: True for name in texts}
