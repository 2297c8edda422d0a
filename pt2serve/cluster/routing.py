"""Where a request should run, from what it shares with earlier ones: no Ray in here.

A request's route key (RouteKey) is computed by the gateway from its prompt's token ids: the hashes of its
whole blocks of BLOCK_TOKENS tokens, each chained to the one before, so equal hashes at block i mean equal
prompts up to the end of block i; the hash of its first HEAD_TOKENS tokens; and its session, if it names one.

    prompt   [ system prompt ......... | user 1 ... | reply 1 ... | user 2 ... ]
    blocks   b0   b1   b2  ...  b63      b64 ...      b72 ...       (b_i = hash(b_{i-1}, tokens of block i))

Two ways to pick a replica from it, both measured in docs/replicas.md:

- PrefixTable (the one served): block hash -> the replicas that took a prompt with that block, from the
  router's own routing and from what the replicas report. A request goes to the replicas holding its deepest
  block; a chat's next turn repeats its history, so it finds its own replica, while new conversations that
  share only a system prompt tie across every replica that holds it and spread by load.
- FirstTokensRing: consistent hashing of the first HEAD_TOKENS tokens. No state to keep, but every
  conversation that starts with the same system prompt lands on one replica.

A session (X-Session-ID) is sent where it went before, whatever its prompt. Either way the answer is ranks:
the preferred replicas first, then the others; Ray Serve takes the least loaded replica of the first rank
with room (fewer than max_ongoing_requests in flight), so a saturated home gives way to the least loaded.

The table also notes where prompts branch: a block after which two prompts went on differently ends a shared
prefix (a system prompt). A request whose deepest match is such a block has nothing of its own anywhere; its
home is passed over when it has more than `imbalance` requests in flight beyond the least loaded replica.
Else the first replica to take a system prompt, alone holding it, would draw every new conversation until it
saturates; passed over, the next replica takes one and holds the prompt too, and from then on new
conversations tie and spread by load. A later turn, whose deepest block is its own history, stays home
until its replica is saturated.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping, Sequence

BLOCK_TOKENS = 16  # tokens per hashed block: a prefix is matched to within this many tokens
HEAD_TOKENS = 256  # FirstTokensRing: the leading tokens hashed
MAX_TABLE_BLOCKS = 1 << 20  # PrefixTable entries kept, least recently used evicted first (~100 MB at most)
MAX_SESSIONS = 1 << 16
DEFAULT_IMBALANCE = 8  # requests in flight a home may have beyond the least loaded replica's
RING_POINTS = 64  # points on the ring per replica


class Routing(str, Enum):
    PREFIX = "prefix"  # PrefixTable: the longest prompt prefix a replica took (the default)
    FIRST_TOKENS = "first-tokens"  # FirstTokensRing: consistent hashing on the first HEAD_TOKENS tokens


@dataclass(frozen=True)
class RouteKey:
    """What a request shares with others, for routing: computed once, by the gateway."""

    blocks: tuple[int, ...] = ()  # chained hashes of the prompt's whole blocks
    head: int | None = None  # hash of the first HEAD_TOKENS tokens (all of them if fewer); None: no prompt
    session_id: str | None = None

    @staticmethod
    def of(token_ids: Sequence[int] | None, session_id: str | None = None) -> "RouteKey":
        if not token_ids:
            return RouteKey(session_id=session_id)
        return RouteKey(block_hashes(token_ids), hash(tuple(token_ids[:HEAD_TOKENS])), session_id)


def block_hashes(token_ids: Sequence[int]) -> tuple[int, ...]:
    """Chained hashes of each whole block of BLOCK_TOKENS tokens (a hash of ints is the same in every process)."""
    hashes, previous = [], 0
    for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        previous = hash((previous, *token_ids[start:start + BLOCK_TOKENS]))
        hashes.append(previous)
    return tuple(hashes)


@dataclass
class _Block:
    owners: set[str]  # replicas that took a prompt holding this block
    next_block: int | None = None  # the first block seen after it
    is_shared: bool = False  # prompts went on from it in two or more ways (a system prompt, a template)


class PrefixTable:
    """Block hash -> replicas that took a prompt holding it, and whether prompts branch after it; bounded,
    least recently used first out."""

    def __init__(self, max_blocks: int = MAX_TABLE_BLOCKS) -> None:
        self._blocks: OrderedDict[int, _Block] = OrderedDict()
        self._max_blocks = max_blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, blocks: Sequence[int], replica: str) -> None:
        """`replica` took a prompt of these chained blocks."""
        previous: _Block | None = None
        for block in blocks:
            entry = self._take(block, replica)
            if previous is not None:
                if previous.next_block is None:
                    previous.next_block = block
                elif previous.next_block != block:
                    previous.is_shared = True
            previous = entry
        self._evict()

    def record_held(self, blocks: Iterable[int], replica: str) -> None:
        """`replica` holds these blocks, in no particular order (what a replica reports)."""
        for block in blocks:
            self._take(block, replica)
        self._evict()

    def _take(self, block: int, replica: str) -> _Block:
        entry = self._blocks.pop(block, None) or _Block(set())
        entry.owners.add(replica)
        self._blocks[block] = entry  # the most recently used, last
        return entry

    def _evict(self) -> None:
        while len(self._blocks) > self._max_blocks:
            self._blocks.popitem(last=False)

    def longest_match(self, blocks: Sequence[int], replicas: Iterable[str]) -> tuple[int, set[str], bool]:
        """(blocks matched, the replicas among `replicas` that hold all of them, whether other prompts branched
        from the last of them); (0, set(), False) for no match."""
        holders, depth, shared = set(replicas), 0, False
        for block in blocks:
            entry = self._blocks.get(block)
            live = holders & entry.owners if entry is not None else set()
            if not live:
                break
            holders, depth, shared = live, depth + 1, entry.is_shared
        return (depth, holders, shared) if depth else (0, set(), False)

    def forget(self, replica: str) -> None:
        """A replica is gone: it holds nothing any more."""
        for block in [b for b, entry in self._blocks.items() if replica in entry.owners]:
            owners = self._blocks[block].owners
            owners.discard(replica)
            if not owners:
                del self._blocks[block]


class FirstTokensRing:
    """Consistent hashing: a key maps to the first replica point at or after it on a ring of RING_POINTS per
    replica, so adding or removing a replica moves only the keys next to its points."""

    def __init__(self, replicas: Iterable[str] = ()) -> None:
        self._points: list[tuple[int, str]] = []
        self.update(replicas)

    def update(self, replicas: Iterable[str]) -> None:
        self._points = sorted((_stable_hash(f"{replica}#{i}"), replica) for replica in set(replicas)
                              for i in range(RING_POINTS))

    def lookup(self, key: int) -> str | None:
        if not self._points:
            return None
        index = bisect.bisect_left(self._points, (key & 0xFFFF_FFFF_FFFF_FFFF, ""))
        return self._points[index % len(self._points)][1]


class RoutePolicy:
    """Ranks replicas for a request by `routing`; learns from every routed request (record)."""

    def __init__(self, routing: Routing = Routing.PREFIX, imbalance: int = DEFAULT_IMBALANCE) -> None:
        self.routing = Routing(routing)
        self.imbalance = imbalance
        self.table = PrefixTable()
        self._ring = FirstTokensRing()
        self._ring_members: frozenset[str] = frozenset()
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def rank(self, key: RouteKey | None, replicas: Sequence[str],
             in_flight: Mapping[str, int] | None = None) -> list[list[str]]:
        """[preferred replicas, the others] (or [all] with no preference); each rank in `replicas` order.
        `in_flight`: requests each replica is answering (missing: none)."""
        home, is_shared = self._home(key, replicas) if key is not None else (set(), False)
        if home and is_shared and in_flight is not None:
            least = min(in_flight.get(r, 0) for r in replicas)
            if min(in_flight.get(r, 0) for r in home) - least > self.imbalance:
                home = set()
        if not home:
            return [list(replicas)]
        return [[r for r in replicas if r in home], [r for r in replicas if r not in home]]

    def _home(self, key: RouteKey, replicas: Sequence[str]) -> tuple[set[str], bool]:
        """(the replicas the request belongs on, whether that is only for a prefix other prompts share)."""
        session_home = self._sessions.get(key.session_id) if key.session_id is not None else None
        if session_home in replicas:
            return {session_home}, False
        if self.routing is Routing.FIRST_TOKENS:
            if key.head is None:
                return set(), False
            if self._ring_members != frozenset(replicas):
                self._ring_members = frozenset(replicas)
                self._ring.update(replicas)
            return {self._ring.lookup(key.head)}, False
        _, holders, is_shared = self.table.longest_match(key.blocks, replicas)
        return holders, is_shared

    def record(self, key: RouteKey | None, replica: str) -> None:
        """`replica` took the request: its prompt's blocks (and session) are there now."""
        if key is None:
            return
        self.table.record(key.blocks, replica)
        if key.session_id is not None:
            self._sessions.pop(key.session_id, None)
            self._sessions[key.session_id] = replica
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def forget(self, replica: str) -> None:
        self.table.forget(replica)
        for session in [s for s, home in self._sessions.items() if home == replica]:
            del self._sessions[session]


def _stable_hash(text: str) -> int:
    """A 64-bit hash of a string that is the same in every process (str's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
