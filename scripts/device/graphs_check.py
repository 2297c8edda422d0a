"""On a GPU: the same random mixed steps with CUDA graphs on and off give identical tokens.

Usage: python scripts/device/graphs_check.py ARTIFACT.pt2 (a toy-greedy export for the GPU)
Prints load/capture time and memory, then one table row per configuration.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from pt2serve.model.presets import toy_greedy_continuation
from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk

WIDTHS = list(range(1, 66)) + [96, 97]
GREEDY = SamplingParams()


def run_widths(executor: Executor, seed: int) -> tuple[list, list, float]:
    """Teacher-forced random mixes of sequences; returns (tokens, methods, seconds)."""
    rng = np.random.default_rng(seed)
    outputs, methods = [], []
    widths = WIDTHS + [executor.max_step_tokens + 20]
    rng.shuffle(widths)
    started = time.perf_counter()
    for width in widths:
        chunks, held = [], []
        remaining = width
        while remaining:
            length = int(min(remaining, rng.integers(1, 12)))
            prompt = [int(rng.integers(0, 256))]
            truth = prompt + toy_greedy_continuation(prompt, 200)
            start = int(rng.integers(0, 40))
            cells = executor.allocator.allocate(start + length)
            held.append(cells)
            wants = bool(rng.integers(0, 2))
            # Context before `start` is written by an earlier step of the same sequence.
            if start:
                executor.step([Chunk(cells, tuple(truth[:start]), 0, None)])
            chunks.append(Chunk(cells, tuple(truth[start:start + length]), start, GREEDY if wants else None))
            remaining -= length
            outputs.append(("expect", truth[start + length] if wants else None))
        result = executor.step(chunks)
        outputs.extend(("got", t) for t in result.tokens)
        step_methods = tuple(c.method for c in result.calls)
        methods.append(step_methods)
        expected = [v for k, v in outputs[-2 * len(chunks):-len(chunks)]]
        wrong = sum(e != g for e, g in zip(expected, result.tokens))
        if wrong:
            print(f"width {width} via {'+'.join(step_methods)}: {wrong} of {len(chunks)} outputs differ")
        for cells in held:
            executor.allocator.free(cells)
    if executor.device.type == "cuda":
        torch.cuda.synchronize()
    return outputs, methods, time.perf_counter() - started


def main() -> None:
    path = sys.argv[1]
    artifact = load_artifact(path)
    print(f"load: {artifact.report.load_seconds:.2f} s, weights {artifact.report.weight_bytes / 1e6:.1f} MB")
    rows = []
    results = {}
    for use_graphs in (True, False):
        executor = Executor(artifact, ExecutorConfig(num_cells=4096, use_cuda_graphs=use_graphs))
        mem = executor.memory
        outputs, methods, seconds = run_widths(executor, seed=0)
        expected = [v for k, v in outputs if k == "expect"]
        got = [v for k, v in outputs if k == "got"]
        results[use_graphs] = got
        rows.append((use_graphs, mem.capture_seconds, mem.graph_bytes / 1e6, mem.pool_bytes / 1e6,
                     got == expected, seconds))
        del executor
    print(f"{'graphs':>6} {'capture s':>9} {'graph MB':>8} {'pool MB':>8} {'= designed':>10} {'run s':>6}")
    for graphs, capture, graph_mb, pool_mb, ok, seconds in rows:
        print(f"{str(graphs):>6} {capture:9.2f} {graph_mb:8.1f} {pool_mb:8.1f} {str(ok):>10} {seconds:6.2f}")
    same = results[True] == results[False]
    designed = all(row[4] for row in rows)
    print("graphs on == graphs off:", same)
    print("PASS" if same and designed else "FAIL")
    sys.exit(0 if same and designed else 1)


if __name__ == "__main__":
    main()
