"""--mode profile: where a decode step's time goes, kernel by kernel.

For each width T in --tokens, T sequences with prompts of CONTEXT tokens (each prefilled alone) decode
together: `warmup` steps, then `iters` steps under torch.profiler. CUDA graphs are off and the static methods
on, so a step runs the method a graph would replay (forward_T for a static width) and every kernel is seen
(a replayed graph shows as one launch). Per width: the kernels' device time per step, the kernels a step
launches, and the TOP kernels by time with their calls per step, ms per step and share of the step.
On a CPU the profiler sees operators instead of kernels, timed by their own (self) CPU time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pt2serve.bench.progress import Progress
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.executor import Executor, ExecutorConfig

CONTEXT = 64  # tokens each sequence holds before its first decode
TOP = 16  # kernels listed per width
DECODE_TOKEN = 7  # the token every decode feeds (any id the vocabulary holds)
DEFAULT_TOKENS = (1, 64)


@dataclass(frozen=True)
class ProfileOptions:
    tokens: tuple[int, ...] | None = None  # decode widths T; None: DEFAULT_TOKENS
    warmup: int = 3  # decode steps before the profiled ones
    iters: int = 10  # profiled decode steps (the times are per step: their total over iters)

    def check(self) -> None:
        if self.tokens is not None and (not self.tokens or any(t < 1 for t in self.tokens)):
            raise Pt2ServeError(f"--tokens must be positive integers, got {list(self.tokens)}")
        if self.warmup < 0:
            raise Pt2ServeError(f"--warmup must be at least 0, got {self.warmup}")
        if self.iters < 1:
            raise Pt2ServeError(f"--iters must be at least 1, got {self.iters}")

    @property
    def widths(self) -> tuple[int, ...]:
        return self.tokens or DEFAULT_TOKENS

    def cells_per_sequence(self) -> int:
        return CONTEXT + self.warmup + self.iters + 1


@dataclass(frozen=True)
class KernelTime:
    name: str
    calls_per_step: float
    ms_per_step: float
    share: float  # of the step's kernel time


@dataclass
class ProfileRow:
    tokens: int  # T: sequences decoding together
    methods: list[str]  # the compiled methods the profiled steps called
    ms_per_step: float  # the kernels' (CPU: operators') time per step
    kernels_per_step: int
    top: list[KernelTime] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ProfileResult:
    rows: list[ProfileRow]
    options: ProfileOptions
    device: str
    num_cells: int
    timer: str  # what was timed: "kernels (device time)" or "operators (self CPU time)"


def profile_executor_config(config: ExecutorConfig, options: ProfileOptions, max_cells: int) -> ExecutorConfig:
    """The bench's pool flags, graphs off and static methods on; without a pool size, a pool just big enough."""
    if config.num_cells is None:
        needed = max(options.widths) * options.cells_per_sequence() + 1  # + the scratch cell
        config = dataclasses.replace(config, num_cells=min(needed, max_cells + 1))
    return dataclasses.replace(config, use_cuda_graphs=False, use_static_methods=True)


def run_profile(path: str | Path, options: ProfileOptions = ProfileOptions(), device: str | None = None,
                executor_config: ExecutorConfig = ExecutorConfig(), progress: Progress | None = None) -> ProfileResult:
    """Load `path` and profile a decode step of every width in `options` (see the module docstring)."""
    from pt2serve.runtime.artifact import load_artifact, read_metadata

    options.check()
    meta = read_metadata(path)
    if options.cells_per_sequence() > meta.max_context:
        raise Pt2ServeError(f"a profiled sequence holds {options.cells_per_sequence()} tokens, more than the "
                            f"artifact's max context ({meta.max_context}): lower --warmup or --iters")
    _say(progress, f"loading {path}")
    artifact = load_artifact(path, device=device)
    executor = Executor(artifact, profile_executor_config(executor_config, options, meta.max_cells))
    needed = max(options.widths) * options.cells_per_sequence()
    if needed > executor.allocator.capacity:
        raise Pt2ServeError(f"T={max(options.widths)}: the KV pool ({executor.allocator.capacity} cells) cannot hold "
                            f"{max(options.widths)} sequences of {options.cells_per_sequence()} tokens; give a "
                            "larger pool (--num-cells)")
    rows = []
    for width in options.widths:
        _say(progress, f"profiling T={width}")
        rows.append(profile_width(executor, width, options))
    on_gpu = executor.device.type == "cuda"
    timer = "kernels (device time)" if on_gpu else "operators (self CPU time)"
    return ProfileResult(rows, options, str(executor.device), executor.allocator.num_cells, timer)


