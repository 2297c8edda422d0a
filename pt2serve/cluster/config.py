"""How the replicas are laid out, routed and scaled (the server's and runtime's own configs say the rest)."""

from __future__ import annotations

from dataclasses import dataclass

from pt2serve.cluster.routing import DEFAULT_IMBALANCE, Routing
from pt2serve.errors import Pt2ServeError


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 1  # fixed replica count; ignored with autoscale
    autoscale: tuple[int, int] | None = None  # (min, max) replicas, scaled on queue depth and KV use
    routing: Routing = Routing.PREFIX
    # Requests one replica takes at once; past it the replica counts as saturated and a request that would
    # go there goes to the least loaded other one. At most the server's max_queued (it would answer 429).
    max_ongoing_requests: int = 64
    # A home with more requests in flight than this beyond the least loaded replica is passed over (routing.py).
    imbalance: int = DEFAULT_IMBALANCE
    target_active: float = 8.0  # autoscaling: requests (running + queued) per replica
    target_kv_use: float = 0.8  # autoscaling: the share of a replica's KV pool held by requests
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    look_back_s: float = 10.0  # autoscaling: the window its metrics are averaged over
    report_period_s: float = 2.0  # how often replicas report the prompt blocks they took to the routers
    num_cpus: float | None = None  # per replica (Ray resources); None: 1 on the CPU, 0 beside a GPU
    num_gpus: float | None = None  # per replica; None: 1 for a cuda artifact or --device cuda, else 0
    drain_timeout_s: float = 30.0  # a replica being stopped lets its requests finish for this long

    def __post_init__(self) -> None:
        object.__setattr__(self, "routing", Routing(self.routing))
        if self.autoscale is None and self.replicas < 1:
            raise Pt2ServeError(f"replicas must be at least 1, got {self.replicas}")
        if self.autoscale is not None:
            low, high = self.autoscale
            if not 0 <= low <= high or high < 1:
                raise Pt2ServeError(f"autoscale needs 0 <= MIN <= MAX and MAX >= 1, got {low}:{high}")
        if self.max_ongoing_requests < 1:
            raise Pt2ServeError(f"max_ongoing_requests must be at least 1, got {self.max_ongoing_requests}")
        if self.imbalance < 0:
            raise Pt2ServeError(f"imbalance must not be negative, got {self.imbalance}")
        if self.target_active <= 0:
            raise Pt2ServeError(f"target_active must be positive, got {self.target_active}")
        if not 0 < self.target_kv_use <= 1:
            raise Pt2ServeError(f"target_kv_use must be in (0, 1], got {self.target_kv_use}")
        for name in ("upscale_delay_s", "downscale_delay_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise Pt2ServeError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.look_back_s <= 0 or self.report_period_s <= 0:
            raise Pt2ServeError("look_back_s and report_period_s must be positive")


def parse_autoscale(text: str) -> tuple[int, int]:
    """'MIN:MAX' -> (MIN, MAX)."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise Pt2ServeError(f"--autoscale takes MIN:MAX replicas, e.g. 1:4, got {text!r}") from None
