"""Timing GPU work as a method runs it: captured in a CUDA graph and replayed, with no launch cost between calls."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_replay_ms(work: Callable[[], object], replays: int = 7) -> float:
    """Median milliseconds of one replay of a CUDA graph of `work`.

    `work` runs once on a side stream first, so compiles and lazy initialisation are not captured.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
