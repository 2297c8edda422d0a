"""The prefix cache's radix tree on its own: longest-prefix matches, holders, pins, and which cells eviction
frees, in what order and how many. Plain host data, no device."""

from __future__ import annotations

import random

import numpy as np

from pt2serve.runtime.cells import CellAllocator
from pt2serve.runtime.prefix_cache import PrefixCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cached(cache: PrefixCache, allocator: CellAllocator, holder: int, tokens: list[int]) -> np.ndarray:
    """A request that computed `tokens` into fresh cells, cached them and let go of its own references."""
    cells = allocator.allocate(len(tokens))
    cache.insert(holder, tokens, cells)
    cache.release(holder)
    allocator.free(cells)
    return cells


def reused(cache: PrefixCache, tokens: list[int], holder: int = 999) -> int:
    """How many tokens a request of `tokens` would reuse (looked up, then let go)."""
    cells = cache.match(holder, tokens, len(tokens))
    cache.release(holder)
    cache._allocator.free(cells)
    return len(cells)


def test_a_match_ending_inside_an_edge_reuses_that_far_and_shares_the_cells():
    allocator = CellAllocator(64)
    cache = PrefixCache(allocator)
    cells = cached(cache, allocator, 1, [1, 2, 3, 4, 5, 6])
    got = cache.match(2, [1, 2, 3, 9, 9], limit=5)
    assert got.tolist() == cells[:3].tolist()
    assert allocator.num_used == 6  # the tree's references, and the caller's on three of them
    assert cache.match(3, [1, 2, 3, 4, 5, 6, 7], limit=4).tolist() == cells[:4].tolist()  # at most `limit`
    assert len(cache.match(4, [7, 1, 2], limit=3)) == 0
    for holder, taken in ((2, got), (3, cells[:4])):
        cache.release(holder)
        allocator.free(taken)
    cache.clear()
    assert allocator.num_used == 0


def test_eviction_takes_exactly_the_cells_asked_for_least_recently_used_leaf_first():
    allocator = CellAllocator(64)
    cache = PrefixCache(allocator)
    cached(cache, allocator, 1, [1, 2, 3, 4, 5, 6])  # the shared head [1 2 3] and leaf [4 5 6]
    cached(cache, allocator, 2, [1, 2, 3, 7, 8])  # leaf [7 8], used after [4 5 6]
    cached(cache, allocator, 3, [20, 21, 22, 23])  # its own leaf, the newest
    assert cache.num_cells == 3 + 3 + 2 + 4
    assert cache.evict(2) == 2  # from the tail of [4 5 6]
    assert cache.num_cells == 10 and allocator.num_used == 10
    assert reused(cache, [1, 2, 3, 4, 5, 6, 0]) == 4
    # That lookup made [1 2 3 4] the newest: the oldest leaf is now [7 8], then [20..23], then [4] and its
    # parent [1 2 3] (a leaf once its children are gone).
    assert cache.evict(3) == 3
    assert reused(cache, [1, 2, 3, 7, 8, 0]) == 3 and reused(cache, [20, 21, 22, 23, 0]) == 3
    assert cache.evict(100) == 7 and cache.num_cells == 0 and allocator.num_used == 0


def test_a_held_path_is_never_evicted():
    allocator = CellAllocator(64)
    cache = PrefixCache(allocator)
    cached(cache, allocator, 1, [1, 2, 3, 4])
    held = cache.match(7, [1, 2, 3, 4, 5], limit=4)  # a running request reuses all four
    assert cache.evict(10) == 0 and cache.num_cells == 4
    cache.insert(7, [1, 2, 3, 4, 5, 6], np.concatenate([held, allocator.allocate(2)]))  # it computed two more
    assert cache.evict(10) == 0
    cache.release(7)
    assert cache.evict(10) == 6 and allocator.num_used == 6  # the request's own references remain


