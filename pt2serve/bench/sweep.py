"""--mode sweep: throughput at each step width T, measured where requests really enter, the runner.

For each T the runner gets token_budget = T and a workload that makes every steady step exactly T wide:
  - T <= the widest static forward size ("decode" rows): T requests with prompts of `context` tokens
    (short by default; long ones measure long-context decode), decoding together once their prefill is done
    (ignore_eos, max_new_tokens as large as the pool allows); every T is measured at each of the contexts
    asked for, the contexts outermost;
  - wider ("mixed" rows): `decode_cap` decoding requests plus a backlog of prompts (`prefill_chunk`
    tokens each, one output token) kept topped up, filling the rest of every step.
Each row's runner cuts prefill at any size (min_prefill_chunk = 1) so the backlog fills steps exactly.
The artifact loads once and one Executor (its KV pool and graphs) serves every row; each row has its own
Runner, and every request of a row is finished and the pool empty before the next row starts.

Per row, over `iters` steady steps after `warmup` (steady: all of the row's decoders decoding):
  executor time  = the median of each step's own time on the device (CUDA events around its queued work;
                   on the CPU, where launch runs the step, the launch's time);
  step interval  = the median time from one step's launch to the next one's (the runner keeps one step in
                   flight, so its own work, scheduling, packing, detokenizing and events, shows here only
                   where it takes longer than a step on the device);
  tok/s          = T / step interval (the headline);
  limit          = the step's physical limit on this machine (see roofline.py); "% of limit" = limit /
                   step interval;
  eager          = the peer: the middle measured step replayed through the uncompiled model on the same
                   weights and cells (see peer.py), the median of `iters` runs, next to the executor time.
Rows whose measured steps were not T wide (or had fewer decodes than planned, or too few steady steps)
are kept and flagged.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pt2serve.bench.options import DEFAULT_BACKLOG_PROMPT, SweepOptions, resolve_tokens
from pt2serve.bench.peer import EagerPeer
from pt2serve.bench.roofline import MachineLimits, ModelCost, measure_limits, step_cost
from pt2serve.bench.stats import median
from pt2serve.bench.timing import StepTiming, TimedExecutor
from pt2serve.contract import is_fp8
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.events import StreamEvent
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.pipeline import StepRecord
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.runner import Runner, RunnerConfig
from pt2serve.tokenizer import Tokenizer

Progress = Callable[[str], None]
PREFILL_BUDGET = 2048  # tokens per step while a decode row's prompts prefill


@dataclass(frozen=True)
class RowPlan:
    tokens: int  # T: the token budget, and the intended width of every steady step
    kind: str  # "decode" or "mixed"
    num_decode: int  # decoding requests
    prompt_tokens: int  # their prompt length
    max_new_tokens: int  # their output limit (they are cancelled once the row has its steps)
    backlog_prompt_tokens: int  # mixed rows: length of each backlog prompt (0 in decode rows)
    backlog_requests: int  # mixed rows: backlog prompts kept in flight


def plan_row(tokens: int, context: int, options: SweepOptions, meta_raw: dict[str, Any], capacity: int) -> RowPlan:
    """The workload for one row (decoders at `context`); raises Pt2ServeError when this artifact and pool cannot
    hold it."""
    widest = max(meta_raw["forward_sizes"])
    max_context = meta_raw["max_context"]
    prompt = context
    needed = options.warmup + options.iters + 2
    if prompt + needed > max_context:
        raise Pt2ServeError(
            f"--context {prompt} + {needed} generated tokens (warmup + iters + 2) exceed the artifact's max "
            f"context ({max_context}); lower --context, --warmup or --iters"
        )
    if tokens <= widest:
        kind, decoders, backlog_prompt, backlog = "decode", tokens, 0, 0
    else:
        kind = "mixed"
        decoders = min(options.decode_cap, tokens - 1)
        backlog_prompt = options.prefill_chunk or min(DEFAULT_BACKLOG_PROMPT, max_context - 1)
        if backlog_prompt + 1 > max_context:
            raise Pt2ServeError(
                f"--prefill-chunk {backlog_prompt} + 1 output token exceeds the artifact's max context ({max_context})"
            )
        fill = tokens - decoders
        # The scheduler serves the least recently served prompt first, so backlog prompts advance together
        # and end together; their replacements arrive a step later. Keep enough in flight that the fresh
        # ones alone fill a step while the rest finish: four steps' worth of prefill, plus a margin.
        backlog = -(-4 * fill // backlog_prompt) + 4
    free = capacity - backlog * backlog_prompt
    max_new = min(max_context - prompt, free // decoders - prompt) if free > 0 else 0
    if max_new < needed:
        raise Pt2ServeError(
            f"T={tokens}: the KV pool ({capacity} cells) cannot hold {decoders} decoding requests of "
            f"{prompt} + {needed} tokens" + (f" beside {backlog} backlog prompts of {backlog_prompt}" if backlog else "")
            + "; lower --iters/--warmup/--context" + (", --decode-cap or --prefill-chunk" if backlog else "")
            + " or give a larger pool (--num-cells)"
        )
    return RowPlan(tokens, kind, decoders, prompt, max_new, backlog_prompt, backlog)


@dataclass
class SweepRow:
    tokens: int
    kind: str
    num_decode: int
    backlog_prompt_tokens: int
    context: int  # the decoding requests' prompt length
    steps_recorded: int = 0
    steady_from: int | None = None  # index of the first step with all decoders decoding
    measured_steps: int = 0
    widths: list[int] = field(default_factory=list)  # width of each measured step
    decodes: list[int] = field(default_factory=list)  # decodes in each measured step
    methods: list[str] = field(default_factory=list)  # compiled methods the measured steps called
    width_ok: bool = False  # every measured step was exactly T wide, with the planned decodes
    executor_seconds: float | None = None  # median executor.step time
    interval_seconds: float | None = None  # median start-to-start time of consecutive steps
    tokens_per_second: float | None = None  # T / interval_seconds
    executor_tokens_per_second: float | None = None  # T / executor_seconds
    bytes: float | None = None  # median bytes a step must move
    flops: float | None = None  # median FLOPs of a step
    kv_bytes: float | None = None  # of `bytes`: the KV cells read and written
    attention_flops: float | None = None  # of `flops`: attention's
    memory_seconds: float | None = None  # bytes / measured bandwidth
    compute_seconds: float | None = None  # FLOPs / measured matrix throughput
    limit_seconds: float | None = None  # max of the two (median over the measured steps)
    bound: str | None = None  # "memory" or "compute"
    limit_tokens_per_second: float | None = None  # T / limit_seconds
    fraction_of_limit: float | None = None  # limit_seconds / interval_seconds
    executor_fraction_of_limit: float | None = None  # limit_seconds / executor_seconds
    eager_seconds: float | None = None  # the eager peer's time for the middle measured step
    speedup_over_eager: float | None = None  # eager_seconds / executor_seconds
    executor_step_seconds: list[float] = field(default_factory=list)
    interval_step_seconds: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    flags: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SweepResult:
    rows: list[SweepRow]
    limits: MachineLimits
    model_cost: ModelCost
    options: SweepOptions
    device: str
    num_cells: int
    seconds: float = 0.0


class _SteadyWatch:
    """Runs on the engine thread before each step: counts steps since all decoders first decoded."""

    def __init__(self, runner: Runner, num_decode: int, needed: int) -> None:
        self._runner = runner
        self._num_decode = num_decode
        self._needed = needed
        self._seen = 0
        self.steady_from: int | None = None
        self.done = threading.Event()

    @property
    def steady_steps(self) -> int:
        return 0 if self.steady_from is None else self._seen - self.steady_from

    def __call__(self) -> None:
        history = self._runner.step_history
        while self._seen < len(history):
            if self.steady_from is None and history[self._seen].num_decode >= self._num_decode:
                self.steady_from = self._seen
            self._seen += 1
        if self.steady_steps >= self._needed:
            self.done.set()


class _Backlog:
    """Keeps `count` one-token prompts in flight: each one that finishes is replaced (on the engine thread)."""

    def __init__(self, runner: Runner, count: int, prompts: list[list[int]]) -> None:
        self._runner = runner
        self._count = count
        self._prompts = prompts
        self._lock = threading.Lock()
        self._stopped = False
        self._next = 0
        self.submitted = 0
        self.errors: list[str] = []

    def start(self) -> None:
        for _ in range(self._count):
            self._submit()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    def _submit(self) -> None:
        with self._lock:
            if self._stopped:
                return
            prompt = self._prompts[self._next % len(self._prompts)]
            self._next += 1
            self.submitted += 1
        try:
            self._runner.submit(prompt, max_new_tokens=1, ignore_eos=True, on_event=self._on_event)
        except Pt2ServeError:
            pass  # the runner is shutting down

    def _on_event(self, event: StreamEvent) -> None:
        if event.finish_reason is None:
            return
        if event.finish_reason is FinishReason.ERROR:
            self.errors.append(event.error or "error")
        if event.finish_reason is not FinishReason.CANCELLED:
            self._submit()


def run_sweep(
    path: str | Path,
    options: SweepOptions = SweepOptions(),
    device: str | None = None,
    executor_config: ExecutorConfig = ExecutorConfig(),
    progress: Progress | None = None,
) -> SweepResult:
    """Load `path` once and measure every row (see the module docstring)."""
    from pt2serve.runtime.artifact import load_artifact, read_metadata
    from pt2serve.runtime.engine import artifact_tokenizer

    options.check()
    meta = read_metadata(path)
    for tokens, context in row_keys(options, meta.max_step_tokens):  # bad flags fail before loading
        plan_row(tokens, context, options, meta.raw, capacity=1 << 62)  # (the pool is checked once it exists)
    _say(progress, f"loading {path}")
    artifact = load_artifact(path, device=device)
    executor = Executor(artifact, executor_config)
    tokenizer = artifact_tokenizer(artifact.tokenizer_json, artifact.metadata.raw.get("tokenizer"))
    return sweep_executor(executor, tokenizer, options, progress)


def sweep_executor(
    executor: Executor, tokenizer: Tokenizer | None, options: SweepOptions = SweepOptions(),
    progress: Progress | None = None,
) -> SweepResult:
    """Measure every row on an already built executor (its pool must be empty)."""
    started = time.perf_counter()
    options.check()
    raw = executor.artifact.metadata.raw
    capacity = executor.allocator.capacity
    if executor.allocator.num_used:
        raise Pt2ServeError("the executor's KV pool is in use; sweep an idle executor")
    plans = [plan_row(t, c, options, raw, capacity) for t, c in row_keys(options, raw["max_step_tokens"])]
    _say(progress, f"measuring memory bandwidth and matrix throughput on {executor.device}")
    limits = measure_limits(executor.device, raw["dtype"], fp8_matmuls=is_fp8(raw))
    cost = ModelCost.from_metadata(raw)
    rng = np.random.default_rng(options.seed)
    peer = EagerPeer(executor) if options.eager_peer else None
    rows = []
    for index, plan in enumerate(plans):
        label = f"sweep {index + 1}/{len(plans)}: T={plan.tokens} ({plan.kind}, context {plan.prompt_tokens})"
        row_started = time.perf_counter()
        timed, history, flags = _run_row(executor, tokenizer, plan, options, rng, label, progress)
        row = _analyse(plan, timed.timings(), history, flags, options, cost, limits)
        if peer is not None and row.measured_steps:
            # The runner is closed and the pool idle: the peer may write the step's cells again.
            _say(progress, f"{label}: eager peer")
            middle = row.steady_from + options.warmup + row.measured_steps // 2
            row.eager_seconds = peer.step_seconds(timed.chunks(middle), options.iters)
            row.speedup_over_eager = row.eager_seconds / row.executor_seconds
        row.wall_seconds = time.perf_counter() - row_started
        rows.append(row)
    return SweepResult(rows, limits, cost, options, str(executor.device), executor.allocator.num_cells,
                       time.perf_counter() - started)


def row_keys(options: SweepOptions, max_step_tokens: int) -> list[tuple[int, int]]:
    """(T, context) of every row, in order: each context's widths together."""
    return [(t, c) for c in options.contexts for t in resolve_tokens(options.tokens, max_step_tokens)]


