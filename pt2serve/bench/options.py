"""What a benchmark run is asked to do, and the checks that turn bad flags into clear errors.

Both option sets are plain dataclasses so the benchmarks run the same from the CLI and from Python.
Every check raises Pt2ServeError with a message that says what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pt2serve.errors import Pt2ServeError

MODES = ("sweep", "requests", "quality", "profile", "matmuls", "startup")
WORKLOADS = ("random", "chat")
MAX_DEFAULT_TOKENS = 4096
DEFAULT_BACKLOG_PROMPT = 256
# Goodput's default latency targets: MLPerf Inference's server scenario for Llama 3.1 8B (loadgen/mlperf.conf):
# the first token within 2 s, then at least 10 tokens/s, which streams faster than people read.
DEFAULT_TTFT_TARGET_MS = 2000.0
DEFAULT_TPOT_TARGET_MS = 100.0


@dataclass(frozen=True)
class SweepOptions:
    """--mode sweep: one row per step width T (the runner's token budget)."""

    tokens: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to min(4096, the artifact's max_step_tokens)
    warmup: int = 3  # steady steps skipped before measuring
    iters: int = 10  # steady steps measured (the median is reported)
    decode_cap: int = 32  # decoding sequences in rows wider than the widest static forward size
    prefill_chunk: int | None = None  # backlog prompt length in wide rows; None: min(256, max_context - 1)
    # Prompt lengths of the decoding requests, the contexts decode rows run at (--context): every T is measured
    # at each, so one run gives decode at 512, 4,000 and 32,000 side by side.
    contexts: tuple[int, ...] = (8,)
    seed: int = 0
    row_timeout: float = 600.0  # seconds one row may take before it is stopped and flagged
    eager_peer: bool = True  # also time each row's middle step through the uncompiled model

    def check(self) -> None:
        if self.tokens is not None:
            if not self.tokens or any(not isinstance(t, int) or t < 1 for t in self.tokens):
                raise Pt2ServeError(f"--tokens must be positive integers, got {list(self.tokens)}")
        if self.warmup < 0:
            raise Pt2ServeError(f"--warmup must be at least 0, got {self.warmup}")
        if self.iters < 1:
            raise Pt2ServeError(f"--iters must be at least 1, got {self.iters}")
        if self.decode_cap < 1:
            raise Pt2ServeError(f"--decode-cap must be at least 1, got {self.decode_cap}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise Pt2ServeError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        if not self.contexts or any(not isinstance(c, int) or c < 1 for c in self.contexts):
            raise Pt2ServeError(f"--context must be positive integers, got {list(self.contexts)}")
        if self.row_timeout <= 0:
            raise Pt2ServeError(f"--timeout must be positive, got {self.row_timeout}")


@dataclass(frozen=True)
class LatencyTargets:
    """What a request must meet to count toward goodput."""

    ttft_ms: float = DEFAULT_TTFT_TARGET_MS
    tpot_ms: float = DEFAULT_TPOT_TARGET_MS

    def check(self) -> None:
        for flag, value in (("--ttft-target-ms", self.ttft_ms), ("--tpot-target-ms", self.tpot_ms)):
            if not (value > 0 and math.isfinite(value)):
                raise Pt2ServeError(f"{flag} must be a positive number of milliseconds, got {value}")


@dataclass(frozen=True)
class RequestsOptions:
    """--mode requests: N requests arriving on a fixed stagger or as a Poisson process; with the chat workload,
    N conversations arriving so, each turn sent when the last one ends."""

    requests: int = 32  # chat: conversations
    prompt_tokens: int = 128  # chat: tokens of each user message
    workload: str = "random"  # random token ids, or multi-turn chat sharing one system prompt (conversations.py)
    turns: int = 6  # chat: turns per conversation
    system_tokens: int = 1024  # chat: tokens of the system prompt every conversation starts with
    max_new_tokens: int = 64
    stagger_ms: float = 0.0  # fixed gap between arrivals
    request_rate: float | None = None  # requests/s, Poisson arrivals (exponential gaps drawn with `seed`)
    seed: int = 0
    # Which of the seed's prompt sets: each run of a rate sweep draws its own, so a server's prefix cache holds
    # none of a run's prompts from the run before (an in-process runner starts each run cold anyway).
    prompt_set: int = 0
    url: str | None = None  # drive a running server instead of an in-process runner
    model: str | None = None  # model name sent to the server (None: the first of GET /v1/models)
    timeout: float = 600.0  # seconds the whole run may take
    warmup_request: bool = True  # one short untimed request first
    targets: LatencyTargets = LatencyTargets()  # what counts toward goodput

    def check(self) -> None:
        if self.requests < 1:
            raise Pt2ServeError(f"--requests must be at least 1, got {self.requests}")
        if self.prompt_tokens < 1:
            raise Pt2ServeError(f"--prompt-tokens must be at least 1, got {self.prompt_tokens}")
        if self.workload not in WORKLOADS:
            raise Pt2ServeError(f"unknown --workload {self.workload!r}: choose {' or '.join(WORKLOADS)}")
        if self.turns < 1:
            raise Pt2ServeError(f"--turns must be at least 1, got {self.turns}")
        if self.system_tokens < 0:
            raise Pt2ServeError(f"--system-tokens must not be negative, got {self.system_tokens}")
        if self.max_new_tokens < 1:
            raise Pt2ServeError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.stagger_ms < 0 or not math.isfinite(self.stagger_ms):
            raise Pt2ServeError(f"--stagger-ms must be a finite number >= 0, got {self.stagger_ms}")
        if self.request_rate is not None and not (self.request_rate > 0 and math.isfinite(self.request_rate)):
            raise Pt2ServeError(f"--request-rate must be a positive number of requests/s, got {self.request_rate}")
        if self.timeout <= 0:
            raise Pt2ServeError(f"--timeout must be positive, got {self.timeout}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise Pt2ServeError(f"--url must start with http:// or https://, got {self.url!r}")
        self.targets.check()


def parse_tokens(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); anything but positive integers is an error."""
    return _parse_list(text, "--tokens", int, "integers", "1,2,4,8")


def parse_contexts(text: str) -> tuple[int, ...]:
    """'4000,16000' -> (4000, 16000); anything but positive integers is an error."""
    return _parse_list(text, "--context", int, "integers", "512,4000,16000")


def parse_rates(text: str) -> tuple[float, ...]:
    """'0.5,1,2' -> (0.5, 1.0, 2.0) requests/s; anything but positive finite numbers is an error."""
    return _parse_list(text, "--request-rates", float, "numbers", "1,2,4,8")


def _parse_list(text: str, flag: str, kind: type, what: str, example: str) -> tuple:
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise Pt2ServeError(f"{flag} is empty: give comma-separated positive {what}, e.g. {example}")
    values = []
    for part in parts:
        if not part:
            continue
        try:
            value = kind(part)
        except ValueError:
            raise Pt2ServeError(f"{flag} must be comma-separated positive {what}, got {part!r} in {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise Pt2ServeError(f"{flag} must be positive {what}, got {value}")
        values.append(value)
    return tuple(values)


def resolve_tokens(tokens: tuple[int, ...] | None, max_step_tokens: int) -> tuple[int, ...]:
    """The step widths to measure: the given ones (each within the artifact) or the default powers of two."""
    if tokens is None:
        limit = min(MAX_DEFAULT_TOKENS, max_step_tokens)
        return tuple(2 ** i for i in range(limit.bit_length()) if 2 ** i <= limit)
    too_wide = [t for t in tokens if t > max_step_tokens]
    if too_wide:
        raise Pt2ServeError(
            f"--tokens {too_wide} exceed the artifact's max_step_tokens ({max_step_tokens}); one step of the "
            "runner is at most that wide (re-export with a larger --max-step-tokens to measure wider steps)"
        )
    return tuple(dict.fromkeys(tokens))  # keep order, drop repeats
