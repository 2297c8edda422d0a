"""The board the replicas pin their /metrics text to, for the gateway's one /metrics.

A plain Ray actor, named per application: each replica puts its text every PUSH_S seconds; the gateway reads
every text fresher than STALE_S (a replica that died drops out within that). Whoever needs it first creates
it; if it goes (its creator's process died), the next put or read makes a new one, which fills within PUSH_S.
"""

from __future__ import annotations

import time

import ray

PUSH_S = 1.0
STALE_S = 5.0
NAMESPACE = "pt2serve"


@ray.remote(num_cpus=0)
class ReplicaBoard:
    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def drop(self, replica: str) -> None:
        self._texts.pop(replica, None)

    def texts(self) -> dict[str, str]:
        now = time.monotonic()
        self._texts = {r: (t, text) for r, (t, text) in self._texts.items() if now - t <= STALE_S}
        return {r: text for r, (_, text) in self._texts.items()}


def board(name: str):
    """The board called `name`, created if it does not exist."""
    return ReplicaBoard.options(name=name, namespace=NAMESPACE, get_if_exists=True).remote()
