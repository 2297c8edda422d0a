"""Host-side cost of a step, without the device: packing a step's inputs, and the runner's own work.

Usage: python scripts/host_overhead.py [ARTIFACT.pt2]   (any artifact: only its metadata, tokenizer and pool
sizes are used; without one, only the packing rows). The runner rows replace the executor's step with an instant one that returns the
toy-greedy successor of each sampled chunk, so what is timed is scheduling, commit, detokenization, stop
strings and event delivery; with the prefix cache on and off, for prompts that share nothing (what the
cache costs when it cannot help), also with a pool so small that the cache evicts in every step.
Prints microseconds per step; the median of several repeats.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.engine import artifact_tokenizer
from pt2serve.runtime.executor import CallRecord, Executor, ExecutorConfig, PendingStep, StepResult
from pt2serve.runtime.runner import Runner, RunnerConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk, pack

GREEDY = SamplingParams()
REPEATS = 5
RUNNER_REPEATS = 3  # after one that fills the cache; 4 x 64 prompts keep distinct first tokens in 256


def median_us(run, iterations: int) -> float:
    samples = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(iterations):
            run()
        samples.append((time.perf_counter() - started) / iterations * 1e6)
    return statistics.median(samples)


def pack_rows() -> list[tuple[str, float]]:
    decodes = [(i, Chunk(np.arange(100 * i, 100 * i + 80), (5,), 79, GREEDY)) for i in range(64)]
    mixed = [(i, Chunk(np.arange(3000 * i, 3000 * i + 2000), tuple(range(8)), 1992, GREEDY)) for i in range(32)]
    mixed += [(32 + i, Chunk(np.arange(3000 * i + 2000, 3000 * i + 2900), (5,), 899, GREEDY)) for i in range(32)]
    # 64 decodes at context 4,000 and 32,000 (each sequence's cells one run, as a fresh pool hands them out).
    long = {context: [(i, Chunk(np.arange(context * i + 1, context * (i + 1) + 1), (5,), context - 1, GREEDY))
                      for i in range(64)] for context in (4000, 32000)}
    return [
        ("pack: 1 decode, forward_1", median_us(lambda: pack(decodes[:1], "forward_1", 1), 300)),
        ("pack: 64 decodes, forward_64", median_us(lambda: pack(decodes, "forward_64", 64), 300)),
        ("pack: 64 decodes at context 4,000, forward_64", median_us(lambda: pack(long[4000], "forward_64", 64), 30)),
        ("pack: 64 decodes at context 32,000, forward_64", median_us(lambda: pack(long[32000], "forward_64", 64), 5)),
        ("pack: 32 decodes + 32 x 8-token chunks, forward_others",
         median_us(lambda: pack(mixed, "forward_others", None), 100)),
    ]


class InstantStep(PendingStep):
    """A step that ran in no time: each sampled chunk gets the toy-greedy successor of its last token."""

    def __init__(self, chunks: list[Chunk]) -> None:
        # A decode fed by the last step's sample carries a placeholder: any id does for the host's work.
        self._result = StepResult(
            tuple((7 * c.tokens[-1] + 3) % 256 if c.sampling is not None else None for c in chunks),
            (CallRecord("instant", sum(len(c.tokens) for c in chunks)),),
        )

    def result(self) -> StepResult:
        return self._result


def runner_row(path: str, num_requests: int, new_tokens: int, prefix_cache: bool,
               num_cells: int | None = None) -> tuple[str, float]:
    """Microseconds per step of the runner over an instant executor. With `num_cells`, the cache keeps each
    repeat's cells for the next, whose steps then find the pool dry and evict the cells they need."""
    artifact = load_artifact(path)
    executor = Executor(artifact, ExecutorConfig(num_cells=num_cells))
    executor.launch = InstantStep
    tokenizer = artifact_tokenizer(artifact.tokenizer_json, artifact.metadata.raw.get("tokenizer"))
    runner = Runner(executor, tokenizer, RunnerConfig(token_budget=num_requests, prefix_cache=prefix_cache))
    samples = []
    for repeat in range(RUNNER_REPEATS + 1):
        rng = np.random.default_rng(repeat)
        # Prompts that share nothing, in this repeat or with an earlier one: no two start with the same token.
        prompts = [[repeat * num_requests + i, *rng.integers(0, 256, 7).tolist()] for i in range(num_requests)]
        steps_before = len(runner.step_history)
        started = time.perf_counter()
        handles = [runner.submit(p, max_new_tokens=new_tokens, sampling=GREEDY, ignore_eos=True,
                                 stop_strings=("</s>",)) for p in prompts]
        for handle in handles:
            handle.result()
        if repeat:  # the first fills the cache
            samples.append((time.perf_counter() - started) / (len(runner.step_history) - steps_before) * 1e6)
        if num_cells is None:
            runner.clear_prefix_cache()
    runner.close()
    cache = "on" if prefix_cache else "off"
    pool = f", a pool of {num_cells} cells kept full by the cache" if num_cells else ""
    return f"runner: {num_requests} requests x {new_tokens} tokens, prefix cache {cache}{pool}", statistics.median(samples)


def main() -> None:
    rows = pack_rows()
    if len(sys.argv) > 1:
        path = sys.argv[1]
        rows += [runner_row(path, 64, 200, cache) for cache in (False, True)]
        # 64 x (8 + 40) tokens take 3,072 of 4,097 cells: a repeat after the first runs dry after a few steps.
        rows += [runner_row(path, 64, 40, cache, num_cells=4097) for cache in (False, True)]
    width = max(len(name) for name, _ in rows)
    print(f"{'what':<{width}}  us/step")
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.0f}")


if __name__ == "__main__":
    main()
