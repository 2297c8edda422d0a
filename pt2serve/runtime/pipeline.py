"""One step in flight: the engine thread plans and launches step n+1, then waits for step n's ids and
commits them (detokenizes, checks stop strings, delivers events) while step n+1 runs on the device.

The device never waits for the host's per-step work; sampled ids are read one step late, so a request that
stops at step n still had a decode queued in step n+1, whose result is dropped. Verifying steps too: a
speculating request is planned into step n+1 while its verify in step n runs, for all of its drafts
accepted, and the executor moves it back by the rejected ones on the device (scheduler.py). A device
drafter's drafts go from its output into the step's inputs on the device; the host reads only what each
verify emits, a step late like any sample. A step with grammar-
constrained rows is launched unsampled and sampled once the step before it is committed, because its masks
follow the tokens committed so far. A step that fails on the device fails exactly its own requests.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pt2serve.runtime.drafter import DeviceDrafter
from pt2serve.runtime.events import Delivery
from pt2serve.runtime.executor import CallRecord, DeferredSampling, Executor, PendingStep, StepResult
from pt2serve.runtime.logprobs import TokenLogprob
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.scheduler import Scheduler, StepPlan

STEP_HISTORY = 100_000  # step records kept for inspection (tests, benchmarks)


@dataclass(frozen=True)
class StepRecord:
    step: int
    num_tokens: int
    num_decode: int
    calls: tuple[CallRecord, ...]
    seconds: float  # from launch to its ids on the host (with a step in flight, includes waiting for it)
    device_seconds: float | None  # its own time on the GPU (None on the CPU)
    ended: float = 0.0  # perf_counter when its ids reached the host: steps' intervals in a run


@dataclass(frozen=True)
class InFlight:
    plan: StepPlan
    pending: PendingStep | DeferredSampling
    launched: float  # perf_counter at launch

    @property
    def awaits_sampling(self) -> bool:
        """Launched unsampled: its grammar-constrained rows are sampled once the step before is committed."""
        return isinstance(self.pending, DeferredSampling)


class StepPipeline:
    """Launches, samples and commits the engine thread's steps; keeps the record of each."""

    def __init__(self, scheduler: Scheduler, executor: Executor, delivery: Delivery,
                 device_drafter: DeviceDrafter | None = None):
        self._scheduler = scheduler
        self._executor = executor
        self._delivery = delivery
        self._device_drafter = device_drafter  # drafts the verifying chunks as the executor launches them
        self.history: deque[StepRecord] = deque(maxlen=STEP_HISTORY)

    def launch(self) -> InFlight | None:
        """Plan the next step and queue it on the device; None when nothing could be scheduled."""
        plan = self._scheduler.plan()
        launched = None
        if plan.chunks:
            started = time.perf_counter()
            try:
                pending = self._executor.launch(self._scheduler.executor_chunks(plan), self._device_drafter)
                launched = InFlight(plan, pending, started)
            except Exception as err:  # a failing step fails its requests, not the engine
                self._fail(plan, err)
        return launched

    def sample_constrained(self, step: InFlight) -> InFlight | None:
        """Queue the sampling of a step with grammar-constrained rows, each masked by its matcher as it stands
        after every token committed so far (which is every token before this sample)."""
        chunks = step.plan.chunks

        def fill(index: int, bitmask, row: int) -> None:
            matcher = self._delivery.matcher(chunks[index].request_id)
            if matcher is not None:
                matcher.fill_row(bitmask, row)

        try:
            pending = step.pending.sample(fill)
        except Exception as err:
            self._fail(step.plan, err)
            return None
        return InFlight(step.plan, pending, step.launched)

    def complete(self, step: InFlight) -> None:
        """Wait for a launched step's ids, record it and commit them."""
        try:
            result = step.pending.result()
        except Exception as err:
            self._fail(step.plan, err)
            return
        ended = time.perf_counter()
        plan = step.plan
        self.history.append(StepRecord(plan.step, plan.num_tokens, plan.num_decode, result.calls,
                                       ended - step.launched, result.device_seconds, ended))
        logprobs = self._collect_logprobs(plan, result)
        for event in self._scheduler.commit(plan, result.tokens, result.verified):
            if event.request_id in self._delivery:  # (not when an earlier token of the same step ended it)
                self._delivery.on_token(event.request_id, event.token, event.finish_reason,
                                       logprobs.get(event.request_id))

    def _collect_logprobs(self, plan: StepPlan, result: StepResult) -> dict[int, TokenLogprob]:
        """Keep the step's scored prompt positions; return its sampled tokens' log probabilities by request."""
        sampled = {}
        for chunk, rows in zip(plan.chunks, result.prompt_logprobs):
            if rows:
                self._delivery.keep_prompt_logprobs(chunk.request_id, chunk.start, rows)
        for chunk, logprob in zip(plan.chunks, result.logprobs):
            if logprob is not None:
                sampled[chunk.request_id] = logprob
        return sampled

    def _fail(self, plan: StepPlan, err: Exception) -> None:
        """A step failed on the device: exactly its requests end with the error."""
        message = f"{type(err).__name__}: {err}"
        for request_id in self._scheduler.fail(plan, message):
            self._delivery.emit_final(request_id, FinishReason.ERROR, message)
