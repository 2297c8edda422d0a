"""A Runner in a process of its own, driven through a pipe, for callers whose own Python is busy (a server).

Why: under load the engine thread needs about 137 us of CPU per generated token and a server's event loop about
100 us; in one process they share one interpreter lock, which then caps the tokens a second however fast the
device is. Here the engine process owns the artifact, the device and the Runner; the caller's process keeps only
the tokenizer, checks requests (request_checks.py) and reads events. `EngineProcess` has the Runner's caller
side (submit, cancel, stats, close, ...), so a server uses either the same way.

The pipe carries pickled tuples. To the engine: ("submit", id, spec, parent id), ("cancel", id),
("call", call id, name) and ("close",). Back: ("events", [event, ...]) once per engine turn (the events a step
made, sent when the engine is about to wait: RequestHandle's on_flush), ("reply", call id, value), and
("closed",) as the engine's last word. A request's final event carries its RequestStats. Grammars travel as
their GrammarSpec and are compiled again on the engine's side (xgrammar's compiled objects do not pickle).
"""

from __future__ import annotations

import gc
import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.events import Completion, RequestHandle, StreamEvent
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from pt2serve.runtime.request import FinishReason, RequestSpec, RequestStats
from pt2serve.runtime.request_checks import RequestChecks
from pt2serve.runtime.runner import Runner, RunnerConfig, RunnerStats
from pt2serve.runtime.sampling import SamplingParams

log = logging.getLogger("pt2serve.engine")

CALL_TIMEOUT_S = 30.0  # a stats or memory read the engine does not answer in this long is an error
CLOSE_TIMEOUT_S = 60.0  # then the engine process is killed


@dataclass(frozen=True)
class EngineInfo:
    """What the caller's side needs to know of the loaded engine."""

    vocab_size: int
    max_context: int
    pool_capacity: int
    max_sequence_tokens: int
    generation_defaults: dict[str, float]
    drafter: str | None  # the drafter's kind when the engine speculates
    num_draft_tokens: int
    description: str  # engine.describe_load's line
    torch_threads: int


