"""A request's events: what the engine thread makes of its committed tokens, and the handle a caller reads
them from.

The engine thread (runner.py) hands every committed token to `Delivery`, which keeps each live request's
decoder, stop strings, grammar matcher and scored prompt positions, and turns the token into one
`StreamEvent`: its text, whether a stop string or the grammar ended the request, its logprobs. The event
goes to the request's `RequestHandle`, which queues it for the caller's thread or passes it to the caller's
callback. A request's own failure (its tokenizer, its callback, a token its grammar refuses) ends that
request alone, never the engine.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from pt2serve.runtime.grammar import Matcher
from pt2serve.runtime.logprobs import TokenLogprob
from pt2serve.runtime.request import FinishReason, RequestSpec, RequestStats
from pt2serve.runtime.scheduler import Scheduler
from pt2serve.runtime.stop import StopStringMatcher
from pt2serve.tokenizer import IncrementalDecoder


@dataclass(frozen=True)
class StreamEvent:
    token_id: int | None  # None on a final event that carries no token (cancel, error)
    text: str  # the detokenized text this event adds ("" without a tokenizer)
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprob: TokenLogprob | None = None  # the token's, when the request asked for logprobs
    # On the first token of a request that asked for prompt logprobs: the prompt's tokens after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class RequestHandle:
    """A submitted request: iterate its events, or wait for the whole completion.

    `on_event` gets each event on the engine thread as it is made; `on_flush`, when given, runs on the engine
    thread once the events made since it last ran are all delivered and the engine is about to wait (for the
    device, or for work), once per turn however many requests share it; it must not raise. A caller that hands
    events to another thread queues them in on_event and wakes that thread in on_flush: one wake-up per step,
    not one per event, at a moment the engine does not need the GIL (see Delivery.flush).
    """

    def __init__(self, request_id: int, prompt_ids: list[int], on_event: Callable[[StreamEvent], None] | None,
                 on_flush: Callable[[], None] | None = None):
        self.id = request_id
        self.prompt_ids = prompt_ids
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        self._on_event = on_event
        self.on_flush = on_flush
        self._done = threading.Event()
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: tuple[TokenLogprob, ...] | None = None
        self._finish: StreamEvent | None = None
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))

    def deliver(self, event: StreamEvent) -> None:
        """Take the request's next event (its engine calls this; the last carries the finish reason)."""
        if event.logprob is not None:
            self._logprobs.append(event.logprob)
        if event.prompt_logprobs is not None:
            self._prompt_logprobs = event.prompt_logprobs
        if event.token_id is not None:
            self._token_ids.append(event.token_id)
        self._text.append(event.text)
        if event.finish_reason is not None:
            self._finish = event
            self._done.set()
        if self._on_event is not None:
            self._on_event(event)
        else:
            self._events.put(event)

    @property
    def is_finished(self) -> bool:
        return self._done.is_set()

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Events as they come, ending with the one that carries the finish reason."""
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if event.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        assert self._finish is not None
        return Completion(list(self._token_ids), "".join(self._text), self._finish.finish_reason,
                          self.stats, self._finish.error, list(self._logprobs) if self._logprobs else None,
                          self._prompt_logprobs)


@dataclass
class _Live:
    """Engine-thread bookkeeping for one request."""

    handle: RequestHandle
    decoder: IncrementalDecoder | None
    stops: StopStringMatcher
    # Scored prompt positions (a recomputed prompt scores them again, to the same values), until the first token.
    prompt_logprobs: dict[int, TokenLogprob] | None = None
    matcher: Matcher | None = None  # the request's place in its grammar, fed every committed token


class Delivery:
    """The engine thread's side of every live request's events; only the engine thread calls it.

    `on_finished(request_id)` runs when a request's final event is made, before the caller sees it.
    """

    def __init__(self, scheduler: Scheduler, on_finished: Callable[[int], None]):
        self._scheduler = scheduler
        self._on_finished = on_finished
        self._live: dict[int, _Live] = {}
        self._flushes: dict[Callable[[], None], None] = {}  # the on_flush of each handle given events since flush()

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._live

    def request_ids(self) -> list[int]:
        return list(self._live)

    def add(self, handle: RequestHandle, spec: RequestSpec, decoder: IncrementalDecoder | None) -> None:
        """Start delivering a submitted request's events (`decoder`: None without a tokenizer)."""
        self._live[handle.id] = _Live(handle, decoder, StopStringMatcher(spec.stop_strings),
                                      prompt_logprobs={} if spec.prompt_logprobs is not None else None,
                                      matcher=Matcher(spec.grammar) if spec.grammar is not None else None)

    def matcher(self, request_id: int) -> Matcher | None:
        """The live request's place in its grammar (None without one, or once it has ended)."""
        live = self._live.get(request_id)
        return live.matcher if live is not None else None

    def keep_prompt_logprobs(self, request_id: int, start: int, rows: tuple[TokenLogprob, ...]) -> None:
        """Keep the scored prompt positions start, start + 1, ... until the request's first token carries them."""
        live = self._live.get(request_id)
        if live is not None and live.prompt_logprobs is not None:
            live.prompt_logprobs.update((start + k, row) for k, row in enumerate(rows))

    def on_token(self, request_id: int, token: int, finish_reason: FinishReason | None,
                 logprob: TokenLogprob | None = None) -> None:
        """Deliver a committed token's event; its grammar or a stop string may end the request with it."""
        live = self._live[request_id]
        if live.matcher is not None:
            if not live.matcher.accept_token(token):
                self._fail_request(request_id, token, f"token {token} does not follow the request's grammar")
                return
            if live.matcher.is_terminated() and finish_reason is None:  # the output is complete
                self._scheduler.finish(request_id, FinishReason.STOP)
                finish_reason = FinishReason.STOP
        try:
            text, hit_stop = self._text(live, token, is_final=finish_reason is not None)
        except Exception as err:  # a failing tokenizer fails its own request, not the engine
            self._fail_request(request_id, token, f"detokenizing failed: {type(err).__name__}: {err}")
            return
        if hit_stop and finish_reason is None:
            self._scheduler.finish(request_id, FinishReason.STOP)
        if hit_stop:  # also when the token that ends the request by length completes a stop string
            finish_reason = FinishReason.STOP
        prompt_logprobs = None
        if live.prompt_logprobs is not None:  # the first token: every prompt position is scored by now
            scored = live.prompt_logprobs
            prompt_logprobs = tuple(scored[p] for p in range(len(live.handle.prompt_ids) - 1))
            live.prompt_logprobs = None
        self._deliver(request_id, StreamEvent(token, text, finish_reason, None, logprob, prompt_logprobs))

    @staticmethod
    def _text(live: _Live, token: int | None, is_final: bool) -> tuple[str, bool]:
        """The text a token adds (at the end, with all that was held back) and whether a stop string hit."""
        text = ""
        if live.decoder is not None:
            if token is not None:
                text = live.decoder.push(token)
            if is_final:
                text += live.decoder.flush()
        return live.stops.feed(text, is_final)

    def emit_final(self, request_id: int, reason: FinishReason, error: str | None) -> None:
        """Deliver the final event of a request that ends without a token, with any text held back."""
        live = self._live.get(request_id)
        if live is None:
            return
        try:
            text, _ = self._text(live, None, is_final=True)
        except Exception as err:
            self._fail_request(request_id, None, f"detokenizing failed: {type(err).__name__}: {err}")
            return
        self._deliver(request_id, StreamEvent(None, text, reason, error))

    def _fail_request(self, request_id: int, token: int | None, error: str) -> None:
        """End one request with an error that is its own (its tokenizer or callback failed)."""
        self._scheduler.finish(request_id, FinishReason.ERROR)  # a no-op when it already finished
        if request_id in self._live:
            self._deliver(request_id, StreamEvent(token, "", FinishReason.ERROR, error))

    def flush(self) -> None:
        """Run the on_flush of every handle given events since the last flush, each callable once.

        The runner calls it right before it waits. A step's events, which the engine made while committing
        it, then reach another thread (the server's event loop) in one batch while the engine blocks on the
        device with the GIL released. Woken at a step's first event instead, that thread took the GIL in the
        middle of the engine's commit and next launch, and the engine, which paces the device, waited for it
        to let go (as long as sys.getswitchinterval(), 5 ms, when it did not block first).
        """
        flushes, self._flushes = self._flushes, {}
        for flush in flushes:
            flush()

    def _deliver(self, request_id: int, event: StreamEvent) -> None:
        live = self._live[request_id]
        if event.finish_reason is not None:
            del self._live[request_id]
            self._on_finished(request_id)
        if live.handle.on_flush is not None:
            self._flushes[live.handle.on_flush] = None
        try:
            live.handle.deliver(event)
        except Exception as err:  # a caller's callback that raises ends its own request, not the engine
            if event.finish_reason is None:
                self._fail_request(request_id, None, f"the event callback raised {type(err).__name__}: {err}")
