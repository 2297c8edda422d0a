"""Drafters propose the tokens a sequence is likely to continue with; the target model verifies them (verify.py).

A drafter only proposes: whatever it returns, the emitted tokens are the target's (greedy) or distributed as
the target's (sampling). A good drafter makes steps emit more tokens; a bad one costs the verify rows.
A host drafter (`propose`) answers the scheduler per request, from token ids. A device drafter (DFlash,
dflash.py; `draft_on_device`) is run by the executor as it launches the verifying step: it drafts all of the
step's sequences together in a few calls and its drafts go straight into the step's inputs on the device;
the scheduler only reserves their number, and the host never sees them.

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
import torch
from numpy.lib.stride_tricks import sliding_window_view


class Speculation(enum.Enum):
    """Where a runner's drafts come from."""

    NONE = "none"  # no drafts: every decode is one token
    NGRAM = "ngram"  # prompt lookup (NgramDrafter)
    DFLASH = "dflash"  # the artifact's DFlash draft model (dflash.py)


@dataclass(frozen=True)
class DraftRequest:
    """One sequence a device drafter drafts for: the cells of the positions before its pending token (whose K/V
    is not computed yet). A sequence planned behind a verify still in flight lists them for all its drafts
    accepted: its context is as many cells shorter as that verify rejects (known on the device)."""

    cells: np.ndarray
    max_drafts: int


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        """Up to `max_drafts` tokens to follow `tokens` (the request's prompt and output so far)."""
        ...


class DeviceDrafter(Protocol):
    def draft_on_device(self, requests: list[DraftRequest], last_tokens: torch.Tensor,
                        shortfall: torch.Tensor | None) -> torch.Tensor:
        """Each request's drafts, [len(requests), at least max max_drafts] int64 on the device (not waited for).
        `last_tokens` [len(requests)]: each one's pending token; `shortfall` [len(requests)] (None: zeros): how
        many of its listed cells (<= 0) its context really has fewer, so its pending token is at position
        len(cells) + shortfall. Both on the device."""
        ...


def drafts_on_host(drafter) -> bool:
    """Whether the drafter proposes from token lists, on the host (it can draft after guessed tokens too)."""
    return getattr(drafter, "draft_on_device", None) is None


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
