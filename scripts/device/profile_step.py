"""On a GPU: where a decode step's time goes, kernel by kernel (graphs off, so each kernel is seen).

Usage: python scripts/device/profile_step.py ARTIFACT.pt2 [WIDTH ...]
For each width, decodes that many sequences at context 64 for a few steps under torch.profiler and prints
the kernels that took the most GPU time per step, with their share of the step, and how many kernels a step
runs (on a CPU: operators).
"""

from __future__ import annotations

import sys

from torch.profiler import ProfilerActivity, profile

from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk

CONTEXT, STEPS, TOP = 64, 5, 16


def profile_width(executor: Executor, width: int) -> None:
    seqs = [executor.allocator.allocate(CONTEXT + 2 * STEPS) for _ in range(width)]
    for cells in seqs:
        executor.step([Chunk(cells, tuple(range(1, CONTEXT + 1)), 0, None)])
    def decode_at(position: int) -> None:
        executor.step([Chunk(cells, (7,), position, SamplingParams()) for cells in seqs])

    for i in range(STEPS):  # warm up
        decode_at(CONTEXT + i)
    on_gpu = executor.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for i in range(STEPS):
            decode_at(CONTEXT + STEPS + i)

    def spent(event) -> float:  # microseconds
        return event.device_time_total if on_gpu else event.self_cpu_time_total

    events = sorted((e for e in prof.key_averages() if spent(e) > 0), key=spent, reverse=True)
    total = sum(spent(e) for e in events) / STEPS
    launches = sum(e.count for e in events) // STEPS
    print(f"T={width}: {total / 1000:.2f} ms of kernels per step, {launches} kernels")
    print(f"  {'kernel':<70} {'calls':>5} {'ms/step':>8} {'share':>6}")
    for e in events[:TOP]:
        per_step = spent(e) / STEPS
        print(f"  {e.key[:70]:<70} {e.count // STEPS:>5} {per_step / 1000:8.3f} {per_step / total:6.1%}")
    for cells in seqs:
        executor.allocator.free(cells)


def main() -> None:
    artifact = load_artifact(sys.argv[1])
    num_cells = min(8193, artifact.metadata.max_cells + 1)
    executor = Executor(artifact, ExecutorConfig(num_cells=num_cells, use_cuda_graphs=False, use_static_methods=True))
    for width in [int(w) for w in sys.argv[2:]] or [1, 64]:
        profile_width(executor, width)


if __name__ == "__main__":
    main()
