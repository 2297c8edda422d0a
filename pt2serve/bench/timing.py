"""A thin decorator around an Executor that records each step's launch, end, own time and shape.

The runner calls `launch(chunks)` and later `result()` exactly as on the executor; the wrapper notes the
times with perf_counter (no device synchronisation of its own) and keeps the chunk list for later analysis,
so the timed path does no extra work. A step's own time is its time on the GPU (CUDA events the executor
records around its queued work); on the CPU, where launch runs the step, the launch's time.
Everything else (artifact, allocator, ...) is the wrapped executor's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from pt2serve.runtime.drafter import DeviceDrafter
from pt2serve.runtime.executor import Executor, PendingStep, StepResult
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
    start: float  # perf_counter before executor.launch
    end: float  # perf_counter when its ids were on the host
    shape: StepShape
    methods: tuple[str, ...]  # the compiled methods the step called
    seconds: float  # the step's own time: on the GPU (CUDA events), or on the CPU the launch (which runs it)


class TimedExecutor:
    """Wraps `executor.launch` (and so `step`); pass it to Runner in place of the executor."""

    def __init__(self, executor: Executor, before_step: Callable[[], None] | None = None) -> None:
        self._executor = executor
        self.before_step = before_step  # called on the engine thread before each step (outside the timing)
        self._raw: list[tuple[float, float, float, list[Chunk], StepResult]] = []

    def __getattr__(self, name: str):
        return getattr(self._executor, name)

    def launch(self, chunks: list[Chunk], drafter: DeviceDrafter | None = None) -> "_TimedPending":
        if self.before_step is not None:
            self.before_step()
        started = time.perf_counter()
        pending = self._executor.launch(chunks, drafter)
        return _TimedPending(self._raw, started, time.perf_counter(), chunks, pending)

    def step(self, chunks: list[Chunk]) -> StepResult:
        return self.launch(chunks).result()

    @property
    def num_steps(self) -> int:
        return len(self._raw)

    def chunks(self, index: int) -> list[Chunk]:
        """The chunks of step `index`, as the runner passed them."""
        return self._raw[index][3]

    def timings(self) -> list[StepTiming]:
        """Every completed step, analysed now (after the run, off the timed path)."""
        return [
            StepTiming(start, end, StepShape.of(chunks), tuple(call.method for call in result.calls),
                       result.device_seconds if result.device_seconds is not None else launched - start)
            for start, launched, end, chunks, result in list(self._raw)
        ]


class _TimedPending:
    """A launched step that records its timing when its ids are read."""

    def __init__(self, raw: list, started: float, launched: float, chunks: list[Chunk], pending: PendingStep) -> None:
        self._raw, self._started, self._launched, self._chunks, self._pending = raw, started, launched, chunks, pending

    def result(self) -> StepResult:
        result = self._pending.result()
        self._raw.append((self._started, self._launched, time.perf_counter(), self._chunks, result))
        return result
