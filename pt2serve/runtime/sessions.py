"""Keyed sessions: a finished request's computed tokens and cells, kept for the next request of the key.

A session is taken out of the store while one of its requests runs and put back when it finishes, so
two requests never share one session's cells for writing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from pt2serve.runtime.cells import CellAllocator


@dataclass
class Session:
    tokens: list[int]  # computed tokens; cell i holds token i
    cells: np.ndarray


class SessionStore:
    def __init__(self, allocator: CellAllocator, max_sessions: int) -> None:
        self._allocator = allocator
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def take(self, key: str) -> Session | None:
        return self._sessions.pop(key, None)

    def put(self, key: str, session: Session) -> None:
        """Keep `session` under `key` (its cells now belong to the store), replacing an older one."""
        old = self._sessions.pop(key, None)
        if old is not None:
            self._allocator.free(old.cells)
        self._sessions[key] = session
        while len(self._sessions) > self.max_sessions:
            self.evict_oldest()

    def held_cells(self) -> list[np.ndarray]:
        return [session.cells for session in self._sessions.values()]

    def evict_oldest(self) -> bool:
        if not self._sessions:
            return False
        _key, session = self._sessions.popitem(last=False)
        self._allocator.free(session.cells)
        return True

    def clear(self) -> None:
        while self.evict_oldest():
            pass