def profile_width(executor: Executor, width: int, options: ProfileOptions) -> ProfileRow:
    """`width` sequences at context CONTEXT decode together; the last `iters` steps under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from pt2serve.runtime.sampling import SamplingParams
    from pt2serve.runtime.step import Chunk

    seqs = [executor.allocator.allocate(options.cells_per_sequence()) for _ in range(width)]
    methods: set[str] = set()
    try:
        for cells in seqs:
            executor.step([Chunk(cells, tuple(range(1, CONTEXT + 1)), 0, None)])

        def decode_at(position: int) -> None:
            result = executor.step([Chunk(cells, (DECODE_TOKEN,), position, SamplingParams()) for cells in seqs])
            methods.update(call.method for call in result.calls)

        for i in range(options.warmup):
            decode_at(CONTEXT + i)
        on_gpu = executor.device.type == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
            for i in range(options.iters):
                decode_at(CONTEXT + options.warmup + i)
    finally:
        for cells in seqs:
            executor.allocator.free(cells)

    def spent_us(event) -> float:
        return event.device_time_total if on_gpu else event.self_cpu_time_total

    events = sorted((e for e in prof.key_averages() if spent_us(e) > 0), key=spent_us, reverse=True)
    total_us = sum(spent_us(e) for e in events) / options.iters
    top = [KernelTime(e.key, e.count / options.iters, spent_us(e) / options.iters / 1000,
                      spent_us(e) / options.iters / total_us if total_us else 0.0) for e in events[:TOP]]
    launches = sum(e.count for e in events) // options.iters
    return ProfileRow(width, sorted(methods), total_us / 1000, launches, top)


def profile_tables(result: ProfileResult, title: str) -> list:
    """For each width a line (its kernels' time per step and their count), then a table of its TOP kernels."""
    from rich.table import Table

    what = "kernels" if result.timer.startswith("kernels") else "operators"
    parts: list = [f"{title}: decode at context {CONTEXT}, CUDA graphs off; {result.timer} per step, over "
                   f"{result.options.iters} steps"]
    for row in result.rows:
        parts.append(f"T={row.tokens} ({', '.join(row.methods)}): {row.ms_per_step:.3f} ms of {what} per step, "
                     f"{row.kernels_per_step} {what}")
        table = Table()
        for name in (what[:-1], "calls", "ms/step", "share"):
            table.add_column(name, justify="left" if name == what[:-1] else "right")
        for kernel in row.top:
            table.add_row(kernel.name[:100], f"{kernel.calls_per_step:g}", f"{kernel.ms_per_step:.3f}",
                          f"{kernel.share:.1%}")
        parts.append(table)
    return parts


def profile_document(result: ProfileResult, artifact: str, raw: dict[str, Any], flags: dict[str, Any]) -> dict:
    from pt2serve.bench.report import document_header

    return {**document_header("profile", artifact, raw, result.device, flags),
            "options": dataclasses.asdict(result.options), "context": CONTEXT, "num_cells": result.num_cells,
            "timer": result.timer, "rows": [row.to_dict() for row in result.rows]}


def _say(progress: Progress | None, text: str) -> None:
    if progress is not None:
        progress(text)
