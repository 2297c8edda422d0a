"""What the app knows while it runs: its config, the runner once loaded, metrics, and whether it drains.

    loading   runner is None: /health and the API answer 503 with Retry-After
    serving   runner attached
    draining  shutting down (see shutdown.py): running requests go on, new ones get 503 with Retry-After
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pt2serve.runtime.runner import Runner
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.errors import ApiError
from pt2serve.serve.generation import EventBridge
from pt2serve.serve.metrics import ServerMetrics


@dataclass
class ServerState:
    config: ServerConfig
    runner: Runner | None = None
    owns_runner: bool = False  # close the runner when the app shuts down
    draining: bool = False  # set once, on the event loop, when a shutdown begins
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(init=False)
    _bridge: EventBridge | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(lambda: self.runner)

    def event_bridge(self) -> EventBridge:
        """The one bridge from the engine thread into the serving loop (call on the loop)."""
        if self._bridge is None:
            self._bridge = EventBridge(asyncio.get_running_loop())
        return self._bridge

    def ready_runner(self) -> Runner:
        if self.runner is None:
            raise ApiError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "1"})
        return self.runner

    def check_admission(self, runner: Runner, num_choices: int = 1) -> None:
        """Refuse a new request (of `num_choices` runner requests) while draining or at capacity. Call it right
        before submitting, with no await in between, so neither a shutdown nor concurrent requests can slip
        past it (and before any costly work, so a refusal costs nothing)."""
        config = self.config
        if num_choices > config.max_queued:
            raise ApiError(400, f"the request asks for {num_choices} choices, more than this server ever runs at "
                           f"once ({config.max_queued}); split it", "n", "too_many_choices")
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests; retry shortly",
                           code="shutting_down", headers={"Retry-After": str(config.retry_after_seconds)})
        if runner.num_active + num_choices > config.max_queued:
            raise ApiError(429, f"the server is at capacity ({runner.num_active} requests queued or running); "
                           "retry later", code="queue_full", headers={"Retry-After": str(config.retry_after_seconds)})
