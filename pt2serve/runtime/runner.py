"""The runner: one engine thread that owns the executor and scheduler, and handles that stream tokens.

Callers on any thread `submit()` requests and read events from the returned handle (or get them through
a callback, e.g. into an asyncio loop). Everything that touches the scheduler, cells or device runs on
the engine thread; other threads only enqueue commands. The engine keeps one step in flight (pipeline.py)
and turns each committed token into its request's event (events.py).

A request may name a `parent` with the same prompt (the choices of an `n > 1` request): it is held until
the parent's prompt is computed (scheduled: stream order puts its K/V writes first), then starts from the
parent's cells for all its prompt but the last token, which it computes itself for its own first sample.

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
from dataclasses import dataclass
from typing import Callable

import torch

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.dflash import DFlashDrafter
from pt2serve.runtime.drafter import DeviceDrafter, Drafter, NgramDrafter, Speculation, drafts_on_host
from pt2serve.runtime.events import Completion, Delivery, RequestHandle, StreamEvent
from pt2serve.runtime.executor import Executor
from pt2serve.runtime.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from pt2serve.runtime.pipeline import InFlight, StepPipeline, StepRecord
from pt2serve.runtime.request import FinishReason, Request, RequestSpec
from pt2serve.runtime.request_checks import RequestChecks
from pt2serve.runtime.sampling import RequestRandom, SamplingParams
from pt2serve.runtime.scheduler import Scheduler, SchedulerConfig
from pt2serve.tokenizer import IncrementalDecoder, Tokenizer

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


class Runner:
    def __init__(self, executor: Executor, tokenizer: Tokenizer | None = None, config: RunnerConfig = RunnerConfig(),
                 drafter: Drafter | DeviceDrafter | None = None):
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
        self.grammars = GrammarCompiler.for_tokenizer(tokenizer, meta.vocab_size)
        self.checks = RequestChecks(tokenizer, meta.vocab_size, meta.max_context, executor.allocator.capacity,
                                    drafter is not None, config.num_draft_tokens, self.grammars)
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
        self.stats = RunnerStats(cells_free=executor.allocator.num_free)
        self._ids = itertools.count(1)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._delivery = Delivery(self.scheduler, self._on_finished)
        self._pipeline = StepPipeline(self.scheduler, executor, self._delivery,
                                      drafter if drafter is not None and not drafts_on_host(drafter) else None)
        # On CUDA a launch queues the step and returns; the engine waits in the next step's result(). On the
        # CPU a launch computes the step (with the GIL released), so there it waits in the launch.
        self._launch_is_async = executor.device.type == "cuda"
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
    def step_history(self) -> deque[StepRecord]:
        """The records of the last steps (pipeline.STEP_HISTORY of them), for tests and benchmarks."""
        return self._pipeline.history

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
        on_flush: Callable[[], None] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        parent: RequestHandle | None = None,
        grammar: GrammarSpec | CompiledGrammar | None = None,
        speculate: bool | None = None,
    ) -> RequestHandle:
        """Queue a request; raises Pt2ServeError for a request that can never run.

        `on_event` / `on_flush`: see RequestHandle.
        `logprobs` / `prompt_logprobs`: score each sampled / prompt token, with that many alternatives.
        `parent`: a request submitted before with the same prompt, whose prompt cells this one shares.
        `grammar`: what the output must match (a spec is compiled here, on the caller's thread).
        `speculate`: None speculates when the runner does and the request allows it; True insists (refused
        where it cannot), False decodes plainly."""
        spec = self.checks.spec(prompt, max_new_tokens, sampling, stop_token_ids, stop_strings, session_id,
                                ignore_eos, logprobs, prompt_logprobs,
                                parent.prompt_ids if parent is not None else None, grammar, speculate)
        return self.submit_spec(spec, on_event, on_flush, parent.id if parent is not None else None)

    def submit_spec(self, spec: RequestSpec, on_event: Callable[[StreamEvent], None] | None = None,
                    on_flush: Callable[[], None] | None = None, parent_id: int | None = None) -> RequestHandle:
        """Queue a request `self.checks` made (submit's work once its arguments are checked)."""
        handle = RequestHandle(next(self._ids), list(spec.prompt_ids), on_event, on_flush)
        with self._active_lock:
            if self._stopping:
                raise Pt2ServeError("the runner is shut down")
            self._num_active += 1
        self._inbox.put(("submit", handle, spec, parent_id))
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

    def device_memory(self) -> dict[str, int] | None:
        """Bytes torch's caching allocator holds on the runner's GPU (allocated, reserved, peak_reserved);
        None on the CPU."""
        device = self.executor.device
        if device.type != "cuda":
            return None
        return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
                "peak_reserved": torch.cuda.max_memory_reserved(device)}

    def generate(self, prompt: str | list[int], **kwargs) -> Completion:
        """Submit and wait."""
        return self.submit(prompt, **kwargs).result()

    # -- engine thread ---------------------------------------------------------------------------------

    def _engine_loop(self) -> None:
        in_flight: InFlight | None = None
        while True:
            self._drain_inbox()
            self._update_stats()
            if self._stopping:
                if in_flight is not None:
                    self._pipeline.complete(in_flight)
                self._shutdown()
                self._delivery.flush()
                return
            launched = None
            if self.scheduler.has_work() or self._held:
                if not self._launch_is_async:
                    self._delivery.flush()  # the launch computes the step: the engine waits in it
                launched = self._launch_next()
            self._delivery.flush()  # the events of the step committed last, as the engine waits (Delivery.flush)
            if in_flight is not None:
                self._pipeline.complete(in_flight)  # while `launched` runs on the device
            elif launched is None:
                if self.scheduler.has_work():
                    time.sleep(0.001)  # nothing fits now (pool full of in-flight work); let commands arrive
                else:
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
            if launched is not None and launched.awaits_sampling:
                launched = self._pipeline.sample_constrained(launched)  # its masks follow the ids just committed
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
        self._delivery.add(handle, spec, decoder)
        if parent_id is not None and parent_id in self._delivery:
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

    def _launch_next(self) -> InFlight | None:
        """Plan and launch the next step (None when nothing could be scheduled), then fork what it allows."""
        launched = self._pipeline.launch()
        if self._held:  # after the launch: a parent whose prompt step failed is gone, not forked from
            self._fork_held()
        return launched

    def _finish(self, request_id: int, reason: FinishReason, error: str | None = None) -> None:
        if self._held.pop(request_id, None) is not None or self.scheduler.finish(request_id, reason) is not None:
            self._delivery.emit_final(request_id, reason, error)

    def _on_finished(self, request_id: int) -> None:
        """A request's final event is made: release its sampling state; it no longer counts as active."""
        self.executor.logits_processor.release(request_id)
        with self._active_lock:
            self._num_active -= 1

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
        for request_id in self._delivery.request_ids():
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

