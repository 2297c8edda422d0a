"""The runner: one engine thread that owns the executor and scheduler, and handles that stream tokens.

Callers on any thread `submit()` requests and read events from the returned handle (or get them through
a callback, e.g. into an asyncio loop). Everything that touches the scheduler, cells or device runs on
the engine thread; other threads only enqueue commands.

A request may name a `parent` with the same prompt (the choices of an `n > 1` request): it is held until
the parent's prompt is computed (scheduled: stream order puts its K/V writes first), then starts from the
parent's cells for all its prompt but the last token, which it computes itself for its own first sample.

One step stays in flight: the engine plans and launches step n+1, then waits for step n's ids and commits
them (detokenizes, checks stop strings, delivers events) while step n+1 runs on the device. The device
never waits for the host's per-step work; sampled ids are read one step late, so a request that stops at
step n still had a decode queued in step n+1, whose result is dropped.

Speculation (RunnerConfig.speculate, or a drafter handed in): each eligible request verifies up to
num_draft_tokens drafted tokens per step (scheduler.py, verify.py); a step may then bring several tokens of
one request, delivered in order, up to the first that ends it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.dflash import DFlashDrafter
from pt2serve.runtime.drafter import Drafter, NgramDrafter, Speculation
from pt2serve.runtime.executor import CallRecord, DeferredSampling, Executor, PendingStep, StepResult
from pt2serve.runtime.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec, Matcher
from pt2serve.runtime.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from pt2serve.runtime.request import FinishReason, Request, RequestSpec, RequestStats
from pt2serve.runtime.sampling import RequestRandom, SamplingParams
from pt2serve.runtime.scheduler import Scheduler, SchedulerConfig, StepPlan
from pt2serve.runtime.stop import StopStringMatcher
from pt2serve.tokenizer import IncrementalDecoder, Tokenizer

STEP_HISTORY = 100_000  # step records kept for inspection (tests, benchmarks)


DEFAULT_TOKEN_BUDGET = 2048
DEFAULT_NUM_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class RunnerConfig:
    # Tokens per step. None: DEFAULT_TOKEN_BUDGET (or the artifact's max step tokens if fewer), so prompts
    # prefill in wide chunks on forward_others while every running decode still gets its token each step.
    token_budget: int | None = None
    max_decode_sequences: int | None = None  # decodes per step; None: the token budget (every running decode)
    min_prefill_chunk: int | None = None  # None: the artifact's
    # Every request starts from the longest cached prefix of its tokens; it costs a tree walk per prompt
    # and per prefill chunk, and nothing in the pool: cached cells are freed on demand.
    prefix_cache: bool = True
    max_sessions: int = 64  # sessions whose cached path is pinned against eviction
    session_pin_seconds: float = 600.0  # how long a pin lasts after the session's last request
    speculate: Speculation = Speculation.NONE
    # Drafts verified per step and request: each step of a speculating request runs 1 + this many tokens,
    # which must fit the artifact's widest static width (so the step still runs in a captured graph).
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    # Run the widest step this runner makes (the token budget, every decode sampled) once at start, so its
    # activations are held from then on: a step too wide for the memory fails at start with a message, not
    # under traffic, and device memory stays flat while serving (a wider step than any before grew it by
    # 96 MB in the middle of a soak of the 8B). None: on CUDA, where the caching allocator keeps what a step
    # used.
    reserve_widest_step: bool | None = None

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise Pt2ServeError(f"num_draft_tokens must be at least 1, got {self.num_draft_tokens}")


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


@dataclass(frozen=True)
class StepRecord:
    step: int
    num_tokens: int
    num_decode: int
    calls: tuple[CallRecord, ...]
    seconds: float  # from launch to its ids on the host (with a step in flight, includes waiting for it)
    device_seconds: float | None  # its own time on the GPU (None on the CPU)


@dataclass(frozen=True)
class _InFlight:
    plan: StepPlan
    pending: PendingStep | DeferredSampling
    launched: float  # perf_counter at launch


@dataclass
class RunnerStats:
    num_waiting: int = 0
    num_running: int = 0
    cells_used: int = 0
    cells_free: int = 0
    prefix_cache_cells: int = 0  # of cells_used: held only for reuse, freed on demand
    prefix_cache_hit_rate: float = 0.0  # share of the tokens looked up whose cells were reused
    num_steps: int = 0
    num_preemptions: int = 0
    cells_leaked: int = 0  # counted while idle: cells in use that nothing holds (always 0 unless a bug)
    # Speculation since start: drafted tokens verified, those accepted, and verifying steps (per request).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0


class RequestHandle:
    """A submitted request: iterate its events, or wait for the whole completion."""

    def __init__(self, request_id: int, prompt_ids: list[int], on_event: Callable[[StreamEvent], None] | None):
        self.id = request_id
        self.prompt_ids = prompt_ids
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        self._on_event = on_event
        self._done = threading.Event()
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: tuple[TokenLogprob, ...] | None = None
        self._finish: StreamEvent | None = None
        self.stats = RequestStats(prompt_tokens=len(prompt_ids))

    def _deliver(self, event: StreamEvent) -> None:
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
    emitted_text: list[str] = field(default_factory=list)
    # Scored prompt positions (a recomputed prompt scores them again, to the same values), until the first token.
    prompt_logprobs: dict[int, TokenLogprob] | None = None
    matcher: Matcher | None = None  # the request's place in its grammar, fed every committed token


class Runner:
    def __init__(self, executor: Executor, tokenizer: Tokenizer | None = None, config: RunnerConfig = RunnerConfig(),
                 drafter: Drafter | None = None):
        """`drafter`: where drafts come from (default: as config.speculate says; given, the runner speculates)."""
        meta = executor.artifact.metadata
        budget = config.token_budget or min(DEFAULT_TOKEN_BUDGET, meta.max_step_tokens)
        if drafter is None and config.speculate is Speculation.NGRAM:
            drafter = NgramDrafter()
        if drafter is None and config.speculate is Speculation.DFLASH:
            if executor.draft is None:
                raise Pt2ServeError("--speculate dflash needs an executor that runs the artifact's draft "
                                    "(ExecutorConfig(draft=True); open_runner sets it)")
            drafter = executor.draft
        if drafter is not None:
            _check_speculation(executor, config.num_draft_tokens, drafter)
        self.drafter = drafter
        self.num_draft_tokens = config.num_draft_tokens
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_context = meta.max_context
        self.grammars = GrammarCompiler(
            tokenizer.files.tokenizer_json if tokenizer is not None else None, meta.vocab_size,
            tokenizer.eos_token_ids if tokenizer is not None else ())
        # Sampling values the checkpoint's generation_config.json set, for requests that leave them out.
        self.generation_defaults: dict[str, float] = dict(meta.raw.get("generation_defaults") or {})
        self.vocab_size = meta.vocab_size
        self.scheduler = Scheduler(
            SchedulerConfig(
                token_budget=budget,
                max_decode_sequences=config.max_decode_sequences or budget,
                min_prefill_chunk=config.min_prefill_chunk or meta.min_prefill_chunk,
                max_context=meta.max_context,
                prefix_cache=config.prefix_cache,
                max_sessions=config.max_sessions,
                session_pin_seconds=config.session_pin_seconds,
                vocab_size=meta.vocab_size,
            ),
            executor.allocator,
            drafter,
        )
        reserve = executor.device.type == "cuda" if config.reserve_widest_step is None else config.reserve_widest_step
        max_decodes = self.scheduler.config.max_decode_sequences
        self.widest_step_bytes = executor.reserve_step(budget, min(budget, max_decodes)) if reserve else 0
        self.step_history: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        self.stats = RunnerStats(cells_free=executor.allocator.num_free)
        self._ids = itertools.count(1)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._live: dict[int, _Live] = {}
        self._held: dict[int, tuple[int, Request]] = {}  # request id -> (parent id, request) until it forks
        self._num_active = 0
        self._active_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._engine_loop, name="pt2serve-engine", daemon=True)
        self._thread.start()

    # -- caller side (any thread) ---------------------------------------------------------------------

    @property
    def max_sequence_tokens(self) -> int:
        """The most tokens (prompt + generated) one request may reach: the context, or the pool if smaller."""
        return min(self.max_context, self.executor.allocator.capacity)

    @property
    def num_active(self) -> int:
        """Requests submitted and not yet finished (running plus queued)."""
        return self._num_active

    def submit(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 16,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: tuple[int, ...] = (),
        stop_strings: tuple[str, ...] = (),
        session_id: str | None = None,
        ignore_eos: bool = False,
        on_event: Callable[[StreamEvent], None] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        parent: RequestHandle | None = None,
        grammar: GrammarSpec | CompiledGrammar | None = None,
        speculate: bool | None = None,
    ) -> RequestHandle:
        """Queue a request; raises Pt2ServeError for a request that can never run.

        `logprobs` / `prompt_logprobs`: score each sampled / prompt token, with that many alternatives.
        `parent`: a request submitted before with the same prompt, whose prompt cells this one shares.
        `grammar`: what the output must match (a spec is compiled here, on the caller's thread).
        `speculate`: None speculates when the runner does and the request allows it; True insists (refused
        where it cannot), False decodes plainly."""
        prompt_ids = self._prompt_ids(prompt)
        if parent is not None and parent.prompt_ids != prompt_ids:
            raise Pt2ServeError("a request shares its parent's cells only with the parent's prompt")
        if parent is not None and prompt_logprobs is not None:
            raise Pt2ServeError("a request that shares its parent's prompt does not compute it: ask the parent "
                                "for prompt_logprobs")
        if max_new_tokens < 1:
            raise Pt2ServeError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        for name, top in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                raise Pt2ServeError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        total = len(prompt_ids) + max_new_tokens
        if total > self.max_context:
            raise Pt2ServeError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"artifact's max context of {self.max_context} tokens"
            )
        if total > self.executor.allocator.capacity:
            raise Pt2ServeError(f"{total} tokens exceed the KV pool ({self.executor.allocator.capacity} cells)")
        stops = set(stop_token_ids)
        if self.tokenizer is not None and not ignore_eos:
            stops.update(self.tokenizer.eos_token_ids)
        excluded = _not_speculating_because(sampling, logprobs, prompt_logprobs, parent is not None,
                                            grammar is not None)
        if speculate and self.drafter is None:
            raise Pt2ServeError("this server does not speculate: start it with --speculate ngram or dflash")
        if speculate and excluded:
            raise Pt2ServeError(f"speculative decoding does not combine with {excluded}: leave it out, or do not "
                                "ask to speculate")
        speculates = self.drafter is not None and speculate is not False and not excluded
        compiled = self.grammars.compile(grammar) if isinstance(grammar, GrammarSpec) else grammar
        spec = RequestSpec(tuple(prompt_ids), max_new_tokens, sampling, frozenset(stops), tuple(stop_strings),
                           session_id, ignore_eos, logprobs, prompt_logprobs, compiled,
                           self.num_draft_tokens if speculates else 0)
        handle = RequestHandle(next(self._ids), prompt_ids, on_event)
        with self._active_lock:
            if self._stopping:
                raise Pt2ServeError("the runner is shut down")
            self._num_active += 1
        self._inbox.put(("submit", handle, spec, parent.id if parent is not None else None))
        self._wakeup.set()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request; its cells are freed before the next step."""
        self._inbox.put(("cancel", handle.id))
        self._wakeup.set()

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (cells that running requests use stay theirs); returns once done."""
        done = threading.Event()
        with self._active_lock:
            if self._stopping:
                raise Pt2ServeError("the runner is shut down")
            self._inbox.put(("clear_prefix_cache", done))
        self._wakeup.set()
        done.wait()

    def close(self) -> None:
        with self._active_lock:
            self._stopping = True
        self._wakeup.set()
        self._thread.join()

    def generate(self, prompt: str | list[int], **kwargs) -> Completion:
        """Submit and wait."""
        return self.submit(prompt, **kwargs).result()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise Pt2ServeError("this artifact has no tokenizer: send token ids, not text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise Pt2ServeError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise Pt2ServeError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return ids

    # -- engine thread ---------------------------------------------------------------------------------

    def _engine_loop(self) -> None:
        in_flight: _InFlight | None = None
        while True:
            self._drain_inbox()
            self._update_stats()
            if self._stopping:
                if in_flight is not None:
                    self._complete(in_flight)
                self._shutdown()
                return
            launched = self._launch_next() if self.scheduler.has_work() or self._held else None
            if in_flight is not None:
                self._complete(in_flight)  # while `launched` runs on the device
            elif launched is None:
                if self.scheduler.has_work():
                    time.sleep(0.001)  # nothing fits now (pool full of in-flight work); let commands arrive
                else:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
            if launched is not None and isinstance(launched.pending, DeferredSampling):
                launched = self._sample_constrained(launched)  # its masks follow the ids just committed
            in_flight = launched

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "submit":
                _, handle, spec, parent_id = command
                self._start(handle, spec, parent_id)
            elif command[0] == "clear_prefix_cache":
                self.scheduler.prefix_cache.clear()
                command[1].set()
            else:
                self._finish(command[1], FinishReason.CANCELLED)

    def _start(self, handle: RequestHandle, spec: RequestSpec, parent_id: int | None) -> None:
        request = Request(handle.id, spec, list(spec.prompt_ids), RequestRandom(spec.sampling.seed))
        request.stats = handle.stats
        decoder = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        self._live[handle.id] = _Live(handle, decoder, StopStringMatcher(spec.stop_strings),
                                      prompt_logprobs={} if spec.prompt_logprobs is not None else None,
                                      matcher=Matcher(spec.grammar) if spec.grammar is not None else None)
        if parent_id is not None and parent_id in self._live:
            self._held[handle.id] = (parent_id, request)
        else:
            self.scheduler.add(request)

    def _fork_held(self) -> None:
        """Start the held requests whose parent's prompt is computed (or whose parent is gone)."""
        for request_id, (parent_id, request) in list(self._held.items()):
            parent = self.scheduler.requests.get(parent_id)
            if parent is None:
                del self._held[request_id]
                self.scheduler.add(request)  # it computes its prompt itself
            elif parent.num_computed >= parent.num_prompt:
                del self._held[request_id]
                self.scheduler.fork(request, parent)

    def _launch_next(self) -> _InFlight | None:
        """Plan the next step and queue it on the device; None when nothing could be scheduled."""
        plan = self.scheduler.plan()
        launched = None
        if plan.chunks:
            started = time.perf_counter()
            try:
                launched = _InFlight(plan, self.executor.launch(self.scheduler.executor_chunks(plan)), started)
            except Exception as err:  # a failing step fails its requests, not the engine
                self._fail_step(plan, err)
        if self._held:  # after the launch: a parent whose prompt step failed is gone, not forked from
            self._fork_held()
        return launched

    def _sample_constrained(self, step: _InFlight) -> _InFlight | None:
        """Queue the sampling of a step with grammar-constrained rows, each masked by its matcher as it stands
        after every token committed so far (which is every token before this sample)."""
        chunks = step.plan.chunks

        def fill(index: int, bitmask, row: int) -> None:
            live = self._live.get(chunks[index].request_id)
            if live is not None and live.matcher is not None:
                live.matcher.fill_row(bitmask, row)

        try:
            pending = step.pending.sample(fill)
        except Exception as err:
            self._fail_step(step.plan, err)
            return None
        return _InFlight(step.plan, pending, step.launched)

    def _complete(self, step: _InFlight) -> None:
        """Wait for a launched step's ids, record it and commit them."""
        try:
            result = step.pending.result()
        except Exception as err:
            self._fail_step(step.plan, err)
            return
        seconds = time.perf_counter() - step.launched
        plan = step.plan
        self.step_history.append(
            StepRecord(plan.step, plan.num_tokens, plan.num_decode, result.calls, seconds, result.device_seconds)
        )
        logprobs = self._collect_logprobs(plan, result)
        for event in self.scheduler.commit(plan, result.tokens, result.verified):
            if event.request_id in self._live:  # (not when an earlier token of the same step ended it)
                self._on_token(event.request_id, event.token, event.finish_reason, logprobs.get(event.request_id))

    def _collect_logprobs(self, plan: StepPlan, result: StepResult) -> dict[int, TokenLogprob]:
        """Keep the step's scored prompt positions; return its sampled tokens' log probabilities by request."""
        sampled = {}
        for chunk, rows in zip(plan.chunks, result.prompt_logprobs):
            live = self._live.get(chunk.request_id)
            if rows and live is not None and live.prompt_logprobs is not None:
                live.prompt_logprobs.update((chunk.start + k, row) for k, row in enumerate(rows))
        for chunk, logprob in zip(plan.chunks, result.logprobs):
            if logprob is not None:
                sampled[chunk.request_id] = logprob
        return sampled

    def _fail_step(self, plan: StepPlan, err: Exception) -> None:
        """A step failed on the device: exactly its requests end with the error."""
        message = f"{type(err).__name__}: {err}"
        for request_id in self.scheduler.fail(plan, message):
            self._emit_final(request_id, FinishReason.ERROR, message)

    def _on_token(self, request_id: int, token: int, finish_reason: FinishReason | None,
                  logprob: TokenLogprob | None = None) -> None:
        live = self._live[request_id]
        if live.matcher is not None:
            if not live.matcher.accept_token(token):
                self._fail_request(request_id, token, f"token {token} does not follow the request's grammar")
                return
            if live.matcher.is_terminated() and finish_reason is None:  # the output is complete
                self.scheduler.finish(request_id, FinishReason.STOP)
                finish_reason = FinishReason.STOP
        try:
            text, hit_stop = self._text(live, token, is_final=finish_reason is not None)
        except Exception as err:  # a failing tokenizer fails its own request, not the engine
            self._fail_request(request_id, token, f"detokenizing failed: {type(err).__name__}: {err}")
            return
        if hit_stop and finish_reason is None:
            self.scheduler.finish(request_id, FinishReason.STOP)
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

    def _finish(self, request_id: int, reason: FinishReason, error: str | None = None) -> None:
        if self._held.pop(request_id, None) is not None or self.scheduler.finish(request_id, reason) is not None:
            self._emit_final(request_id, reason, error)

    def _emit_final(self, request_id: int, reason: FinishReason, error: str | None) -> None:
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
        self.scheduler.finish(request_id, FinishReason.ERROR)  # a no-op when it already finished
        if request_id in self._live:
            self._deliver(request_id, StreamEvent(token, "", FinishReason.ERROR, error))

    def _deliver(self, request_id: int, event: StreamEvent) -> None:
        live = self._live[request_id]
        if event.finish_reason is not None:
            del self._live[request_id]
            self.executor.logits_processor.release(request_id)
            with self._active_lock:
                self._num_active -= 1
        try:
            live.handle._deliver(event)
        except Exception as err:  # a caller's callback that raises ends its own request, not the engine
            if event.finish_reason is None:
                self._fail_request(request_id, None, f"the event callback raised {type(err).__name__}: {err}")

    def _update_stats(self) -> None:
        allocator = self.scheduler.allocator
        self.stats = RunnerStats(
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            cells_used=allocator.num_used,
            cells_free=allocator.num_free,
            prefix_cache_cells=self.scheduler.prefix_cache.num_cells,
            prefix_cache_hit_rate=self.scheduler.prefix_cache.hit_rate,
            num_steps=self.scheduler.step,
            num_preemptions=self.scheduler.num_preemptions,
            cells_leaked=self.stats.cells_leaked if self.scheduler.has_work() else self.scheduler.num_leaked_cells(),
            draft_tokens=self.scheduler.num_draft_tokens,
            accepted_tokens=self.scheduler.num_accepted_tokens,
            verify_steps=self.scheduler.num_verify_steps,
        )

    def _shutdown(self) -> None:
        for request_id in list(self._live):
            self._finish(request_id, FinishReason.CANCELLED)
        self.scheduler.prefix_cache.clear()  # the pool is left empty for whoever uses the executor next
        self._update_stats()


def _check_speculation(executor: Executor, num_draft_tokens: int, drafter: Drafter) -> None:
    """Refuse speculation the artifact cannot run, saying what to change."""
    meta = executor.artifact.metadata
    if not executor.can_verify:
        raise Pt2ServeError("this artifact has no acceptance methods (it was exported before speculative decoding): "
                            "re-export it, or serve it without --speculate")
    if isinstance(drafter, DFlashDrafter) and num_draft_tokens > drafter.block_size - 1:
        raise Pt2ServeError(f"--num-draft-tokens {num_draft_tokens} exceeds what the DFlash draft proposes per "
                            f"block (block_size - 1 = {drafter.block_size - 1}): use at most {drafter.block_size - 1}")
    widest = max(meta.forward_sizes)
    if num_draft_tokens + 1 > widest:
        raise Pt2ServeError(f"--num-draft-tokens {num_draft_tokens} makes steps of {num_draft_tokens + 1} tokens per "
                            f"sequence, wider than the artifact's widest static width ({widest}): use at most "
                            f"{widest - 1}")


def _not_speculating_because(sampling: SamplingParams, logprobs: int | None, prompt_logprobs: int | None,
                             has_parent: bool, has_grammar: bool) -> str | None:
    """What keeps a request from speculating, in words (None: nothing). Their logits or tokens need per-token
    host or device work that verified steps do not do."""
    reasons = [name for name, applies in (
        ("structured output", has_grammar),
        ("logprobs", logprobs is not None or prompt_logprobs is not None),
        ("penalties or logit_bias", sampling.has_penalties or bool(sampling.logit_bias)),
        ("min_tokens", sampling.min_tokens > 0),
        ("n > 1", has_parent),
    ) if applies]
    return ", ".join(reasons) or None
