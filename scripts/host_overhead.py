"""Host-side cost of a step, without the device: packing a step's inputs, and the runner's own work.

Usage: python scripts/host_overhead.py ARTIFACT.pt2   (any artifact: only its metadata, tokenizer and pool
sizes are used). The runner rows replace the executor's step with an instant one that returns the
toy-greedy successor of each sampled chunk, so what is timed is scheduling, commit, detokenization, stop
strings and event delivery. Prints microseconds per step; the median of several repeats.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.engine import artifact_tokenizer
from pt2serve.runtime.executor import CallRecord, Executor, ExecutorConfig, StepResult
from pt2serve.runtime.runner import Runner, RunnerConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk, pack

GREEDY = SamplingParams()
REPEATS = 5


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
    return [
        ("pack: 1 decode, forward_1", median_us(lambda: pack(decodes[:1], "forward_1", 1, 4096), 300)),
        ("pack: 64 decodes, forward_64", median_us(lambda: pack(decodes, "forward_64", 64, 8192), 300)),
        ("pack: 32 decodes + 32 x 8-token chunks, forward_others",
         median_us(lambda: pack(mixed, "forward_others", None, None), 100)),
    ]


def runner_row(path: str, num_requests: int, new_tokens: int) -> tuple[str, float]:
    artifact = load_artifact(path)
    executor = Executor(artifact, ExecutorConfig())

    def instant_step(chunks: list[Chunk]) -> StepResult:
        tokens = tuple((7 * c.tokens[-1] + 3) % 256 if c.sampling is not None else None for c in chunks)
        return StepResult(tokens, (CallRecord("instant", sum(len(c.tokens) for c in chunks)),))

    executor.step = instant_step
    tokenizer = artifact_tokenizer(artifact.tokenizer_json, artifact.metadata.raw.get("tokenizer"))
    runner = Runner(executor, tokenizer, RunnerConfig(token_budget=num_requests))
    started = time.perf_counter()
    handles = [runner.submit([1 + i % 200] * 8, max_new_tokens=new_tokens, sampling=GREEDY, ignore_eos=True,
                             stop_strings=("</s>",)) for i in range(num_requests)]
    for handle in handles:
        handle.result()
    seconds = time.perf_counter() - started
    steps = len(runner.step_history)
    runner.close()
    return f"runner: {num_requests} requests x {new_tokens} tokens, instant executor", seconds / steps * 1e6


def main() -> None:
    rows = pack_rows() + [runner_row(sys.argv[1], 64, 200)]
    width = max(len(name) for name, _ in rows)
    print(f"{'what':<{width}}  us/step")
    for name, us in rows:
        print(f"{name:<{width}}  {us:7.0f}")


if __name__ == "__main__":
    main()