def test_a_split_of_a_held_edge_keeps_it_held_and_frees_it_after():
    allocator = CellAllocator(64)
    cache = PrefixCache(allocator)
    cached(cache, allocator, 1, [1, 2, 3, 4])
    held = cache.match(7, [1, 2, 3, 4, 5], limit=4)
    cached(cache, allocator, 2, [1, 2, 9])  # splits the held edge into [1 2] and [3 4]
    assert cache.evict(10) == 1  # [9] alone
    cache.release(7)
    allocator.free(held)
    assert cache.evict(10) == 4 and allocator.num_used == 0


def test_pinned_paths_go_after_unpinned_ones_and_pins_expire():
    allocator = CellAllocator(64)
    clock = Clock()
    cache = PrefixCache(allocator, max_pins=2, pin_seconds=60.0, clock=clock)
    cells = allocator.allocate(4)
    cache.insert(1, [1, 2, 3, 4], cells)
    cache.pin("chat", 1)
    cache.release(1)
    allocator.free(cells)
    cached(cache, allocator, 2, [9, 9, 9])  # newer, unpinned
    assert cache.evict(3) == 3  # the unpinned leaf, though it is the more recently used
    assert reused(cache, [1, 2, 3, 4, 0]) == 4
    cached(cache, allocator, 3, [8, 8])
    assert cache.evict(3) == 3  # both unpinned cells, then one from the pinned path's tail
    assert reused(cache, [1, 2, 3, 4, 0]) == 3
    cached(cache, allocator, 4, [7, 7])
    clock.now = 61.0  # the pin has expired: the pinned path is an ordinary (and older) leaf again
    assert cache.evict(1) == 1 and reused(cache, [1, 2, 3, 0]) == 2


def test_the_oldest_pin_goes_beyond_max_pins():
    allocator = CellAllocator(64)
    cache = PrefixCache(allocator, max_pins=2)
    for holder, session in enumerate(("a", "b", "c")):
        cells = allocator.allocate(2)
        cache.insert(holder, [10 * holder + 1, 10 * holder + 2], cells)
        cache.pin(session, holder)
        cache.release(holder)
        allocator.free(cells)
    assert cache.num_pinned == 2
    assert cache.evict(2) == 2  # the unpinned one is session "a"'s, the oldest
    assert reused(cache, [1, 2, 0]) == 0 and reused(cache, [11, 12, 0]) == 2


def test_a_pin_follows_its_path_through_a_split():
    allocator = CellAllocator(64)
    cache = PrefixCache(allocator)
    cells = allocator.allocate(5)
    cache.insert(1, [1, 2, 3, 4, 5], cells)
    cache.pin("s", 1)
    cache.release(1)
    allocator.free(cells)
    cached(cache, allocator, 2, [1, 2, 6])  # splits [1..5] into [1 2] and [3 4 5]
    assert cache.evict(1) == 1  # [6], the newest, but the only unpinned leaf
    assert reused(cache, [1, 2, 3, 4, 5, 0]) == 5
    assert cache.evict(1) == 1 and reused(cache, [1, 2, 3, 4, 5, 0]) == 4


def test_a_pin_goes_with_its_path_and_the_leaf_heap_stays_the_size_of_the_tree():
    allocator = CellAllocator(64)
    cache = PrefixCache(allocator)
    cells = allocator.allocate(3)
    cache.insert(1, [1, 2, 3], cells)
    cache.pin("s", 1)
    cache.release(1)
    allocator.free(cells)
    assert cache.evict(3) == 3 and cache.num_pinned == 0  # the pinned path was all that was left
    # Every reuse of a path leaves a stale entry for its leaf behind: they do not pile up.
    cached(cache, allocator, 2, [5, 6, 7])
    for holder in range(10_000):
        assert reused(cache, [5, 6, 7, 8], holder) == 3
    assert len(cache._leaves) <= 2 + 64


def test_a_disabled_cache_reuses_and_keeps_nothing():
    allocator = CellAllocator(64)
    cache = PrefixCache(allocator, enabled=False)
    cached(cache, allocator, 1, [1, 2, 3])
    assert cache.num_cells == 0 and allocator.num_used == 0
    assert len(cache.match(2, [1, 2, 3, 4], limit=3)) == 0 and cache.hit_rate == 0.0


