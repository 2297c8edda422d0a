"""One engine replica: the artifact's runner behind the server's own app (pt2serve.serve.app), answering the
gateway's calls in process (asgi.py), so every route, error and stream is what serve-artifact gives.

Beside the calls it tells Ray Serve how loaded it is (record_autoscaling_stats: requests and KV use, for
autoscale.py), which prompt blocks it took (record_routing_stats, for other gateways' routers), and pins its
/metrics text to the board every PUSH_S seconds.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator

import ray
from ray import serve

from pt2serve.cluster import board
from pt2serve.cluster.asgi import call_app
from pt2serve.cluster.autoscale import ACTIVE, KV_USE
from pt2serve.cluster.calls import HttpCall, ResponseStart
from pt2serve.cluster.router import REPORT_VERSION, REPORTED_BLOCKS
from pt2serve.cluster.routing import BLOCK_TOKENS
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.serve.config import ServerConfig

log = logging.getLogger("pt2serve.cluster")

MAX_REPORTED_BLOCKS = 1 << 16


@dataclass(frozen=True)
class ReplicaSettings:
    """Everything a replica needs to open its runner and serve it (pickled to each replica)."""

    artifact: str
    board_name: str
    server: ServerConfig = field(default_factory=ServerConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    device: str | None = None
    threads: int | None = None  # torch's CPU threads; None: serve-artifact's default


class EngineReplica:
    def __init__(self, settings: ReplicaSettings) -> None:
        import torch

        from pt2serve.runtime.engine import open_runner
        from pt2serve.serve.app import create_app
        from pt2serve.serve.command import default_threads

        torch.set_num_threads(settings.threads or default_threads())
        self._runner = open_runner(settings.artifact, settings.device, settings.executor, settings.runner)
        self._app = create_app(settings.server, self._runner, owns_runner=True)
        self._id = serve.get_replica_context().replica_id.unique_id
        # Block hashes of the prompts it took, newest last, as many as its pool could hold.
        num_blocks = max(1, self._runner.executor.memory.num_cells // BLOCK_TOKENS)
        self._max_blocks = min(num_blocks, MAX_REPORTED_BLOCKS)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._blocks_version = 0
        self._board_name = settings.board_name
        self._closed = threading.Event()
        threading.Thread(target=self._push_metrics, name="pt2serve-metrics-push", daemon=True).start()

    async def forward(self, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
        """Answer one HTTP call: its response start with the first bytes, then the rest as it comes."""
        if call.route is not None and call.route.blocks:
            self._took(call.route.blocks)
        async for item in call_app(self._app, call):
            yield item

    def record_routing_stats(self) -> dict:
        return {REPORT_VERSION: self._blocks_version, REPORTED_BLOCKS: list(self._blocks)}

    def record_autoscaling_stats(self) -> dict[str, float]:
        stats = self._runner.stats
        cells = stats.cells_used + stats.cells_free
        held = stats.cells_used - stats.prefix_cache_cells  # cached-only cells are freed on demand
        return {ACTIVE: float(self._runner.num_active), KV_USE: held / cells if cells else 0.0}

    def __del__(self) -> None:
        # Ray Serve calls this once the replica's requests are done or its graceful shutdown timed out.
        closed = getattr(self, "_closed", None)
        if closed is None or closed.is_set():
            return
        closed.set()
        self._runner.close()

    def _took(self, blocks: tuple[int, ...]) -> None:
        for block in blocks:
            self._blocks.pop(block, None)
            self._blocks[block] = None
        while len(self._blocks) > self._max_blocks:
            self._blocks.popitem(last=False)
        self._blocks_version += 1

    def _push_metrics(self) -> None:
        pinned = None
        while not self._closed.wait(board.PUSH_S):
            try:
                pinned = pinned or board.board(self._board_name)
                text = self._app.state.pt2serve.metrics.render().decode()
                ray.get(pinned.put.remote(self._id, text), timeout=board.STALE_S)
            except Exception as err:  # the board went (its creator died): make it again next time
                log.debug("pushing metrics failed: %s", err)
                pinned = None
