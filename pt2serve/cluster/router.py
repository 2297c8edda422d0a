"""Ray Serve's request router for the engine replicas: RoutePolicy's ranks (routing.py) over the live
replicas, learning from each routed request and from the block hashes each replica reports.

It runs inside every handle to the engine deployment (the gateway's), on Ray's router loop. Ray asks
choose_replicas for ranks, takes the least loaded replica of the first rank that has room, and calls
on_request_routed with the one it took.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pt2serve.cluster.calls import HttpCall
from pt2serve.cluster.routing import DEFAULT_IMBALANCE, RouteKey, RoutePolicy, Routing

REPORTED_BLOCKS = "blocks"  # the routing stats key under which a replica lists the block hashes it took
REPORT_VERSION = "version"


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, routing: str = Routing.PREFIX.value, imbalance: int = DEFAULT_IMBALANCE) -> None:
        self._policy = RoutePolicy(Routing(routing), imbalance)
        self._merged_reports: dict[str, int] = {}  # replica -> version of its report already in the table
        # What this router sent that has not completed: request id -> replica, and the count per replica.
        self._sent: dict[str, str] = {}
        self._in_flight: dict[str, int] = {}

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        by_id = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        for replica in candidate_replicas:
            self._merge_report(replica)
        ranks = self._policy.rank(_route_key(pending_request), list(by_id), self._in_flight)
        if pending_request is not None:
            # Every rank lists all candidates between them: wait (with backoff) before asking again.
            pending_request.routing_context.should_backoff = True
        return [[by_id[r] for r in rank] for rank in ranks if rank]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        replica = replica_id.unique_id
        self._policy.record(_route_key(pending_request), replica)
        self._sent[pending_request.metadata.internal_request_id] = replica
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self._sent.pop(internal_request_id, None)
        if replica is not None and replica in self._in_flight:
            self._in_flight[replica] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        before = {replica_id.unique_id for replica_id in self.curr_replicas}
        super().update_replicas(replicas)
        gone = before - {replica.replica_id.unique_id for replica in replicas}
        for replica in gone:
            self._forget(replica)

    def _forget(self, replica: str) -> None:
        self._policy.forget(replica)
        self._merged_reports.pop(replica, None)
        self._in_flight.pop(replica, None)

    def _merge_report(self, replica: RunningReplica) -> None:
        """Take in the blocks a replica reported since the last look (other gateways' traffic, and what this
        router learnt before it restarted)."""
        stats = replica.routing_stats or {}
        version = stats.get(REPORT_VERSION)
        replica_id = replica.replica_id.unique_id
        if version is None or self._merged_reports.get(replica_id) == version:
            return
        self._merged_reports[replica_id] = version
        self._policy.table.record_held(stats.get(REPORTED_BLOCKS, ()), replica_id)


def _route_key(pending_request: PendingRequest | None) -> RouteKey | None:
    if pending_request is None:
        return None
    for arg in (*pending_request.args, *pending_request.kwargs.values()):
        if isinstance(arg, HttpCall):
            return arg.route
    return None
