"""CUDA graphs for the static forward methods, and the fixed-address input buffers they read.

A captured graph freezes every shape and address, so each static width owns one device buffer laid out
as step.py packs inputs; a step copies its packed host array into the front of that buffer (one copy) and
replays. Which cells each token sees is data in the buffer, so one graph per width serves any mix of
sequences. The buffer's last region (the context index) has the method's fixed length, every entry a step
of that width may list; a step fills only its own part of it, and the graph reads no further than the
step's data says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from pt2serve.contract import FORWARD_INPUTS
from pt2serve.runtime.step import FORWARD_LAYOUT, MethodCall, region_offsets, regions


@dataclass
class StaticBuffers:
    """A device buffer and its input slices, plus a pinned host staging array of the same layout."""

    device_buffer: torch.Tensor
    host_staging: torch.Tensor
    inputs: list[torch.Tensor]
    copied: torch.cuda.Event | None  # the last copy out of host_staging, on CUDA

    @classmethod
    def allocate(cls, sizes: tuple[int, ...], device: torch.device,
                 layout: tuple[int, ...] | None = None) -> "StaticBuffers":
        total = region_offsets(sizes, layout)[1]
        device_buffer = torch.zeros(total, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        host_staging = torch.zeros(total, dtype=torch.int64, pin_memory=pinned)
        copied = torch.cuda.Event() if pinned else None
        return cls(device_buffer, host_staging, regions(device_buffer, sizes, layout), copied)

    def load(self, host: np.ndarray) -> None:
        """Copy a packed step into the front of the buffer (asynchronously on CUDA; stream order keeps it safe).

        `host` may be shorter than the buffer: its last region then holds fewer entries than the buffer's."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy must have left the staging array first
        length = len(host)
        self.host_staging.numpy()[:length] = host
        self.device_buffer[:length].copy_(self.host_staging[:length], non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class CapturedForward:
    """One static method (a forward width, or a draft method): its buffers and, on CUDA with graphs on, its
    captured graph. Its inputs are the packed regions of `sizes`, then `pools`; it returns its first output."""

    def __init__(self, run, method: str, idle_step: np.ndarray, sizes: tuple[int, ...], pools, device,
                 graph_pool=None, layout: tuple[int, ...] | None = None):
        self.method = method
        self.buffers = StaticBuffers.allocate(sizes, device, layout)
        self.buffers.load(idle_step)
        self._run = run
        self._pools = pools
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        if graph_pool is not None:
            self._capture(graph_pool)

    def _call(self) -> torch.Tensor:
        return self._run(self.method, [*self.buffers.inputs, *self._pools])[0]

    def _capture(self, graph_pool) -> None:
        # The buffers hold an all-padding step (valid, writes only the scratch cell). Warm up on a side
        # stream so lazy initialisation is not captured.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._call()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=graph_pool):
            self.logits = self._call()

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The fixed-address input regions (tokens first), for changes on the device between load and run."""
        return self.buffers.inputs

    def load(self, host: np.ndarray) -> None:
        self.buffers.load(host)

    def run(self) -> torch.Tensor:
        """The logits of the loaded step (a fixed buffer under a graph: valid until the next run)."""
        if self.graph is None:
            return self._call()
        self.graph.replay()
        return self.logits


def capture_all(run, idle_steps: dict[str, tuple[MethodCall, tuple[int, ...]]], pools, device,
                use_graph: bool) -> tuple[dict, float]:
    """A CapturedForward per static method, from (its all-padding step, its buffer's region sizes); returns
    them and the capture seconds.

    Every graph allocates from one memory pool, the widest captured first: one step's graph runs at a time
    and its logits are consumed (in stream order) before the next replay, so the graphs can share memory and
    all of them take about what the widest alone takes.
    """
    started = time.perf_counter()
    graph_pool = torch.cuda.graph_pool_handle() if use_graph else None
    assert all(len(sizes) == len(FORWARD_INPUTS) for _, sizes in idle_steps.values())
    widest_first = sorted(idle_steps.items(), key=lambda item: -item[1][0].width)
    captured = {
        name: CapturedForward(run, name, idle.host, sizes, pools, device, graph_pool, FORWARD_LAYOUT)
        for name, (idle, sizes) in widest_first
    }
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return captured, time.perf_counter() - started