def _say(progress: Progress | None, text: str) -> None:
    if progress is not None:
        progress(text)


def _run_row(
    executor: Executor, tokenizer: Tokenizer | None, plan: RowPlan, options: SweepOptions,
    rng: np.random.Generator, label: str, progress: Progress | None,
) -> tuple[TimedExecutor, list[StepRecord], list[str]]:
    vocab = executor.artifact.metadata.vocab_size
    prompts = [rng.integers(0, vocab, plan.prompt_tokens).tolist() for _ in range(plan.num_decode)]
    backlog_prompts = [rng.integers(0, vocab, plan.backlog_prompt_tokens).tolist()
                       for _ in range(8 if plan.backlog_requests else 0)]
    timed = TimedExecutor(executor)
    # Decode rows prefill their prompts (long ones with --context) in wide steps; once only the decodes are
    # left, every step is exactly T wide. Mixed rows keep the budget at T so the backlog fills each step to T.
    budget = plan.tokens if plan.kind == "mixed" else max(plan.tokens, min(PREFILL_BUDGET, executor.max_step_tokens))
    # No prefix cache: the row's prompts must be computed in full for its steps to be T wide.
    config = RunnerConfig(token_budget=budget, max_decode_sequences=plan.num_decode, min_prefill_chunk=1,
                          prefix_cache=False)
    runner = Runner(timed, tokenizer, config)
    needed = options.warmup + options.iters + 1  # +1: the step after the last measured one ends its interval
    watch = _SteadyWatch(runner, plan.num_decode, needed)
    timed.before_step = watch
    flags: list[str] = []
    backlog = _Backlog(runner, plan.backlog_requests, backlog_prompts) if plan.backlog_requests else None
    handles = []
    try:
        handles = [runner.submit(p, max_new_tokens=plan.max_new_tokens, ignore_eos=True) for p in prompts]
        if backlog is not None:
            backlog.start()
        deadline = time.perf_counter() + options.row_timeout
        while not watch.done.wait(0.1):
            _say(progress, f"{label}: {timed.num_steps} steps, {watch.steady_steps}/{needed} steady")
            if all(h.is_finished for h in handles):
                break
            if time.perf_counter() > deadline:
                flags.append(f"timed out after {options.row_timeout:.0f} s")
                break
    finally:
        if backlog is not None:
            backlog.stop()
        runner.close()  # cancels whatever is still running and frees its cells
    _say(progress, f"{label}: done")
    errors = [h.result(timeout=0).error for h in handles if h.is_finished and h.result(timeout=0).error]
    if backlog is not None:
        errors += backlog.errors
    if errors:
        flags.append(f"steps failed: {errors[0]}")
    if not all(h.is_finished for h in handles) or executor.allocator.num_used:
        raise Pt2ServeError(
            f"T={plan.tokens}: the row left {executor.allocator.num_used} KV cells held after its runner closed"
        )
    return timed, list(runner.step_history), flags


