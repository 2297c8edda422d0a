"""Autoscaling on what an engine is short of: requests in it (running + queued) and KV cells in use.

Each replica reports, through Ray Serve's record_autoscaling_stats, ACTIVE (requests running or waiting in
its runner) and KV_USE (the share of its KV pool that requests hold; cells kept only for the prefix cache
count as free). The policy wants as many replicas as keep both at their targets on average:

    desired = ceil(max(sum(active) / target_active, sum(kv_use) / target_kv_use))

Ray Serve then applies the deployment's min/max replicas and its upscale/downscale delays. Ray pickles this
module by value into its controller, so it imports nothing of pt2serve.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

ACTIVE = "pt2serve_active_requests"
KV_USE = "pt2serve_kv_use"


def desired_replicas(actives: Iterable[float], kv_uses: Iterable[float], target_active: float,
                     target_kv_use: float) -> int:
    by_queue = sum(actives) / target_active
    by_kv = sum(kv_uses) / target_kv_use
    return math.ceil(max(by_queue, by_kv))


class QueueAndKvPolicy:
    """Ray Serve's autoscaling policy callable (AutoscalingPolicy(policy_function=QueueAndKvPolicy, ...))."""

    def __init__(self, target_active: float = 8.0, target_kv_use: float = 0.8) -> None:
        if target_active <= 0 or not 0 < target_kv_use <= 1:
            raise ValueError(f"target_active must be positive and target_kv_use in (0, 1], got {target_active} "
                             f"and {target_kv_use}")
        self.target_active = target_active
        self.target_kv_use = target_kv_use

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        actives = (metrics.get(ACTIVE) or {}).values()
        kv_uses = (metrics.get(KV_USE) or {}).values()
        if not actives and not kv_uses:  # no report yet (replicas starting): keep what there is
            return ctx.target_num_replicas, {}
        return desired_replicas(actives, kv_uses, self.target_active, self.target_kv_use), {}
