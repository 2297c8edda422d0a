"""Drafters propose the tokens a sequence is likely to continue with; the target model verifies them (verify.py).

A drafter only proposes: whatever it returns, the emitted tokens are the target's (greedy) or distributed as
the target's (sampling). A good drafter makes steps emit more tokens; a bad one costs the verify rows.
The scheduler asks for all of a step's drafts at once (`propose_all`): a host drafter answers per request,
a device drafter (DFlash, dflash.py) drafts them together in a few calls.

`NgramDrafter` is prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens
(n = max_ngram down to min_ngram) in its own prompt and output, and propose the tokens that followed it.

    tokens:  ... a b c x y z ... a b c | ?        last 3 tokens "a b c" occurred before, followed by x y z
    drafts:  x y z                                (up to k tokens)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class Speculation(enum.Enum):
    """Where a runner's drafts come from."""

    NONE = "none"  # no drafts: every decode is one token
    NGRAM = "ngram"  # prompt lookup (NgramDrafter)
    DFLASH = "dflash"  # the artifact's DFlash draft model (dflash.py)


@dataclass(frozen=True)
class DraftRequest:
    """One sequence to draft for: its tokens and the cells of those already computed."""

    tokens: Sequence[int]  # prompt and output so far; the last one is pending (its K/V not computed yet)
    cells: np.ndarray  # the cells of positions 0 .. len(tokens) - 2
    max_drafts: int


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        """Up to `max_drafts` tokens to follow `tokens` (the request's prompt and output so far)."""
        ...


def propose_all(drafter, requests: list[DraftRequest]) -> list[tuple[int, ...]]:
    """Drafts for each request: all at once from a drafter that batches them on the device (`propose_batch`,
    e.g. DFlash), else one request at a time from a host drafter's `propose`."""
    batch = getattr(drafter, "propose_batch", None)
    if batch is not None:
        return batch(requests) if requests else []
    return [tuple(drafter.propose(r.tokens, r.max_drafts)) for r in requests]


class NgramDrafter:
    """Prompt lookup over the request's own tokens (host side, no model)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, tokens: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        if max_drafts < 1 or len(tokens) < 2:
            return ()
        history = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            follows = _latest_match_end(history, n)
            if follows is not None:
                return _copy_forward(history, follows, max_drafts)
        return ()


def _latest_match_end(history: np.ndarray, n: int) -> int | None:
    """Where the latest earlier occurrence of the last n tokens ends (the index of the token after it)."""
    suffix = history[-n:]
    # Windows that start early enough to be followed by a token inside the history, before the suffix itself.
    windows = sliding_window_view(history[:-1], n)
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    if hits.size == 0:
        return None
    return int(hits[-1]) + n


def _copy_forward(history: np.ndarray, start: int, count: int) -> tuple[int, ...]:
    """`count` tokens copied from `start` on; past the end of the history the copy reads its own output, so a
    period shorter than `count` (a a a ..., or a b a b ...) still fills every draft."""
    out: list[int] = []
    length = len(history)
    for i in range(count):
        at = start + i
        out.append(int(history[at]) if at < length else out[at - length])
    return tuple(out)
