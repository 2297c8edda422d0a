"""Decode-first scheduling with chunked prefill, as an explicit plan and a commit of its results.

One rule drives it: each request's computed tokens catch up with its known tokens. Each step:
  1. decode: one token for each running request whose only pending token is its newest sample, up to
     `max_decode_sequences` (rotating, so all get turns), leaving room for prefill when prompts wait;
  2. prefill: the rest of the token budget goes to pending prompts, each taking a chunk: preempted requests
     first, oldest first, then the others least recently served first, so no prompt starves.
Cells are allocated as tokens are scheduled. Every request starts from the longest cached prefix of its
tokens (prefix_cache.py); the cells of known tokens go into the cache as prompts are computed (positions
the cache already had are taken from it, the request's own copies freed) and when a request ends or is
preempted. When the pool runs dry the cache frees exactly the cells missing, least recently used first,
and only then is a request that arrived later than the one asking preempted (the latest first; recomputed
later). A waiting request is admitted only when the cells free or held only by the cache cover all its
tokens and every running request's next cells; until then no later arrival is admitted either. Arrival order is priority: the oldest request can always make progress, and neither a new arrival
nor a stream of them can push an older request out of the pool for good. A prompt that cannot get its
cells ends the step's admissions, not the running prompts' turns: the oldest of those may need its turn to
take a later one's cells.

`plan()` returns a StepPlan of plain data; `commit(plan, tokens)` applies the executor's output. A plan
may be made while the previous one still runs (one step in flight): scheduling advances num_computed at
once, a sampling chunk counts an unresolved sample, and a decode whose token is that in-flight sample names
the chunk of the previous plan that samples it (ScheduledChunk.previous_sample). Commits come in plan order.

Speculation: a request with num_draft_tokens decodes its pending token plus up to that many tokens its
drafter proposes (a device drafter's: drafted by the executor, on the device), all in one chunk that takes 1 + k
tokens of the budget and 1 + k cells. Drafts in flight count as accepted (num_computed, cells, limits: the
worst case); when the verify comes back, num_computed and the request's cells drop by the rejected ones.
A request whose verify is in flight is planned again at once, like any decode (one step in flight): its
chunk starts after all those drafts, and the executor moves it back by the rejected ones on the device,
where the accepted count is known first, its first token the last one the verify emits. A host drafter
drafts it after a guess of what the verify emits (its drafts, then the drafter's next token); a wrong guess
costs only that chunk's drafts; a device drafter (DFlash) drafts it on the device, after the acceptance.
A sampled request's draws are keyed by position, which only the device knows then: its chunk behind a verify
carries windows of draws that start as many positions early as that verify has drafts (ScheduledChunk.
draw_window), and the executor takes each row's draw at the position the verify leaves it at, on the device.
A request whose drafter proposed nothing, or whose drafts were all rejected,
decodes without drafts for 1, 2, 4 ... up to MAX_DRAFT_PAUSE steps (doubling with each such attempt in a
row) before its drafter is asked again; an accepted draft ends the pause.

Where a verifying step waited on the host before (one step in flight otherwise): a speculating request was
planned only once its verify was back. At batch 1 every verify then ran alone: the device idle while the
host read its result, committed it, drafted (a device drafter: one more round trip for the drafts) and
launched the next. At batch 32 (scripts/speculation_steps.py: 256-token prompts prefilled 8 per step, so
requests start out of phase) the requests split into two groups that alternate, each verifying every
other step: 57 steps of 15 verifying requests on average for 26 verifies a request; now 31 steps of 28.

    cells:  [ ... | pending | d1 d2 d3 ]   planned:  num_computed = position after d3 (all accepted)
                                           2 accepted: num_computed -= 1, the cell of d3 freed
    behind it, before that is known:       [ ... | pending | d1 d2 d3 | b e1 e2 ]  b: the verify's last token
                                           2 accepted: the chunk runs at d3's position, the last cell freed
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from pt2serve.runtime.cells import CellAllocator, CellTable
from pt2serve.runtime.drafter import Drafter, DeviceDrafter, drafts_on_host
from pt2serve.runtime.prefix_cache import PrefixCache
from pt2serve.runtime.request import FinishReason, Request, RequestStatus
from pt2serve.runtime.sampling import DrawPurpose
from pt2serve.runtime.step import Chunk

PLACEHOLDER_TOKEN = 0  # the host's stand-in for a token still on the device (any valid id)
# The longest run of decodes without drafts after attempts that brought nothing: a request whose text turns
# repetitive waits at most this many tokens for its drafts, and one that never does pays the wait for its
# newest token once per this many steps.
MAX_DRAFT_PAUSE = 16


@dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int  # tokens per step
    max_decode_sequences: int  # decodes per step
    min_prefill_chunk: int = 32  # a prompt is not cut into pieces shorter than this (but its remainder)
    max_context: int = 2048
    prefix_cache: bool = True  # reuse the longest cached prefix of every request's tokens
    max_sessions: int = 64  # sessions whose cached path is pinned against eviction
    session_pin_seconds: float = 600.0  # how long a session's path stays pinned after its last request
    vocab_size: int | None = None  # drafts are cut at the first id outside it (a token the model cannot embed)

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_decode_sequences < 1:
            raise ValueError("token_budget and max_decode_sequences must be at least 1")


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: int
    start: int  # position of the chunk's first token
    num_tokens: int
    samples: bool  # the chunk reaches the request's newest token: its next token is sampled
    uniform: float  # the request's draw for that sample
    previous_sample: int | None = None  # a decode of an in-flight sample: that chunk's index in the last plan
    # A verifying decode: its last len(drafts) tokens are drafted, not known (a device drafter's: placeholders).
    drafts: tuple[int, ...] = ()
    # A sampled decode behind a verify in flight: that verify's drafts, the positions it may yet fall back by.
    draw_window: int = 0


@dataclass(frozen=True)
class StepPlan:
    step: int
    chunks: tuple[ScheduledChunk, ...]
    num_decode: int

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    token: int
    finish_reason: FinishReason | None


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: CellAllocator,
                 drafter: Drafter | DeviceDrafter | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.drafter = drafter  # proposes the drafts of requests that speculate
        self.prefix_cache = PrefixCache(allocator, config.prefix_cache, config.max_sessions,
                                        config.session_pin_seconds)
        self.requests: dict[int, Request] = {}
        self._waiting: deque[int] = deque()  # FIFO of requests holding no cells
        self._running: list[int] = []  # admission order
        self._decode_turn = 0
        self._sampling_index: dict[int, int] = {}  # request id -> its sampling chunk's index in the last plan
        self._last_chunks: tuple[ScheduledChunk, ...] = ()  # the last plan's
        self.step = 0
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculation since start: drafts verified, accepted, verifying steps
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0

    # -- queue ---------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.stats.arrival_step = self.step
        self.requests[request.id] = request
        self._waiting.append(request.id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    # -- planning ------------------------------------------------------------------------------------

    def plan(self) -> StepPlan:
        self.step += 1
        scheduled: dict[int, ScheduledChunk] = {}
        prompts_wait = bool(self._waiting) or any(not self.requests[r].is_decoding for r in self._running)
        decode_cap = self.config.max_decode_sequences
        if prompts_wait:
            reserve = min(self.config.min_prefill_chunk, self.config.token_budget // 2)
            decode_cap = min(decode_cap, self.config.token_budget - reserve)
        decode_cap = max(1, min(decode_cap, self.config.token_budget))
        decode_budget = self.config.token_budget - (reserve if prompts_wait else 0)
        self._schedule_decodes(scheduled, decode_cap, max(decode_cap, decode_budget))
        num_decode = len(scheduled)
        decode_tokens = sum(c.num_tokens for c in scheduled.values())
        self._schedule_prefills(scheduled, self.config.token_budget - decode_tokens)
        plan = StepPlan(self.step, tuple(scheduled.values()), num_decode)
        self._sampling_index = {c.request_id: i for i, c in enumerate(plan.chunks) if c.samples}
        self._last_chunks = plan.chunks
        assert plan.num_tokens <= self.config.token_budget
        assert len({c.request_id for c in plan.chunks}) == len(plan.chunks)
        return plan

    def _can_decode(self, request: Request) -> bool:
        """Its pending token is known, or is sampled by the last plan (it follows that chunk there), and another
        sample stays in its limits (counting its drafts in flight as accepted)."""
        is_known = request.num_computed < len(request.tokens)
        is_fed = is_known or request.id in self._sampling_index
        within_limits = request.num_sampled < request.spec.max_new_tokens and request.length < self.config.max_context
        return request.is_decoding and is_fed and within_limits

    def _in_flight_chunk(self, request: Request) -> ScheduledChunk | None:
        """The last plan's chunk that samples the request's newest token, while that token is unknown."""
        index = self._sampling_index.get(request.id)
        if index is None or request.num_computed < len(request.tokens):
            return None
        return self._last_chunks[index]

    def _schedule_decodes(self, scheduled: dict[int, ScheduledChunk], cap: int, token_budget: int) -> None:
        """Up to `cap` decodes of one token each, plus drafts for those that speculate, in `token_budget`."""
        decoding = [r for r in self._running if self._can_decode(self.requests[r])]
        if not decoding:
            return
        self._decode_turn %= len(decoding)
        order = decoding[self._decode_turn:] + decoding[:self._decode_turn]
        self._decode_turn += cap
        chosen = order[:cap]
        draft_room = token_budget - len(chosen)  # budget tokens left for drafts, first come first served
        # One eviction for all the decodes: the cells they need that the pool lacks, not one call per decode.
        self.prefix_cache.evict(len(chosen) - self.allocator.num_free)
        paused = [r for r in chosen if self.requests[r].draft_pause]  # (before a miss now starts a pause)
        proposed = self._propose(chosen, draft_room)
        for request_id in chosen:
            request = self.requests[request_id]
            if request_id in scheduled or request.status is not RequestStatus.RUNNING:
                continue  # preempted to make room for an earlier one this step
            drafts, guess = proposed.get(request_id, ((), ()))
            drafts = drafts[:max(0, draft_room)]
            if drafts and not self._can_allocate_freely(1 + len(drafts)):
                drafts = ()  # drafts never cost another request its cells
            if self._allocate(request, 1 + len(drafts), scheduled):
                scheduled[request_id] = self._chunk(request, 1, drafts)
                request.guess = (self.step, *guess) if drafts and guess else None
                draft_room -= len(drafts)
        for request_id in paused:
            if request_id in scheduled:
                self.requests[request_id].draft_pause -= 1

    def _propose(self, chosen: list[int], room: int) -> dict[int, tuple[tuple[int, ...], tuple]]:
        """The drafts each speculating request of `chosen` may verify this step: at most its bound and `room`
        (the decodes share what is left of it first come, first served), and never more than its limits leave
        room for (the step emits up to len(drafts) + 1 tokens). A device drafter's are placeholders, drafted
        and put in place by the executor (drafter.py).

        With a host drafter, a request whose newest token is in flight drafts after a guess of what that step
        emits: its drafts, all accepted, then the drafter's next token (or that token alone,
        when those drafts were themselves drafted after a wrong guess, and so are likely all rejected). With
        each request's drafts comes that guess and how many of its tokens are the step's drafts (empty for the
        others), checked when the step is committed."""
        if self.drafter is None:
            return {}
        on_device = not drafts_on_host(self.drafter)
        vocab = self.config.vocab_size
        drafts = {}
        for request_id in chosen:
            request = self.requests[request_id]
            if not _drafts_now(request):
                continue
            limit = min(request.spec.num_draft_tokens, room,
                        request.spec.max_new_tokens - request.num_sampled - 1,
                        self.config.max_context - request.length - 1)
            if limit < 1:
                continue
            if on_device:  # the executor drafts them as it launches the step
                drafts[request_id] = ((PLACEHOLDER_TOKEN,) * limit, ())
                continue
            in_flight = self._in_flight_chunk(request)
            prior = ()
            if in_flight is not None and request.off_track_step != self.step - 1:
                prior = in_flight.drafts
            asked = limit + (in_flight is not None)  # (behind a step in flight, the first is the guess)
            proposal = self.drafter.propose(request.tokens + list(prior), asked)
            proposed = tuple(itertools.takewhile(lambda t: t >= 0 and (vocab is None or t < vocab),
                                                 (int(t) for t in proposal[:asked])))
            if in_flight is None:
                drafts[request_id] = (proposed, ())
            else:  # the first proposed token is the guess of the newest token, the rest are drafts
                drafts[request_id] = (proposed[1:], (prior + proposed[:1], len(prior)))
            if not drafts[request_id][0]:
                _missed(request)
        return drafts

    def _can_allocate_freely(self, count: int) -> bool:
        """Whether `count` cells are free, or can be freed from the prefix cache alone (no preemption)."""
        if not self.allocator.can_allocate(count):
            self.prefix_cache.evict(count - self.allocator.num_free)
        return self.allocator.can_allocate(count)

    def _schedule_prefills(self, scheduled: dict[int, ScheduledChunk], budget: int) -> None:
        prefilling = [r for r in self._running if r not in scheduled and not self.requests[r].is_decoding]
        order = sorted(prefilling + list(self._waiting), key=lambda r: _prefill_priority(self.requests[r]))
        admitting = True
        reserve = None  # the running requests' next cells (see _fits), counted once and kept up to date
        for request_id in order:
            if budget <= 0:
                break
            request = self.requests.get(request_id)
            if request is None or request_id in scheduled or request.num_unresolved:
                continue  # (a preempted request waits for its in-flight sample before it is recomputed)
            if request.status is RequestStatus.WAITING:
                if admitting and reserve is None:
                    reserve = sum(_next_cells(self.requests[r]) for r in self._running)
                if not admitting or not self._fits(request, reserve):
                    admitting = False  # first come, first served: no one after it either
                    continue
                self._admit(request)
                reserve += _next_cells(request)
            count = min(request.num_pending, budget)
            if count < request.num_pending and count < self.config.min_prefill_chunk and scheduled:
                continue  # too small a piece to be worth a cut; a later step gives it a full chunk
            if not self._allocate(request, count, scheduled):
                if request.num_computed == 0 and request.cells.length == 0:
                    self._unadmit(request)
                # The pool is full: admit no one after it (first come, first served), but let the prompts
                # already running go on. An earlier arrival among them can take a later one's cells; stopping
                # here instead, behind a preempted latecomer that can take no one's, left every running
                # request stuck for good once none of them could decode.
                admitting = False
                continue
            needed_before = _next_cells(request)
            scheduled[request_id] = self._chunk(request, count)
            if reserve is not None:  # the chunk's cells are allocated: no longer needed later
                reserve -= needed_before - _next_cells(request)
            request.last_prefill_step = self.step
            budget -= count

    def _chunk(self, request: Request, count: int, drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        """Schedule the request's next `count` tokens, and `drafts` after them (cells already allocated)."""
        start = request.num_computed
        # The next token is the in-flight sample when every known token is already scheduled.
        previous = self._sampling_index[request.id] if start >= len(request.tokens) else None
        request.num_computed += count + len(drafts)
        request.num_unverified += len(drafts)
        request.stats.prefilled_tokens += max(0, min(request.num_prompt, request.num_computed) - start)
        samples = request.num_computed == request.length
        if samples:
            request.num_unresolved += 1
        draw = samples and not request.spec.sampling.is_greedy
        uniform = request.random.uniform(request.length - 1) if draw else 0.0  # the sampled token's position
        window = len(self._last_chunks[previous].drafts) if draw and previous is not None else 0
        if request.stats.first_scheduled_step is None:
            request.stats.first_scheduled_step = self.step
        return ScheduledChunk(request.id, start, count + len(drafts), samples, uniform, previous, drafts, window)

    def _fits(self, request: Request, reserve: int) -> bool:
        """Whether a waiting request can be admitted: the cells free, or held only by the cache, cover all its
        tokens still to compute and `reserve`, the next cells of every running request (what each has left to
        prefill, or its next decode). Admitting it short of that only took cells the running requests need next: as the
        latest arrival it was preempted a step later, re-admitted from its own cached cells, and preempted
        again, step after step (three 900-token prompts on a 3,000-cell pool: 299 preemptions of the third).
        Alone it always fits: its tokens fit the pool."""
        if not self._running:
            return True
        cached, cached_unheld = 0, 0
        if not request.num_computed:
            cached, cached_unheld = self.prefix_cache.peek(request.tokens, _match_limit(request))
        needed = request.length - max(cached, request.num_computed) + reserve
        # Its cached cells that nobody holds count as evictable now, but it holds them once admitted.
        return needed <= self.allocator.num_free + self.prefix_cache.num_unheld_cells - cached_unheld

    def _admit(self, request: Request) -> None:
        """WAITING -> RUNNING, starting from the longest cached prefix of its tokens."""
        self._waiting.remove(request.id)
        self._running.append(request.id)
        request.status = RequestStatus.RUNNING
        if request.num_computed:
            return
        cells = self.prefix_cache.match(request.id, request.tokens, _match_limit(request),
                                        counted=request.stats.preemptions == 0)
        request.cells = CellTable(cells)
        request.num_computed = len(cells)
        # Only cells another request computed count as reused: after a preemption, a request that restarts
        # from its own cached cells reused nothing (it had computed them itself).
        request.stats.reused_tokens = self.prefix_cache.reused_from_others(request.id, request.num_prompt)

    def fork(self, request: Request, parent: Request) -> None:
        """Queue `request`, whose prompt is `parent`'s, on shared copies of the parent's cells for all of that
        prompt but its last token (computed again: its logits give this request's own first token). The
        parent's prompt must be scheduled; stream order puts those K/V writes before any step of this one."""
        assert request.spec.prompt_ids == parent.spec.prompt_ids and parent.num_computed >= parent.num_prompt
        shared = parent.cells.cells[: parent.num_prompt - 1].copy()
        self.allocator.share(shared)
        request.cells = CellTable(shared)
        request.num_computed = len(shared)
        request.stats.reused_tokens = len(shared)
        self.add(request)

    def _unadmit(self, request: Request) -> None:
        self._running.remove(request.id)
        self._waiting.appendleft(request.id)
        request.status = RequestStatus.WAITING

    def _allocate(self, request: Request, count: int, scheduled: dict[int, ScheduledChunk]) -> bool:
        """Give `request` `count` new cells, freeing others' cells if needed; False if impossible."""
        while not self.allocator.can_allocate(count):
            if self.prefix_cache.evict(count - self.allocator.num_free):
                continue
            # Only a later arrival gives way (ids follow arrival), the latest first.
            victim = max((r for r in self._running if r > request.id and r not in scheduled), default=None)
            if victim is None:
                return False
            self._preempt(self.requests[victim])
        request.cells.append(self.allocator.allocate(count))
        return True

    def _preempt(self, request: Request) -> None:
        """Free a running request's cells; it is recomputed (prompt and generated tokens) later, from what the
        cache still holds of them then."""
        self._let_go(request, cache=True)
        request.num_computed = 0
        self.num_preemptions += 1
        request.stats.preemptions += 1
        self._running.remove(request.id)
        self._waiting.appendleft(request.id)
        request.status = RequestStatus.WAITING

    # -- execution interface ---------------------------------------------------------------------------

    def executor_chunks(self, plan: StepPlan) -> list[Chunk]:
        chunks = []
        for c in plan.chunks:
            request = self.requests[c.request_id]
            if c.drafts:
                chunks.append(_verifying_chunk(request, c, not drafts_on_host(self.drafter)))
                continue
            if c.previous_sample is None:
                tokens = tuple(request.tokens[c.start:c.start + c.num_tokens])
            else:
                tokens = (PLACEHOLDER_TOKEN,)  # the executor puts the sampled id there on the device
            spec = request.spec
            sampling = spec.sampling if c.samples else None
            logprobs = spec.logprobs if c.samples else None
            window = ()
            if c.draw_window:  # the draws at the positions of the token it samples, from the verify's all rejected
                sampled_at = c.start + c.num_tokens
                window = tuple(request.random.uniform(p) for p in range(sampled_at - c.draw_window, sampled_at + 1))
            chunks.append(Chunk(request.cells.cells, tokens, c.start, sampling, c.uniform, c.previous_sample,
                                logprobs, _prompt_targets(request, c), spec.prompt_logprobs or 0, request.id,
                                _banned(request) if c.samples else (),
                                spec.prompt_ids if c.samples and spec.sampling.has_penalties else (),
                                c.samples and spec.grammar is not None,
                                sample_uniforms=window, draw_window=c.draw_window))
        return chunks

    def commit(self, plan: StepPlan, tokens: tuple[int | None, ...],
               verified: tuple[tuple[int, ...] | None, ...] = ()) -> list[TokenEvent]:
        """Apply a step's sampled tokens (and, per verifying chunk, the tokens it emits); finishes requests that
        hit a stop token or a length limit, at the first token that does (later ones are dropped)."""
        events = []
        for index, (chunk, token) in enumerate(zip(plan.chunks, tokens)):
            request = self.requests.get(chunk.request_id)
            if request is not None and chunk.start < request.num_prompt:
                self._cache_prompt(request)
            emitted = verified[index] if verified else None
            if request is None or (token is None and emitted is None):
                continue  # finished since (its later work, if any, is simply dropped) or nothing sampled
            assert request.num_unresolved > 0, "a sample came back that was not scheduled"
            request.num_unresolved -= 1
            if emitted is not None:
                self._resolve_drafts(request, chunk, len(emitted) - 1, plan.step)
            else:
                emitted = (token,)
            if request.guess is not None and request.guess[0] > plan.step:  # drafted after a guess of this step
                follower, guessed, num_drafts = request.guess
                if guessed != emitted:
                    request.off_track_step = follower
                if guessed[:num_drafts] != emitted[:num_drafts]:
                    request.unjudged_step = follower
                request.guess = None
            for new_token in emitted:
                request.tokens.append(new_token)
                request.stats.completion_tokens += 1
                reason = self._finish_reason(request, new_token)
                events.append(TokenEvent(request.id, new_token, reason))
                if reason is not None:
                    self.finish(request.id, reason)
                    break
        return events

    def _cache_prompt(self, request: Request) -> None:
        """Its prompt's cells so far are written: cache them, so later prompts that share them start from them.
        Where the cache already had a position (another request computed the same prefix first), the request
        takes the cache's cell and frees its copy. A copy kept would double the request's footprint with
        cells that its held path protects from eviction and no preemption frees: a long prompt computed
        beside its twin could fill the pool and leave every request waiting for good."""
        computed = min(request.cells.length, request.num_prompt)
        own = request.cells.cells[:computed]
        cached = self.prefix_cache.insert(request.id, request.tokens[:computed], own)
        copies = np.flatnonzero(cached != own)
        if len(copies):
            # Stream order keeps this safe: a step in flight that still reads or writes a copy runs before any
            # later step that writes the freed cell for someone else.
            self.allocator.share(cached[copies])
            self.allocator.free(own[copies].copy())
            own[copies] = cached[copies]

    def _resolve_drafts(self, request: Request, chunk: ScheduledChunk, num_accepted: int, step: int) -> None:
        """The accepted drafts' cells hold their tokens' K/V; the rejected ones are no longer counted computed, and
        as many cells go from the end of the request's cells: a chunk planned behind this one took its cells
        for all of these drafts accepted, and runs (on the device) that many positions earlier."""
        rejected = len(chunk.drafts) - num_accepted
        request.num_unverified -= len(chunk.drafts)
        request.stats.draft_tokens += len(chunk.drafts)
        request.stats.accepted_tokens += num_accepted
        request.stats.verify_steps += 1
        self.num_draft_tokens += len(chunk.drafts)
        self.num_accepted_tokens += num_accepted
        self.num_verify_steps += 1
        if num_accepted:
            request.draft_misses = 0
        elif step != request.unjudged_step:  # (drafts that followed rejected ones: that miss is counted already)
            _missed(request)
        if request.status is RequestStatus.RUNNING:  # (a preempted request holds none of these cells any more)
            request.num_computed -= rejected
            self.allocator.free(request.cells.truncate(request.num_computed))

    def _finish_reason(self, request: Request, token: int) -> FinishReason | None:
        spec = request.spec
        if token in spec.stop_token_ids:
            return FinishReason.STOP
        if request.stats.completion_tokens >= spec.max_new_tokens:
            return FinishReason.LENGTH
        if len(request.tokens) >= self.config.max_context:
            return FinishReason.LENGTH
        return None

    def fail(self, plan: StepPlan, error: str) -> list[int]:
        """A step failed: fail exactly the requests in it; returns their ids."""
        failed = []
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if request is not None:
                request.error = error
                self.finish(request.id, FinishReason.ERROR)
                failed.append(request.id)
        return failed

    def finish(self, request_id: int, reason: FinishReason) -> Request | None:
        """End a request (any status); the cells of its known tokens go to the prefix cache (but those of a
        failed step), pinned under its session if it names one."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request_id)
        elif request.status is RequestStatus.RUNNING:
            self._running.remove(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._let_go(request, cache=reason is not FinishReason.ERROR)
        return request

    def _let_go(self, request: Request, cache: bool) -> None:
        """Free the request's cells, first caching those of its known tokens (not the cells of samples still
        in flight, whose tokens are unknown). Every cell was written by a step already launched (a failed
        launch fails its requests first); the newest may still be written by the step in flight, and stream
        order puts that write before any later reader."""
        cells = request.cells.truncate(0)
        if cache:
            known = min(len(cells), len(request.tokens))
            self.prefix_cache.insert(request.id, request.tokens[:known], cells[:known])
            if request.spec.session_id is not None:
                self.prefix_cache.pin(request.spec.session_id, request.id)
        self.prefix_cache.release(request.id)
        self.allocator.free(cells)

    def num_leaked_cells(self) -> int:
        """Cells in use that no request or prefix-cache node holds: 0 unless a cell leaked.
        O(cells held), so callers count it when idle."""
        held = [r.cells.cells for r in self.requests.values()]
        held += self.prefix_cache.held_cells()
        owned = len(np.unique(np.concatenate(held))) if held else 0
        return self.allocator.num_used - owned


def _next_cells(request: Request) -> int:
    """The cells a running request needs next: the rest of its prompt, or one for its next decode."""
    return max(1, request.num_pending)


def _match_limit(request: Request) -> int:
    """How much of its tokens a request may take from the cache: all but the newest, whose logits give the next
    token (none for a prompt to be scored: reused cells come without the logits of their positions)."""
    return 0 if request.spec.prompt_logprobs is not None else len(request.tokens) - 1


def _prefill_priority(request: Request) -> tuple[int, ...]:
    """Preempted requests first, oldest first; then round-robin: the prompt served longest ago (never, for
    new arrivals) goes first. Ranking a preempted request as a new arrival would put every later arrival
    ahead of it, step after step."""
    if request.stats.preemptions:
        return (0, request.id)
    return (1, request.last_prefill_step, request.id)


def _drafts_now(request: Request) -> bool:
    """Whether the request asks its drafter for this decode (it speculates, and is not pausing)."""
    return bool(request.spec.num_draft_tokens) and not request.draft_pause


def _missed(request: Request) -> None:
    """A drafting attempt brought no accepted token: pause drafting, twice as long as after the last miss."""
    request.draft_misses += 1
    request.draft_pause = min(MAX_DRAFT_PAUSE, 2 ** (request.draft_misses - 1))


def _verifying_chunk(request: Request, chunk: ScheduledChunk, drafts_on_device: bool) -> Chunk:
    """The executor's chunk for a verifying decode: its pending token and drafts (or their placeholders, which
    the executor's device drafter fills), and the request's draws for each row's position (row j decides the
    token at position start + 1 + j), from draw_window positions earlier behind a verify in flight."""
    spec = request.spec
    num_rows = len(chunk.drafts) + 1
    positions = range(chunk.start + 1 - chunk.draw_window, chunk.start + 1 + num_rows)
    if spec.sampling.is_greedy:
        accept, sample = (0.0,) * (num_rows - 1), (0.0,) * num_rows
    else:
        accept = tuple(request.random.uniform(p, DrawPurpose.ACCEPT) for p in positions[:-1])
        sample = tuple(request.random.uniform(p, DrawPurpose.SAMPLE) for p in positions)
    pending = request.tokens[chunk.start] if chunk.previous_sample is None else PLACEHOLDER_TOKEN
    return Chunk(request.cells.cells, (pending,) + chunk.drafts, chunk.start, spec.sampling,
                 previous_sample=chunk.previous_sample, request_id=request.id, drafts=chunk.drafts,
                 accept_uniforms=accept, sample_uniforms=sample, drafts_on_device=drafts_on_device,
                 draw_window=chunk.draw_window)


def _banned(request: Request) -> tuple[int, ...]:
    """The tokens its sample may not be (its stop tokens, while it has fewer than min_tokens)."""
    spec = request.spec
    sample_index = request.num_sampled - 1  # this sample is counted already
    if sample_index >= spec.sampling.min_tokens:
        return ()
    return tuple(sorted(spec.stop_token_ids))


def _prompt_targets(request: Request, chunk: ScheduledChunk) -> tuple[int, ...]:
    """For a request whose prompt is scored: the prompt tokens that follow the chunk's first tokens."""
    if request.spec.prompt_logprobs is None:
        return ()
    end = min(chunk.start + chunk.num_tokens, request.num_prompt - 1)
    return tuple(request.spec.prompt_ids[chunk.start + 1:end + 1])
