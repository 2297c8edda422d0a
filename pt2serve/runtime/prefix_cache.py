"""Opt-in prefix cache: snapshots of finished prompts, sharing their cells (no copies), LRU-evicted.

An entry holds its own reference on each cell (CellAllocator.share), so it survives the request that
computed it. A new request reuses the longest common prefix with any entry; positions 0..k-1 hold the
same K/V whatever follows them, so a partial match is as good as a full one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from pt2serve.runtime.cells import CellAllocator


@dataclass
class PrefixMatch:
    num_tokens: int
    cells: np.ndarray  # the matched cells, already shared for the caller (caller owns one reference)


class PrefixCache:
    def __init__(self, allocator: CellAllocator, max_entries: int) -> None:
        self._allocator = allocator
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()
        self.num_lookups = 0
        self.num_hits = 0
        self.num_reused_tokens = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def insert(self, tokens: list[int], cells: np.ndarray) -> None:
        """Keep a snapshot of computed `tokens` (cell i holds token i)."""
        if self.max_entries == 0 or not tokens:
            return
        key = tuple(tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        snapshot = cells[: len(key)].copy()
        self._allocator.share(snapshot)
        self._entries[key] = snapshot
        while len(self._entries) > self.max_entries:
            self.evict_oldest()

    def lookup(self, prompt: list[int], max_tokens: int) -> PrefixMatch | None:
        """The longest cached prefix of `prompt`, at most `max_tokens` long, shared for the caller."""
        self.num_lookups += 1
        best_key, best_len = None, 0
        for key in self._entries:
            length = _common_prefix(key, prompt, max_tokens)
            if length > best_len:
                best_key, best_len = key, length
        if best_key is None:
            return None
        self._entries.move_to_end(best_key)
        cells = self._entries[best_key][:best_len].copy()
        self._allocator.share(cells)
        self.num_hits += 1
        self.num_reused_tokens += best_len
        return PrefixMatch(best_len, cells)

    def held_cells(self) -> list[np.ndarray]:
        return list(self._entries.values())

    def evict_oldest(self) -> bool:
        """Drop the least recently used entry; False when empty."""
        if not self._entries:
            return False
        _key, cells = self._entries.popitem(last=False)
        self._allocator.free(cells)
        return True

    def clear(self) -> None:
        while self.evict_oldest():
            pass


def _common_prefix(a: tuple[int, ...], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
