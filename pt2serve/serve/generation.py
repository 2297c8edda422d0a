"""One request in flight, seen from the event loop: the runner's engine-thread events bridged into asyncio.

The runner calls back on its engine thread; events are handed to the loop through one EventBridge, a step's
at once, where each is counted (timings, metrics) and queued for whoever streams or collects the response.
Metrics are recorded here, not by the reader, so a request whose client went away is still accounted for.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Callable

from pt2serve.runtime.events import RequestHandle, StreamEvent
from pt2serve.runtime.logprobs import TokenLogprob
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.runner import Runner
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.serve.metrics import ServerMetrics
from pt2serve.serve.openai_format import SpeculationUsage, Usage

log = logging.getLogger("pt2serve.serve")


class EventBridge:
    """Engine-thread calls into the event loop, one wake-up per engine turn. call_soon only queues; flush,
    which the runner calls once a step's events are all made and it is about to wait (RequestHandle's
    on_flush), wakes the loop for all of them. Waking it per event (call_soon_threadsafe writes to its
    self-pipe) cost the engine thread a system call and the loop a turn per event, and woken at a step's
    first event the loop took the GIL while the engine was still committing that step and launching the
    next, which then waited for it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable, tuple]] = []
        self._woken = False  # a wake-up is queued on the loop and has not run yet

    def call_soon(self, callback: Callable, *args) -> None:
        """From any thread: queue callback(*args) to run on the loop, in call order, at the next flush."""
        with self._lock:
            self._pending.append((callback, args))

    def flush(self) -> None:
        """From any thread: wake the loop to run what is queued (once, however often it is called before)."""
        with self._lock:
            if self._woken or not self._pending:
                return
            self._woken = True
        try:
            self._loop.call_soon_threadsafe(self._run_pending)
        except RuntimeError:
            pass  # the loop is closed: the server is gone and nobody waits for these

    def _run_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._woken = False
        for callback, args in pending:
            try:
                callback(*args)
            except Exception:  # as the loop's own callbacks: logged, and the others still run
                log.exception("an engine event's callback failed")


class Generation:
    def __init__(self, runner: Runner, metrics: ServerMetrics, bridge: EventBridge, arrived: float,
                 prompt_index: int = 0, shares_prompt_of: Generation | None = None) -> None:
        self.prompt_index = prompt_index  # which prompt of its request it answers
        self.shares_prompt_of = shares_prompt_of  # another choice of the same prompt: its cells are shared
        self._runner = runner
        self._metrics = metrics
        self._bridge = bridge
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue()  # None: a keep-alive is due
        self._last_event_at = time.perf_counter()
        self._keep_alive_timer: asyncio.TimerHandle | None = None
        self._arrived = arrived  # time.perf_counter() when the request came in
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._cancel_sent = False
        self.handle: RequestHandle | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # each token's, when asked for
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # the prompt's after its first, when asked for
        self.text_parts: list[str] = []
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.done: asyncio.Future[None] = self._loop.create_future()

    def start(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams, stop: tuple[str, ...],
              stop_token_ids: tuple[int, ...], session_id: str | None, ignore_eos: bool,
              logprobs: int | None = None, prompt_logprobs: int | None = None, grammar=None,
              speculate: bool | None = None) -> None:
        """Submit to the runner; raises Pt2ServeError for a request it refuses."""
        self.handle = self._runner.submit(
            prompt_ids, max_new_tokens=max_tokens, sampling=sampling, stop_token_ids=stop_token_ids,
            stop_strings=stop, session_id=session_id, ignore_eos=ignore_eos, on_event=self._from_engine,
            on_flush=self._bridge.flush,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            parent=self.shares_prompt_of.handle if self.shares_prompt_of is not None else None, grammar=grammar,
            speculate=speculate,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def usage(self) -> Usage:
        assert self.handle is not None
        stats = self.handle.stats
        speculation = None
        if self._runner.drafter is not None:
            speculation = SpeculationUsage(stats.draft_tokens, stats.accepted_tokens, stats.verify_steps)
        return Usage(len(self.handle.prompt_ids), len(self.token_ids), stats.reused_tokens, speculation)

    async def event_batches(self, idle_s: float | None = None) -> AsyncIterator[list[StreamEvent]]:
        """Events as they come, all those waiting at once in one batch; the last ends with the finish event.

        With `idle_s`, an empty batch whenever that long passes without an event (a queued or preempted
        request): a stream sends a keep-alive then, so clients' read timeouts do not end it. One timer per
        stream watches for that, re-armed each idle_s: nothing is added to the wait for each event.
        """
        if idle_s is not None:
            self._keep_alive_timer = self._loop.call_later(idle_s, self._keep_alive, idle_s)
        try:
            while True:
                first = await self._queue.get()
                if first is None:
                    yield []
                    continue
                batch = [first]
                while batch[-1].finish_reason is None and not self._queue.empty():
                    event = self._queue.get_nowait()
                    if event is not None:  # a keep-alive overtaken by events: nothing to send
                        batch.append(event)
                yield batch
                if batch[-1].finish_reason is not None:
                    return
        finally:
            if self._keep_alive_timer is not None:
                self._keep_alive_timer.cancel()

    def _keep_alive(self, idle_s: float) -> None:
        """Queue a keep-alive (None) if no event came for idle_s, and look again when the next one would be due."""
        if self.finished:
            return
        quiet = time.perf_counter() - self._last_event_at
        if quiet >= idle_s:
            self._queue.put_nowait(None)
            self._last_event_at, quiet = time.perf_counter(), 0.0
        self._keep_alive_timer = self._loop.call_later(idle_s - quiet, self._keep_alive, idle_s)

    def cancel(self) -> None:
        """Stop the request if it still runs (its cells are freed by the engine before its next step)."""
        if self.handle is not None and not self.finished and not self._cancel_sent:
            self._cancel_sent = True
            self._runner.cancel(self.handle)

    # -- engine thread -> loop ---------------------------------------------------------------------------

    def _from_engine(self, event: StreamEvent) -> None:
        self._bridge.call_soon(self._on_event, event)

    def _on_event(self, event: StreamEvent) -> None:
        now = time.perf_counter()
        self._last_event_at = now
        if event.logprob is not None:
            self.logprobs.append(event.logprob)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
            if self._first_token_at is None:
                self._first_token_at = now
            self._last_token_at = now
        self.text_parts.append(event.text)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason
            self.error = event.error
            if event.error is not None:
                log.error("request %s failed: %s", self.handle.id if self.handle else "?", event.error)
            self._record()
            if not self.done.done():
                self.done.set_result(None)
        self._queue.put_nowait(event)

    def _record(self) -> None:
        assert self.handle is not None and self.finish_reason is not None
        ttft = tpot = None
        if self._first_token_at is not None:
            ttft = self._first_token_at - self._arrived
            if len(self.token_ids) > 1:
                tpot = (self._last_token_at - self._first_token_at) / (len(self.token_ids) - 1)
        usage = self.usage()
        self._metrics.request_finished(self.finish_reason.value, usage.prompt_tokens, usage.cached_tokens,
                                       usage.completion_tokens, ttft, tpot)
