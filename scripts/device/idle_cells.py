"""On a GPU: one decoding sequence's step time with the pool otherwise empty, then with 60,000 other cells held
(and written) by idle sequences. Attention reads only a token's own cells, so the two should match.

Usage: python scripts/device/idle_cells.py ARTIFACT.pt2 [IDLE_CELLS]
"""

from __future__ import annotations

import statistics
import sys

import torch

from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk

CONTEXT, STEPS = 64, 50


def decode_ms(executor: Executor) -> float:
    cells = executor.allocator.allocate(CONTEXT + STEPS + 8)
    executor.step([Chunk(cells, tuple(range(1, CONTEXT + 1)), 0, None)])
    times = []
    for i in range(STEPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        executor.step([Chunk(cells, (7,), CONTEXT + i, SamplingParams())])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    executor.allocator.free(cells)
    return statistics.median(times[5:])


def main() -> None:
    idle = int(sys.argv[2]) if len(sys.argv) > 2 else 60_000
    executor = Executor(load_artifact(sys.argv[1]), ExecutorConfig(num_cells=idle + 4096))
    empty = decode_ms(executor)
    held = []
    for _ in range(idle // 2000):  # idle sequences of 2,000 written cells each
        cells = executor.allocator.allocate(2000)
        executor.step([Chunk(cells, tuple(range(1, 2001)), 0, None)])
        held.append(cells)
    busy = decode_ms(executor)
    print(f"| one decode, context {CONTEXT} | pool otherwise empty {empty:.3f} ms | with {idle} idle cells "
          f"{busy:.3f} ms | {busy / empty - 1:+.1%} |")


if __name__ == "__main__":
    main()
