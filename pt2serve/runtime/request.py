"""A request's own state: its tokens, how many are computed (in cells), its cells and counters.

Only the scheduler changes `status`; the request owns its tokens and counters.

    tokens:  [ p0 p1 ... p(n-1) | g0 g1 ... ]  ? ? d d   prompt, then generated tokens known on the host,
                                                           then num_unresolved samples still in flight (?)
                                                           and num_unverified drafts in flight (d)
    cells:   [ c0 c1 ... ]                                 one per scheduled token, in position order
    num_computed <= length: tokens scheduled into cells (their K/V written by a step that ran or is queued).
    The newest token (known or in flight) is fed in a later step (a decode).

One step may be in flight while the next is planned, so a decode can be scheduled before the token it
feeds is known: its sample is counted in num_unresolved until the step's ids come back (commit). Drafts
in flight count as accepted (the worst case for cells and limits) until their verify comes back: then
num_computed and the cells drop by the rejected ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pt2serve.runtime.cells import CellTable
from pt2serve.runtime.sampling import RequestRandom, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # nothing computed yet or preempted
    RUNNING = "running"  # holds cells; prefilling or decoding
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class RequestSpec:
    """What a caller asks for (token ids already; the runner tokenizes text)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 16
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    session_id: str | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # each sampled token's log probability, with this many alternatives
    prompt_logprobs: int | None = None  # each prompt token's (but the first), with this many alternatives
    grammar: Any = None  # a compiled grammar (grammar.py) the generated tokens must follow
    num_draft_tokens: int = 0  # speculate: verify up to this many drafted tokens per step (0: plain decode)


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose cells another request computed (prefix cache, or a parent's)
    prefilled_tokens: int = 0  # prompt tokens computed by this request
    completion_tokens: int = 0
    preemptions: int = 0  # times its cells were taken back and its tokens recomputed later
    arrival_step: int = 0
    first_scheduled_step: int | None = None
    # Speculation: tokens drafted and verified, how many of them were accepted, and in how many steps.
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0


@dataclass
class Request:
    id: int
    spec: RequestSpec
    tokens: list[int]
    random: RequestRandom
    cells: CellTable = field(default_factory=CellTable)
    num_computed: int = 0
    num_unresolved: int = 0  # samples scheduled whose tokens have not come back yet
    num_unverified: int = 0  # drafts scheduled whose verify has not come back yet
    status: RequestStatus = RequestStatus.WAITING
    last_prefill_step: int = -1  # the step that last gave it a prefill chunk (-1: never)
    # Speculation (scheduler.py): drafting attempts in a row that brought no accepted token, and how many
    # decodes it makes without drafts (one step in flight) before its drafter is asked again.
    draft_misses: int = 0
    draft_pause: int = 0
    # A chunk drafted while the step before was in flight follows what that step was guessed to emit: (the
    # chunk's step, the guessed tokens, how many of them are that step's own drafts) until that step is
    # committed. Then off_track_step names the chunk if the guess was wrong (its drafts follow tokens that did
    # not happen), and unjudged_step too if that step's drafts were rejected: that is their miss, not the chunk's.
    guess: tuple[int, tuple[int, ...], int] | None = None
    off_track_step: int = -1
    unjudged_step: int = -1
    finish_reason: FinishReason | None = None
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def num_prompt(self) -> int:
        return len(self.spec.prompt_ids)

    @property
    def length(self) -> int:
        """Tokens known or in flight (drafts in flight counted as accepted)."""
        return len(self.tokens) + self.num_unresolved + self.num_unverified

    @property
    def num_pending(self) -> int:
        """Tokens (known or in flight) not yet scheduled."""
        return self.length - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Only the newest (sampled) token is pending."""
        return self.num_computed >= self.num_prompt and self.num_pending == 1

    @property
    def num_sampled(self) -> int:
        """Completion tokens scheduled so far, known or in flight (drafts in flight counted as accepted)."""
        return self.stats.completion_tokens + self.num_unresolved + self.num_unverified
