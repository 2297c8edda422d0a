"""A thin decorator around an Executor that records each step's start, end and shape.

The runner calls `step(chunks)` exactly as on the executor; the wrapper times the call with
perf_counter (no device synchronisation of its own: a step already ends with a host sync when it brings
its sampled tokens back) and keeps the chunk list for later analysis, so the timed path does no extra work.
Everything else (artifact, allocator, ...) is the wrapped executor's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from pt2serve.runtime.executor import Executor, StepResult
from pt2serve.runtime.step import Chunk


@dataclass(frozen=True)
class StepShape:
    """What one step computed, from its chunks (each chunk: tokens start..end-1 of one sequence)."""

    width: int  # tokens in the step
    num_chunks: int  # sequences in the step
    num_sampled: int  # sequences whose next token was sampled (logit rows needed)
    context_cells: int  # sum over sequences of start + tokens: earlier cells read plus new cells written
    attention_pairs: int  # sum over tokens of the context each attends to (query-key pairs)

    @classmethod
    def of(cls, chunks: list[Chunk]) -> "StepShape":
        width = context = pairs = sampled = 0
        for chunk in chunks:
            n, start = len(chunk.tokens), chunk.start
            width += n
            context += start + n
            pairs += n * start + n * (n + 1) // 2
            sampled += chunk.sampling is not None
        return cls(width, len(chunks), sampled, context, pairs)


@dataclass(frozen=True)
class StepTiming:
    start: float  # perf_counter before executor.step
    end: float  # perf_counter after it returned
    shape: StepShape
    methods: tuple[str, ...]  # the compiled methods the step called

    @property
    def seconds(self) -> float:
        return self.end - self.start


class TimedExecutor:
    """Wraps `executor.step`; pass it to Runner in place of the executor."""

    def __init__(self, executor: Executor, before_step: Callable[[], None] | None = None) -> None:
        self._executor = executor
        self.before_step = before_step  # called on the engine thread before each step (outside the timing)
        self._raw: list[tuple[float, float, list[Chunk], StepResult]] = []

    def __getattr__(self, name: str):
        return getattr(self._executor, name)

    def step(self, chunks: list[Chunk]) -> StepResult:
        if self.before_step is not None:
            self.before_step()
        started = time.perf_counter()
        result = self._executor.step(chunks)
        ended = time.perf_counter()
        self._raw.append((started, ended, chunks, result))
        return result

    @property
    def num_steps(self) -> int:
        return len(self._raw)

    def chunks(self, index: int) -> list[Chunk]:
        """The chunks of step `index`, as the runner passed them."""
        return self._raw[index][2]

    def timings(self) -> list[StepTiming]:
        """Every completed step, analysed now (after the run, off the timed path)."""
        return [
            StepTiming(start, end, StepShape.of(chunks), tuple(call.method for call in result.calls))
            for start, end, chunks, result in list(self._raw)
        ]