class EngineProcess:
    """Start the engine process on `path` and wait until it is loaded (Pt2ServeError if loading fails)."""

    def __init__(self, path: str | Path, device: str | None = None, executor_config: ExecutorConfig = ExecutorConfig(),
                 runner_config: RunnerConfig = RunnerConfig(), threads: int | None = None):
        from pt2serve.runtime.engine import read_tokenizer

        # A fresh interpreter (CUDA cannot be forked into), started plainly rather than by multiprocessing's
        # spawn, which would run the caller's main script again in it; the pipe is a socket pair it inherits.
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "pt2serve.runtime.engine_child", str(theirs.fileno())]
        self._process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((str(path), device, executor_config, runner_config, threads))
        self.tokenizer = read_tokenizer(path)  # while the engine loads
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise Pt2ServeError(f"the engine process exited while loading (exit code {self._process.wait()})")
        if kind == "failed":
            self._process.wait()
            raise Pt2ServeError(payload)
        info: EngineInfo = payload
        self.info = info
        self.vocab_size = info.vocab_size
        self.max_context = info.max_context
        self.max_sequence_tokens = info.max_sequence_tokens
        self.generation_defaults = info.generation_defaults
        self.drafter = info.drafter
        self.num_draft_tokens = info.num_draft_tokens
        tokenizer = self.tokenizer
        self.grammars = GrammarCompiler.for_tokenizer(tokenizer, info.vocab_size)
        self.checks = RequestChecks(tokenizer, info.vocab_size, info.max_context, info.pool_capacity,
                                    info.drafter is not None, info.num_draft_tokens, self.grammars)
        self._ids = itertools.count(1)
        self._call_ids = itertools.count(1)
        self._lock = threading.Lock()  # the live handles, the calls waiting, the stopped state and the pipe's sends
        self._handles: dict[int, RequestHandle] = {}
        self._calls: dict[int, Future] = {}
        self._stopped: str | None = None  # why no request is taken any more
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="pt2serve-engine-events", daemon=True)
        self._reader.start()

    # -- the Runner's caller side ------------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        """Requests submitted and not yet finished (running plus queued)."""
        return len(self._handles)

    @property
    def stats(self) -> RunnerStats:
        return self._call("stats")

    def device_memory(self) -> dict[str, int] | None:
        return self._call("device_memory")

    def clear_prefix_cache(self) -> None:
        self._call("clear_prefix_cache")

    def describe(self) -> str:
        """The engine's load line (engine.describe_load)."""
        return self.info.description

    @property
    def pid(self) -> int:
        return self._process.pid

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
        """As Runner.submit: checked here, then queued in the engine process."""
        spec = self.checks.spec(prompt, max_new_tokens, sampling, stop_token_ids, stop_strings, session_id,
                                ignore_eos, logprobs, prompt_logprobs,
                                parent.prompt_ids if parent is not None else None, grammar, speculate)
        if spec.grammar is not None:  # compiled above (a bad one is refused at once); it travels as its spec
            spec = replace(spec, grammar=spec.grammar.spec)
        handle = RequestHandle(next(self._ids), list(spec.prompt_ids), on_event, on_flush)
        with self._lock:
            if self._stopped is not None:
                raise Pt2ServeError(self._stopped)
            self._handles[handle.id] = handle
            self._conn.send(("submit", handle.id, spec, parent.id if parent is not None else None))
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request; its cells are freed before the engine's next step."""
        with self._lock:
            if self._stopped is None:
                self._conn.send(("cancel", handle.id))

    def generate(self, prompt: str | list[int], **kwargs) -> Completion:
        """Submit and wait."""
        return self.submit(prompt, **kwargs).result()

    def close(self) -> None:
        """Cancel what runs, stop the engine and wait for its process to end."""
        with self._lock:
            if self._stopped is None:
                self._stopped = "the runner is shut down"
                self._conn.send(("close",))
        if not self._closed.wait(CLOSE_TIMEOUT_S):
            log.error("the engine process did not stop within %.0f s: killing it", CLOSE_TIMEOUT_S)
            self._process.kill()
        self._reader.join()
        self._process.wait()
        self._conn.close()

    # -- the reader thread -------------------------------------------------------------------------------

    def _call(self, name: str):
        """The engine's answer to a call by name (its Runner's method or property of that name)."""
        future: Future = Future()
        with self._lock:
            if self._stopped is not None:
                raise Pt2ServeError(self._stopped)
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            self._conn.send(("call", call_id, name))
        return future.result(timeout=CALL_TIMEOUT_S)

    def _read(self) -> None:
        """Deliver what the engine sends until it says it closed, or its pipe breaks."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._engine_lost()
                return
            kind = message[0]
            if kind == "events":
                self._deliver(message[1])
            elif kind == "reply":
                with self._lock:
                    future = self._calls.pop(message[1])
                future.set_result(message[2])
            elif kind == "closed":
                self._closed.set()
                return

    def _deliver(self, events: list[tuple]) -> None:
        """Hand a turn's events to their handles, then run each on_flush among them once (as Delivery does)."""
        flushes: dict[Callable[[], None], None] = {}
        for request_id, token_id, text, finish, error, logprob, prompt_logprobs, stats in events:
            handle = self._handles.get(request_id)
            if handle is None:
                continue
            finish_reason = FinishReason(finish) if finish is not None else None
            if finish_reason is not None:
                handle.stats = stats
                with self._lock:
                    del self._handles[request_id]
            if handle.on_flush is not None:
                flushes[handle.on_flush] = None
            try:
                handle.deliver(StreamEvent(token_id, text, finish_reason, error, logprob, prompt_logprobs))
            except Exception as err:  # a caller's callback that raises ends its own request, not the engine
                if finish_reason is None:
                    self.cancel(handle)
                    with self._lock:
                        del self._handles[request_id]
                    _fail(handle, f"the event callback raised {type(err).__name__}: {err}")
        for flush in flushes:
            flush()

    def _engine_lost(self) -> None:
        """The engine process is gone: every live request ends with an error, and none is taken any more."""
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = "none: it still runs, its pipe closed"
        why = f"the engine process exited (exit code {code})"
        with self._lock:
            if self._stopped is None:
                self._stopped = why
                log.error("%s: failing its %d requests", why, len(self._handles))
            handles, self._handles = list(self._handles.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            future.set_exception(Pt2ServeError(why))
        for handle in handles:
            _fail(handle, why)
        self._closed.set()


def _fail(handle: RequestHandle, error: str) -> None:
    """End a request on the caller's side with an error event (the engine no longer runs it)."""
    try:
        handle.deliver(StreamEvent(None, "", FinishReason.ERROR, error))
    except Exception:
        pass  # its callback fails; the handle's result() still has the error
    if handle.on_flush is not None:
        handle.on_flush()


# ------------------------------------------------------------------------------------------------ the engine


class _Outbox:
    """The engine thread's events, one message per turn (its on_flush), sent while the engine waits.

    `handles` maps the caller's request ids to the runner's handles; `lock` guards it and the pipe's sends (the
    command loop submits and answers calls on the pipe too)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.handles: dict[int, RequestHandle] = {}
        self._events: list[tuple] = []

    def on_event(self, request_id: int, event: StreamEvent) -> None:
        finish = event.finish_reason.value if event.finish_reason is not None else None
        stats = None
        if finish is not None:  # the last event: the request's stats go with it, and it is forgotten here
            with self.lock:  # held by the command loop until the handle is in `handles`
                handle = self.handles.pop(request_id, None)
            stats = handle.stats if handle is not None else RequestStats()
        self._events.append((request_id, event.token_id, event.text, finish, event.error, event.logprob,
                             event.prompt_logprobs, stats))

    def flush(self) -> None:
        events, self._events = self._events, []
        if events:
            self.send(("events", events))

    def send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)


def run_engine(conn: Connection) -> None:
    """The engine process: load what the pipe's first message names, say so, then run what the pipe asks until
    it says close (or breaks)."""
    import torch

    from pt2serve.runtime.engine import describe_load, open_runner

    # A terminal's Ctrl-C reaches the whole process group: the caller decides when the engine stops (it drains
    # first), and says so through the pipe, or by closing it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        path, device, executor_config, runner_config, threads = conn.recv()
    except (EOFError, OSError):
        return  # the caller went away before it said what to load
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        runner = open_runner(path, device, executor_config, runner_config)
    except Pt2ServeError as err:
        conn.send(("failed", str(err)))
        return
    except Exception as err:  # anything else that stops loading: said, not a traceback
        conn.send(("failed", f"loading the artifact failed: {type(err).__name__}: {err}"))
        return
    gc.collect()
    gc.freeze()  # what is loaded lives as long as the process: out of the collector's full scans
    conn.send(("ready", EngineInfo(
        runner.vocab_size, runner.max_context, runner.executor.allocator.capacity, runner.max_sequence_tokens,
        runner.generation_defaults, type(runner.drafter).__name__ if runner.drafter is not None else None,
        runner.num_draft_tokens, describe_load(runner), torch.get_num_threads())))
    outbox = _Outbox(conn)
    grammars: dict[GrammarSpec, CompiledGrammar] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the caller is gone
            break
        kind = message[0]
        if kind == "submit":
            _, request_id, spec, parent_id = message
            _submit(runner, outbox, grammars, request_id, spec, parent_id)
        elif kind == "cancel":
            handle = outbox.handles.get(message[1])
            if handle is not None:
                runner.cancel(handle)
        elif kind == "call":
            _, call_id, name = message
            value = getattr(runner, name)
            outbox.send(("reply", call_id, value() if callable(value) else value))
        elif kind == "close":
            break
    runner.close()  # the requests still live get their final events, which the outbox sends
    try:
        outbox.flush()
        outbox.send(("closed",))
    except (BrokenPipeError, OSError):
        pass  # nobody reads any more


def _submit(runner: Runner, outbox: _Outbox, grammars: dict[GrammarSpec, CompiledGrammar], request_id: int,
            spec: RequestSpec, parent_id: int | None) -> None:
    """Queue one checked request on the runner; a refusal becomes the request's final error event."""
    try:
        if spec.grammar is not None:
            if spec.grammar not in grammars:
                grammars[spec.grammar] = runner.grammars.compile(spec.grammar)
            spec = replace(spec, grammar=grammars[spec.grammar])
        parent = outbox.handles.get(parent_id) if parent_id is not None else None
        with outbox.lock:  # its final event waits for it to be in `handles`
            handle = runner.submit_spec(spec, on_event=lambda event: outbox.on_event(request_id, event),
                                        on_flush=outbox.flush, parent_id=parent.id if parent is not None else None)
            outbox.handles[request_id] = handle
    except Pt2ServeError as err:
        outbox.on_event(request_id, StreamEvent(None, "", FinishReason.ERROR, str(err)))
        outbox.flush()

