"""What a soak runs and the bounds it holds the server to."""

from __future__ import annotations

from dataclasses import dataclass

from pt2serve.errors import Pt2ServeError


@dataclass(frozen=True)
class SoakOptions:
    url: str  # the server's root, e.g. http://127.0.0.1:8000
    duration_s: float = 60.0
    seed: int = 0
    concurrency: int = 16  # clients running scenarios at once (a burst adds more for a moment)
    max_queued: int | None = None  # the server's --max-queued: bursts go past it; None: bursts of 2 x concurrency
    api_key: str | None = None
    designed: str | None = None  # the designed preset the server serves: greedy requests return its designed ids
    warmup_s: float = 5.0  # memory baselines are read after this much traffic
    request_timeout_s: float = 120.0  # the client's wait for each read
    scenario_timeout_s: float = 300.0  # a scenario's whole time (a kept-alive stream can outlast any read timeout)
    drain_timeout_s: float = 60.0  # after the traffic: how long the server may take to go idle
    health_interval_s: float = 0.25
    max_health_latency_s: float = 5.0  # a /health slower than this counts as not answered
    max_rss_growth_mb: float = 256.0  # host RSS over its post-warm-up level, at any sample
    max_device_growth_mb: float = 64.0  # reserved device memory over its post-warm-up level
    min_requests: int = 0  # fewer requests sent than this fails the run
    expect_preemption: bool = False  # the pool is small enough that requests must have been preempted
    sampled_replays: int = 32  # seeded sampled answers asked again alone after the load (replay.py)
    # The share of the replays that must come back the same. 1: an artifact exported with --deterministic, or
    # fp32 on the CPU; a bf16 artifact without it computes a row's logits differently by its step's width and
    # company, and a near-tie can flip a draw.
    min_sampled_agreement: float = 1.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise Pt2ServeError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.duration_s <= 0 or self.concurrency < 1:
            raise Pt2ServeError("--duration must be positive and --concurrency at least 1")
        if not 0 <= self.warmup_s < self.duration_s:
            raise Pt2ServeError(f"--warmup ({self.warmup_s} s) must be shorter than --duration ({self.duration_s} s)")
        if self.sampled_replays < 0 or not 0 <= self.min_sampled_agreement <= 1:
            raise Pt2ServeError("--sampled-replays must be at least 0 and --min-sampled-agreement in [0, 1]")
        if self.max_queued is not None and self.max_queued < 1:
            raise Pt2ServeError(f"--max-queued must be at least 1, got {self.max_queued}")

    @property
    def root(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    @property
    def burst_size(self) -> int:
        """Requests a burst sends at once: enough to pass the server's queue limit with every client busy."""
        return (self.max_queued if self.max_queued is not None else self.concurrency) + self.concurrency
