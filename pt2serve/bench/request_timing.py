"""What each request of --mode requests took, and what a run's requests add up to.

Every time is taken on the client side, with perf_counter, in seconds from the start of the run:
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

Below both drivers (in_process.py, http_client.py), which fill these in, and report.py, which reads them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pt2serve.bench.options import LatencyTargets, RequestsOptions
from pt2serve.bench.stats import summary


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
        # The prompt tokens computed (not reused) per second: with one output token each, the prefill rate.
        "prompt_tokens_per_second": (prompt_tokens - (cached or 0)) / duration if duration else None,
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