def _analyse(
    plan: RowPlan, timings: list[StepTiming], history: list[StepRecord], flags: list[str],
    options: SweepOptions, cost: ModelCost, limits: MachineLimits,
) -> SweepRow:
    row = SweepRow(plan.tokens, plan.kind, plan.num_decode, plan.backlog_prompt_tokens, plan.prompt_tokens,
                   flags=list(flags))
    row.steps_recorded = len(timings)
    if len(history) != len(timings):
        row.flags.append(f"runner recorded {len(history)} steps, the executor wrapper {len(timings)}")
    count = min(len(history), len(timings))
    steady = next((i for i in range(count) if history[i].num_decode >= plan.num_decode), None)
    row.steady_from = steady
    if steady is None:
        row.flags.append(f"never reached {plan.num_decode} decodes in one step")
        return row
    first = steady + options.warmup
    window = list(range(first, min(first + options.iters, count - 1)))  # each needs the next step's start
    row.measured_steps = len(window)
    if len(window) < options.iters:
        row.flags.append(f"only {len(window)} of {options.iters} steady steps measured")
    if not window:
        return row
    row.widths = [timings[i].shape.width for i in window]
    row.decodes = [history[i].num_decode for i in window]
    row.methods = sorted({m for i in window for m in timings[i].methods})
    wrong_width = [w for w in row.widths if w != plan.tokens]
    wrong_decodes = [d for d in row.decodes if d != plan.num_decode]
    if wrong_width:
        row.flags.append(f"{len(wrong_width)} of {len(window)} steps not {plan.tokens} wide (e.g. {wrong_width[0]})")
    if wrong_decodes:
        row.flags.append(f"{len(wrong_decodes)} of {len(window)} steps without {plan.num_decode} decodes")
    row.width_ok = not wrong_width and not wrong_decodes
    row.executor_step_seconds = [timings[i].seconds for i in window]
    row.interval_step_seconds = [timings[i + 1].start - timings[i].start for i in window]
    costs = [step_cost(timings[i].shape, len(timings[i].methods), cost, limits) for i in window]
    row.executor_seconds = median(row.executor_step_seconds)
    row.interval_seconds = median(row.interval_step_seconds)
    row.tokens_per_second = plan.tokens / row.interval_seconds
    row.executor_tokens_per_second = plan.tokens / row.executor_seconds
    row.bytes = median(c.bytes for c in costs)
    row.flops = median(c.flops for c in costs)
    row.kv_bytes = median(c.kv_bytes for c in costs)
    row.attention_flops = median(c.attention_flops for c in costs)
    row.memory_seconds = median(c.memory_seconds for c in costs)
    row.compute_seconds = median(c.compute_seconds for c in costs)
    row.limit_seconds = median(c.limit_seconds for c in costs)
    row.bound = "memory" if row.memory_seconds >= row.compute_seconds else "compute"
    row.limit_tokens_per_second = plan.tokens / row.limit_seconds
    row.fraction_of_limit = row.limit_seconds / row.interval_seconds
    row.executor_fraction_of_limit = row.limit_seconds / row.executor_seconds
    return row