def unheld_cells(cache: PrefixCache) -> int:
    """The cells of the nodes no holder holds, counted by walking the tree."""
    count, stack = 0, list(cache._root.children.values())
    while stack:
        node = stack.pop()
        count += len(node.cells) if node.num_holders == 0 else 0
        stack.extend(node.children.values())
    return count


def test_the_cells_others_computed_are_told_from_a_holders_own():
    allocator = CellAllocator(64)
    cache = PrefixCache(allocator)
    first = allocator.allocate(8)
    cache.insert(1, list(range(8)), first)
    cache.release(1)
    assert cache.peek(list(range(12)), 11) == (8, 8)
    assert cache.num_unheld_cells == 8
    cells = cache.match(2, list(range(12)), 11)  # 8 of the first's cells, then 4 of its own
    assert cache.num_unheld_cells == 0 and cache.peek(list(range(12)), 11) == (8, 0)
    cache.insert(2, list(range(12)), np.concatenate([cells, allocator.allocate(4)]))
    assert cache.reused_from_others(2, 12) == 8 and cache.reused_from_others(2, 6) == 6
    cache.release(2)
    cache.match(3, list(range(5)) + [99], 5)  # splits the first's edge: both halves are still the first's
    cache.match(2, list(range(12)), 11)  # the second again, as after a preemption
    assert cache.reused_from_others(2, 12) == 8 and cache.reused_from_others(3, 6) == 5
    assert cache.num_unheld_cells == unheld_cells(cache) == 1  # the twelfth, past what the match may take


def test_random_requests_always_reuse_cells_that_hold_their_own_prefix():
    """Requests over families of prompts that share prefixes, under a small pool: every reused cell was
    computed for exactly that prefix, the references add up, and the pool ends empty."""
    rng = random.Random(3)
    allocator = CellAllocator(200)
    cache = PrefixCache(allocator, max_pins=3, clock=Clock())
    computed_for: dict[int, tuple[int, ...]] = {}  # cell -> the token prefix whose last K/V it holds
    families = [[rng.randrange(5) for _ in range(rng.randint(5, 30))] for _ in range(4)]
    running: dict[int, tuple[list[int], np.ndarray]] = {}
    for holder in range(400):
        if running and (len(running) > 4 or rng.random() < 0.4):
            done = rng.choice(sorted(running))
            tokens, cells = running.pop(done)
            known = rng.randint(0, len(tokens))  # cells past the known tokens are never cached
            cache.insert(done, tokens[:known], cells[:known])
            if rng.random() < 0.3:
                cache.pin(f"s{done % 5}", done)
            cache.release(done)
            allocator.free(cells)
            continue
        base = rng.choice(families)
        tokens = base[: rng.randint(1, len(base))] + [rng.randrange(5) for _ in range(rng.randint(0, 8))]
        cells = cache.match(holder, tokens, len(tokens) - 1)
        for position, cell in enumerate(cells):
            assert computed_for[int(cell)] == tuple(tokens[: position + 1])
        missing = len(tokens) - len(cells)
        if not allocator.can_allocate(missing):
            cache.evict(missing - allocator.num_free)
        fresh = allocator.allocate(missing)
        if fresh is None:  # the running requests hold the pool: give up this one
            cache.release(holder)
            allocator.free(cells)
            continue
        for position, cell in enumerate(fresh, start=len(cells)):
            computed_for[int(cell)] = tuple(tokens[: position + 1])
        running[holder] = (tokens, np.concatenate([cells, fresh]))
        holders_refs = sum(len(c) for _, c in running.values())
        assert allocator.num_used <= cache.num_cells + holders_refs
        assert cache.num_unheld_cells == unheld_cells(cache)
        assert cache.peek(tokens, len(tokens))[0] >= len(cells)
    assert cache.num_hits > 50
    for holder, (_, cells) in running.items():
        cache.release(holder)
        allocator.free(cells)
    assert allocator.num_used == cache.num_cells
    cache.clear()
    assert allocator.num_used == 0
