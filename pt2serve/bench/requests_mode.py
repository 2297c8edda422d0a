"""--mode requests: N requests arriving over time; aggregate throughput and per-request latency.

Arrivals: request i is submitted at i x stagger, or (with a request rate R) at the times of a Poisson
process: exponential gaps of mean 1/R drawn from a seeded generator, the first at 0.

Metrics (every time is taken on the client side, with perf_counter):
  TTFT  = first token time - submit time
  TPOT  = (end - first token time) / (n - 1), for requests with n >= 2 output tokens
  E2E   = end - submit time            (end: when the request's last token arrived)
  output tok/s = all output tokens / (last end - first submit)
  goodput = requests that met both latency targets (TTFT <= its target, and TPOT <= its target where a
            request has a TPOT) / (last end - first submit)
  prompt tokens reused = those whose KV cells came from the prefix cache (usage.prompt_tokens_details.
            cached_tokens); computed = the rest
Each latency is reported as p50 / p90 / p99 (linear interpolation) with mean, min and max in the JSON.
The chat workload (conversations.py) also reports TTFT of first turns and of later turns apart.

In-process, requests go straight to a Runner (ignore_eos, so each produces max_new_tokens tokens) and
their tokens are timed in the runner's event callback; the runner's step history gives the steps taken
and their mean width. With a URL (see http_client.py) they go to a running server's OpenAI completions
API instead. Either way one short untimed request runs first.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from pt2serve.bench.options import LatencyTargets, RequestsOptions
from pt2serve.bench.stats import summary
from pt2serve.errors import Pt2ServeError

Progress = Callable[[str], None]


@dataclass
class RequestTiming:
    """One request; times are seconds from the start of the run."""

    index: int
    arrival: float  # scheduled submit time
    prompt_tokens: int
    submit: float | None = None
    first_token: float | None = None
    end: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens reused from the prefix cache (None: not reported)
    finish_reason: str | None = None
    error: str | None = None
    conversation: int | None = None  # chat workload: which conversation, and its turn (from 0)
    turn: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None or self.submit is None else self.first_token - self.submit

    @property
    def e2e(self) -> float | None:
        return None if self.end is None or self.submit is None else self.end - self.submit

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    def meets(self, targets: LatencyTargets) -> bool:
        """Completed within both targets (a one-token answer has no TPOT to miss)."""
        if self.error is not None or self.end is None or self.ttft is None:
            return False
        tpot = self.tpot
        return self.ttft * 1e3 <= targets.ttft_ms and (tpot is None or tpot * 1e3 <= targets.tpot_ms)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}


@dataclass
class RequestsResult:
    target: str  # "in-process" or the server URL
    options: RequestsOptions
    requests: list[RequestTiming]
    device: str | None = None
    num_steps: int | None = None  # in-process: runner steps taken
    mean_step_width: float | None = None  # in-process: tokens per step, averaged over those steps
    step_budget: dict[str, int] | None = None  # in-process: the scheduler's token budget, decode cap, min chunk
    num_cells: int | None = None  # in-process: the KV pool's size in cells (with the scratch cell)
    summary: dict[str, Any] = field(default_factory=dict)
    speculation: dict[str, Any] | None = None  # in-process, when the runner speculates: see speculation_summary


def speculation_summary(draft_tokens: int, accepted_tokens: int, verify_steps: int) -> dict[str, Any]:
    """What speculation did over a run: drafts verified and accepted, and the accepted drafts per verifying step
    (each such step emits those plus one token for its sequence)."""
    return {
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted_tokens,
        "verify_steps": verify_steps,
        "acceptance_rate": accepted_tokens / draft_tokens if draft_tokens else None,
        "accepted_per_step": accepted_tokens / verify_steps if verify_steps else None,
    }


def arrival_times(options: RequestsOptions) -> list[float]:
    if options.request_rate is not None:
        rng = np.random.default_rng(options.seed)
        gaps = rng.exponential(1.0 / options.request_rate, options.requests)
        gaps[0] = 0.0
        return np.cumsum(gaps).tolist()
    return [i * options.stagger_ms / 1e3 for i in range(options.requests)]


def make_prompts(options: RequestsOptions, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(options.seed + 1)
    return [rng.integers(0, vocab_size, options.prompt_tokens).tolist() for _ in range(options.requests)]


def summarise(requests: list[RequestTiming], targets: LatencyTargets = LatencyTargets()) -> dict[str, Any]:
    done = [r for r in requests if r.error is None and r.end is not None]
    submits = [r.submit for r in requests if r.submit is not None]
    ends = [r.end for r in done]
    tokens = sum(r.output_tokens for r in done)
    duration = (max(ends) - min(submits)) if ends and submits else None
    good = sum(r.meets(targets) for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    reported = [r.cached_tokens for r in done if r.cached_tokens is not None]
    cached = sum(reported) if reported else None
    turns = {}
    if any(r.turn is not None for r in requests):
        turns = {"ttft_first_turns_seconds": summary(r.ttft for r in done if r.turn == 0),
                 "ttft_later_turns_seconds": summary(r.ttft for r in done if r.turn)}
    return {
        "requests": len(requests),
        "completed": len(done),
        "failed": len(requests) - len(done),
        "output_tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_reused": cached,
        "prompt_tokens_computed": None if cached is None else prompt_tokens - cached,
        "duration_seconds": duration,
        "output_tokens_per_second": tokens / duration if duration else None,
        "requests_per_second": len(done) / duration if duration else None,
        "goodput": {
            "ttft_target_ms": targets.ttft_ms,
            "tpot_target_ms": targets.tpot_ms,
            "good_requests": good,
            "good_fraction": good / len(requests) if requests else None,
            "requests_per_second": good / duration if duration else None,
        },
        "ttft_seconds": summary(r.ttft for r in done),
        "tpot_seconds": summary(r.tpot for r in done),
        "e2e_seconds": summary(r.e2e for r in done),
        **turns,
    }


def run_requests(
    path: str | Path | None,
    options: RequestsOptions = RequestsOptions(),
    device: str | None = None,
    executor_config=None,
    runner_config=None,
    progress: Progress | None = None,
) -> RequestsResult:
    """In-process on the artifact at `path`, or against `options.url` (then `path` is optional)."""
    with open_target(path, options, device, executor_config, runner_config, progress) as drive:
        return drive(options, progress)


Drive = Callable[[RequestsOptions, Progress | None], RequestsResult]  # one workload, one result


@contextmanager
def open_target(
    path: str | Path | None,
    options: RequestsOptions,
    device: str | None = None,
    executor_config=None,
    runner_config=None,
    progress: Progress | None = None,
) -> Iterator[Drive]:
    """A function that runs one workload: on a Runner loaded once (closed on exit), or against options.url."""
    from pt2serve.runtime.artifact import read_metadata
    from pt2serve.runtime.engine import read_tokenizer

    options.check()
    meta = read_metadata(path).raw if path is not None else None
    if meta is not None:
        _check_lengths(options, meta["max_context"])
    if options.url is not None:
        from pt2serve.bench.http_client import drive_server

        vocab_size = meta["vocab_size"] if meta else None
        tokenizer = read_tokenizer(path) if path is not None else None  # sizes chat text in tokens
        yield lambda run_options, run_progress: drive_server(run_options, vocab_size, tokenizer, run_progress)
        return
    if path is None:
        raise Pt2ServeError("give an artifact to run in-process, or --url to drive a running server")
    from pt2serve.runtime.engine import open_runner
    from pt2serve.runtime.executor import ExecutorConfig
    from pt2serve.runtime.runner import RunnerConfig

    if progress is not None:
        progress(f"loading {path}")
    runner = open_runner(path, device, executor_config or ExecutorConfig(), runner_config or RunnerConfig())
    try:
        yield lambda run_options, run_progress: drive_runner(runner, run_options, run_progress)
    finally:
        runner.close()


def _check_lengths(options: RequestsOptions, max_context: int) -> None:
    if options.workload == "chat":
        total = options.system_tokens + options.turns * (options.prompt_tokens + options.max_new_tokens)
        if total > max_context:
            raise Pt2ServeError(
                f"--system-tokens {options.system_tokens} + --turns {options.turns} x (--prompt-tokens "
                f"{options.prompt_tokens} + --max-new-tokens {options.max_new_tokens}) = {total} exceeds the "
                f"artifact's max context ({max_context}), before the chat template adds its own"
            )
        return
    total = options.prompt_tokens + options.max_new_tokens
    if total > max_context:
        raise Pt2ServeError(
            f"--prompt-tokens {options.prompt_tokens} + --max-new-tokens {options.max_new_tokens} = {total} exceeds "
            f"the artifact's max context ({max_context})"
        )


def drive_runner(runner, options: RequestsOptions, progress: Progress | None = None) -> RequestsResult:
    """Run the requests on an open Runner (left open)."""
    options.check()
    _check_lengths(options, runner.max_context)
    if options.warmup_request:
        runner.generate([runner.vocab_size - 1] * 8, max_new_tokens=2, ignore_eos=True)
    runner.clear_prefix_cache()  # each run starts cold: what it reuses, it computed itself
    steps_before = runner.scheduler.step  # steps numbered after this one are the workload's
    scheduler = runner.scheduler
    drafts_before = (scheduler.num_draft_tokens, scheduler.num_accepted_tokens, scheduler.num_verify_steps)
    if options.workload == "chat":
        from pt2serve.bench.conversations import drive_runner_conversations

        timings = drive_runner_conversations(runner, options, progress)
    else:
        timings = _drive_runner_random(runner, options, progress)
    widths = [record.num_tokens for record in list(runner.step_history) if record.step > steps_before]
    budget = runner.scheduler.config
    result = RequestsResult(
        "in-process", options, timings, str(runner.executor.device), num_steps=len(widths),
        mean_step_width=sum(widths) / len(widths) if widths else None,
        step_budget={"token_budget": budget.token_budget, "max_decode_sequences": budget.max_decode_sequences,
                     "min_prefill_chunk": budget.min_prefill_chunk},
        num_cells=runner.executor.memory.num_cells,
    )
    result.summary = summarise(timings, options.targets)
    if runner.drafter is not None:
        drafts_after = (scheduler.num_draft_tokens, scheduler.num_accepted_tokens, scheduler.num_verify_steps)
        result.speculation = speculation_summary(*(a - b for a, b in zip(drafts_after, drafts_before)))
    return result


def event_timer(timing: RequestTiming, origin: float, on_end: Callable[[], None]) -> Callable:
    """A runner event callback (called on the engine thread) that times `timing`'s tokens and calls
    `on_end` once the request has ended."""
    def on_event(event) -> None:
        now = time.perf_counter() - origin
        if event.token_id is not None:
            timing.output_tokens += 1
            if timing.first_token is None:
                timing.first_token = now
        if event.finish_reason is not None:
            timing.end = now
            timing.finish_reason = event.finish_reason.value
            timing.error = event.error
            on_end()
    return on_event


def _drive_runner_random(runner, options: RequestsOptions, progress: Progress | None) -> list[RequestTiming]:
    prompts = make_prompts(options, runner.vocab_size)
    timings = [RequestTiming(i, t, options.prompt_tokens) for i, t in enumerate(arrival_times(options))]
    finished = [threading.Event() for _ in timings]
    origin = time.perf_counter()
    deadline = origin + options.timeout
    handles = {}
    for timing, prompt, done in zip(timings, prompts, finished):
        while (wait := origin + timing.arrival - time.perf_counter()) > 0:
            time.sleep(min(wait, 0.1))
            _report(progress, timings, finished)
        timing.submit = time.perf_counter() - origin
        try:
            handles[timing.index] = runner.submit(prompt, max_new_tokens=options.max_new_tokens, ignore_eos=True,
                                                  on_event=event_timer(timing, origin, done.set))
        except Pt2ServeError as err:
            timing.error = str(err)
            done.set()
    while not all(done.wait(0) for done in finished):
        if time.perf_counter() > deadline:
            raise Pt2ServeError(f"the requests did not finish within --timeout {options.timeout:.0f} s")
        _report(progress, timings, finished)
        time.sleep(0.1)
    for index, handle in handles.items():
        timings[index].cached_tokens = handle.stats.reused_tokens
    return timings


def _report(progress: Progress | None, timings: list[RequestTiming], finished: list[threading.Event]) -> None:
    if progress is None:
        return
    submitted = sum(t.submit is not None for t in timings)
    done = sum(e.is_set() for e in finished)
    tokens = sum(t.output_tokens for t in timings)
    progress(f"requests: {submitted}/{len(timings)} submitted, {done} finished, {tokens} tokens out")
