"""The prefix cache: a radix tree over token ids whose nodes own reference-counted KV cells.

    root ─ [1 2 3 4] ─┬─ [5 6]            a node: a run of tokens (its edge) and the cell of each; a token's
                      │                   position is its depth in tokens, so the path from the root spells
                      └─ [9 9] ─ [7]      a token prefix and holds the K/V of every position in it

Any request reuses the longest cached prefix of its tokens, whether or not it names a session: the K/V at
positions 0..k-1 depend only on tokens 0..k-1, so a match that ends inside an edge is as good as a whole
one (the edge is split there). The tree holds one reference on each of its cells (CellAllocator.share), so
cells outlive the requests that computed them; a cell in the tree is never written again (a request writes
only cells it allocated, at positions past what it reused). Only cells whose tokens are known are inserted.

Holders: a request that reused a path or added its cells to one holds the path's end until it lets go;
nodes on a held path are never evicted (that would free nothing: the request holds their cells too; a
request that computed positions the tree already had swaps its copies for the tree's cells, see
Scheduler._cache_prompt).
Pins: a session pins the path its last request left, for `pin_seconds`, at most `max_pins` sessions at a
time (the oldest pin goes first). Eviction frees exactly the cells asked for, from the tail of the least
recently used leaf nobody holds, leaf after leaf: unpinned leaves first, pinned ones only when those run out.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from pt2serve.runtime.cells import CellAllocator

_NO_CELLS = np.empty(0, dtype=np.int64)


class _Node:
    __slots__ = ("tokens", "cells", "parent", "origin", "children", "num_holders", "num_pins", "last_used",
                 "in_tree")

    def __init__(self, tokens: np.ndarray, cells: np.ndarray, parent: _Node | None, origin: int | None) -> None:
        self.tokens = tokens  # [n] int64, the edge
        self.cells = cells  # [n] int64, cells[i] holds the K/V of tokens[i]
        self.parent = parent
        self.origin = origin  # the holder that computed these cells and inserted them
        self.children: dict[int, _Node] = {}  # by first token
        self.num_holders = 0  # holders whose path runs through this node
        self.num_pins = 0  # sessions whose pinned path ends here
        self.last_used = 0  # the cache's tick when a match or insert last went through here
        self.in_tree = True


class PrefixCache:
    def __init__(self, allocator: CellAllocator, enabled: bool = True, max_pins: int = 64,
                 pin_seconds: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._allocator = allocator
        self.enabled = enabled
        self.max_pins = max_pins
        self.pin_seconds = pin_seconds
        self._clock = clock
        self._root = _Node(_NO_CELLS, _NO_CELLS, None, None)
        self._ticks = itertools.count(1)
        self._held: dict[int, _Node] = {}  # holder -> the end of its held path
        self._pins: OrderedDict[str, tuple[_Node, float]] = OrderedDict()  # session -> (node, expiry), oldest first
        # Leaves nobody holds, as (last_used, seq, node), least recently used first. Entries go stale when a
        # node is used again, gains a child, becomes held or leaves the tree; a stale entry is skipped on pop.
        self._leaves: list[tuple[int, int, _Node]] = []
        self._seq = itertools.count()
        self._num_nodes = 0
        self.num_cells = 0  # cells the tree holds a reference on
        self.num_unheld_cells = 0  # of those, the cells of nodes no holder holds: what eviction can take
        self.num_lookups = 0
        self.num_hits = 0  # counted lookups that reused at least one cell another holder computed
        self.num_lookup_tokens = 0
        self.num_reused_tokens = 0  # of those, cells another holder computed

    @property
    def hit_rate(self) -> float:
        """Share of the tokens of counted lookups whose cells another holder computed."""
        return self.num_reused_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    # -- requests ------------------------------------------------------------------------------------------

    def peek(self, tokens: Sequence[int], limit: int) -> tuple[int, int]:
        """What match() would reuse of `tokens`, without holding or changing anything: the cached prefix's
        length, and how many of its cells no holder holds (they count as evictable until matched)."""
        if not self.enabled or limit < 1:
            return 0, 0
        ids = np.asarray(tokens[:limit], dtype=np.int64)
        node, depth, unheld = self._root, 0, 0
        while depth < len(ids):
            child = node.children.get(int(ids[depth]))
            if child is None:
                break
            common = _common_length(child.tokens, ids[depth:])
            unheld += common if child.num_holders == 0 else 0
            node, depth = child, depth + common
            if common < len(child.tokens):
                break
        return depth, unheld

    def reused_from_others(self, holder: int, upto: int) -> int:
        """Of the first `upto` positions of the path `holder` holds, how many have cells that another holder
        computed (not `holder` itself, say before it was preempted)."""
        node = self._held.get(holder)
        if node is None:
            return 0
        path = []
        while node is not self._root:
            path.append(node)
            node = node.parent
        count, depth = 0, 0
        for node in reversed(path):
            if depth >= upto:
                break
            if node.origin != holder:
                count += min(len(node.cells), upto - depth)
            depth += len(node.cells)
        return count

    def match(self, holder: int, tokens: Sequence[int], limit: int, counted: bool = True) -> np.ndarray:
        """The cells of the longest cached prefix of `tokens`, at most `limit` long; `holder` holds the path
        and owns one new reference on each returned cell.

        `counted`: whether the lookup counts towards hit_rate (a request resumed after a preemption looks its
        own tokens up again: not counted, and cells it computed itself never count as reused)."""
        if counted:
            self.num_lookups += 1
            self.num_lookup_tokens += len(tokens)
        if not self.enabled or limit < 1:
            return _NO_CELLS
        node, depth = self._descend(np.asarray(tokens[:limit], dtype=np.int64))
        if depth == 0:
            return _NO_CELLS
        cells = self._path_cells(node)
        self._allocator.share(cells)
        self._use(node)
        self._hold(holder, node)
        if counted:
            reused = self.reused_from_others(holder, depth)
            self.num_hits += reused > 0
            self.num_reused_tokens += reused
        return cells

    def insert(self, holder: int, tokens: Sequence[int], cells: np.ndarray) -> np.ndarray:
        """Cache `tokens` (cells[i] holds token i's K/V, written by a step already launched); `holder` holds
        the path. Positions the tree already has keep its cells; the caller still owns its own references.
        Returns the path's cells, the tree's for each position (`cells` where the cache is off)."""
        if not self.enabled or not len(tokens):
            return cells
        ids = np.asarray(tokens, dtype=np.int64)
        node, depth = self._descend(ids)
        if depth < len(ids):
            child = _Node(ids[depth:].copy(), np.array(cells[depth:len(ids)], dtype=np.int64), node, holder)
            self._allocator.share(child.cells)
            node.children[int(ids[depth])] = child
            self._num_nodes += 1
            self.num_cells += len(child.cells)
            self.num_unheld_cells += len(child.cells)  # until _hold below
            node = child
        self._use(node)
        self._hold(holder, node)
        return self._path_cells(node)

    def pin(self, session: str, holder: int) -> None:
        """Pin the path `holder` holds under `session` (replacing the session's older pin)."""
        node = self._held.get(holder)
        if not self.enabled or node is None or self.max_pins == 0:
            return
        self._unpin(session)
        node.num_pins += 1
        self._pins[session] = (node, self._clock() + self.pin_seconds)
        while len(self._pins) > self.max_pins:
            self._unpin(next(iter(self._pins)))

    def release(self, holder: int) -> None:
        """`holder` no longer holds its path (it freed, or is about to free, its own references)."""
        node = self._held.pop(holder, None)
        if node is not None:
            self._add_holders(node, -1)

    # -- eviction ------------------------------------------------------------------------------------------

    def evict(self, num_cells: int) -> int:
        """Free up to `num_cells` cells nobody else holds, least recently used first, unpinned before pinned;
        returns how many were freed."""
        if num_cells <= 0:
            return 0
        self._expire_pins()
        freed = self._evict(num_cells, include_pinned=False)
        if freed < num_cells:
            freed += self._evict(num_cells - freed, include_pinned=True)
        return freed

    def held_cells(self) -> list[np.ndarray]:
        """The cells of every node (the tree holds one reference on each)."""
        cells, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            cells.append(node.cells)
            stack.extend(node.children.values())
        return cells

    def clear(self) -> None:
        """Drop every node and the tree's reference on every cell (callers keep theirs)."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._allocator.free(node.cells)
            node.in_tree = False
        self._root = _Node(_NO_CELLS, _NO_CELLS, None, None)
        self._held.clear()
        self._pins.clear()
        self._leaves.clear()
        self._num_nodes = 0
        self.num_cells = 0
        self.num_unheld_cells = 0

    def _evict(self, num_cells: int, include_pinned: bool) -> int:
        freed, passed_over = 0, []
        while freed < num_cells and self._leaves:
            entry = heapq.heappop(self._leaves)
            last_used, _, node = entry
            if not self._is_free_leaf(node) or last_used != node.last_used:
                continue  # stale
            if node.num_pins and not include_pinned:
                passed_over.append(entry)
                continue
            freed += self._trim(node, num_cells - freed)
            if node.in_tree:
                heapq.heappush(self._leaves, entry)  # what is left of it is still the least recently used
        for entry in passed_over:
            heapq.heappush(self._leaves, entry)
        return freed

    def _trim(self, node: _Node, count: int) -> int:
        """Free up to `count` cells from the end of a leaf nobody holds; drop it once empty."""
        key = int(node.tokens[0])
        count = min(count, len(node.cells))
        keep = len(node.cells) - count
        self._allocator.free(node.cells[keep:])
        node.tokens, node.cells = node.tokens[:keep], node.cells[:keep]
        self.num_cells -= count
        self.num_unheld_cells -= count  # (a leaf nobody holds)
        if keep == 0:
            parent = node.parent
            del parent.children[key]
            node.in_tree = False
            self._num_nodes -= 1
            if node.num_pins:  # the sessions pinned here lose their pins with it
                for session in [s for s, (pinned, _) in self._pins.items() if pinned is node]:
                    del self._pins[session]
            self._push_if_free_leaf(parent)
        return count

    # -- tree mechanics ------------------------------------------------------------------------------------

    def _descend(self, ids: np.ndarray) -> tuple[_Node, int]:
        """The node where the longest cached prefix of `ids` ends (an edge it ends inside is split there)
        and that prefix's length."""
        node, depth = self._root, 0
        while depth < len(ids):
            child = node.children.get(int(ids[depth]))
            if child is None:
                break
            common = _common_length(child.tokens, ids[depth:])
            if common < len(child.tokens):
                child = self._split(child, common)
            node, depth = child, depth + common
        return node, depth

    def _split(self, node: _Node, length: int) -> _Node:
        """Cut `node`'s edge after `length` tokens: a new parent takes the head; `node` keeps the tail, its
        children, pins and heap entries. Returns the new parent."""
        parent = node.parent
        head = _Node(node.tokens[:length], node.cells[:length], parent, node.origin)
        head.num_holders, head.last_used = node.num_holders, node.last_used
        self._num_nodes += 1
        parent.children[int(node.tokens[0])] = head
        node.tokens, node.cells, node.parent = node.tokens[length:], node.cells[length:], head
        head.children[int(node.tokens[0])] = node
        return head

    def _path_cells(self, node: _Node) -> np.ndarray:
        parts = []
        while node is not self._root:
            parts.append(node.cells)
            node = node.parent
        return np.concatenate(parts[::-1])

    def _use(self, node: _Node) -> None:
        tick = next(self._ticks)
        while node is not self._root:
            node.last_used = tick
            node = node.parent

    def _hold(self, holder: int, node: _Node) -> None:
        self._add_holders(node, 1)
        previous = self._held.get(holder)
        self._held[holder] = node
        if previous is not None:
            self._add_holders(previous, -1)

    def _add_holders(self, node: _Node, delta: int) -> None:
        end = node
        while node is not self._root:
            was_held = node.num_holders > 0
            node.num_holders += delta
            if was_held != (node.num_holders > 0):
                self.num_unheld_cells += len(node.cells) if was_held else -len(node.cells)
            node = node.parent
        self._push_if_free_leaf(end)

    def _push_if_free_leaf(self, node: _Node) -> None:
        if not self._is_free_leaf(node):
            return
        heapq.heappush(self._leaves, (node.last_used, next(self._seq), node))
        if len(self._leaves) > 2 * self._num_nodes + 64:  # mostly stale entries: keep the heap as big as the tree
            self._leaves = [entry for entry in self._leaves
                            if self._is_free_leaf(entry[2]) and entry[0] == entry[2].last_used]
            heapq.heapify(self._leaves)

    def _is_free_leaf(self, node: _Node) -> bool:
        return node.in_tree and node is not self._root and not node.children and node.num_holders == 0

    def _unpin(self, session: str) -> None:
        pinned = self._pins.pop(session, None)
        if pinned is not None:
            pinned[0].num_pins -= 1

    def _expire_pins(self) -> None:
        now = self._clock()
        while self._pins:
            session, (_node, expiry) = next(iter(self._pins.items()))
            if expiry > now:
                return
            self._unpin(session)


def _common_length(edge: np.ndarray, ids: np.ndarray) -> int:
    n = min(len(edge), len(ids))
    differ = np.flatnonzero(edge[:n] != ids[:n])
    return int(differ[0]) if len(differ) else n
