"""Scheduler tests on plain data: hand-made executor outputs, no artifact, no device."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest

from pt2serve.runtime.cells import CellAllocator
from pt2serve.runtime.request import FinishReason, Request, RequestSpec, RequestStatus
from pt2serve.runtime.sampling import RequestRandom
from pt2serve.runtime.scheduler import PLACEHOLDER_TOKEN, Scheduler, SchedulerConfig
from pt2serve.runtime.step import Chunk

NEXT_TOKEN = 5


def make_scheduler(num_cells=4096, budget=64, max_decode=64, min_chunk=8, **kwargs) -> Scheduler:
    config = SchedulerConfig(token_budget=budget, max_decode_sequences=max_decode, min_prefill_chunk=min_chunk,
                             max_context=1024, **kwargs)
    return Scheduler(config, CellAllocator(num_cells))


_ids = iter(range(1, 1_000_000))


def add_request(scheduler: Scheduler, prompt_len: int, max_new: int = 1000, **spec) -> Request:
    prompt = tuple(range(1, prompt_len + 1))
    request = Request(next(_ids), RequestSpec(prompt, max_new, **spec), list(prompt), RequestRandom(0))
    scheduler.add(request)
    return request


def assert_pool_returns_to_empty(scheduler: Scheduler) -> None:
    """Every cell still in use is the prefix cache's alone, and clearing the cache empties the pool."""
    assert scheduler.allocator.num_used == scheduler.prefix_cache.num_cells
    scheduler.prefix_cache.clear()
    assert scheduler.allocator.num_used == 0


def run_step(scheduler: Scheduler):
    """Plan, then commit as if the executor sampled NEXT_TOKEN wherever asked."""
    plan = scheduler.plan()
    tokens = tuple(NEXT_TOKEN if chunk.samples else None for chunk in plan.chunks)
    return plan, scheduler.commit(plan, tokens)


def test_decode_first_then_prefill_fills_budget():
    scheduler = make_scheduler(budget=16, min_chunk=4)
    decoders = [add_request(scheduler, 3) for _ in range(4)]
    while not all(r.is_decoding for r in decoders):
        run_step(scheduler)
    add_request(scheduler, 100)
    plan, _ = run_step(scheduler)
    assert plan.num_decode == 4
    assert [c.num_tokens for c in plan.chunks[:4]] == [1, 1, 1, 1]
    assert plan.num_tokens == 16  # the prompt takes the 12 tokens left
    assert not plan.chunks[-1].samples


def test_chunked_prefill_samples_only_at_the_end():
    scheduler = make_scheduler(budget=10, min_chunk=1)
    request = add_request(scheduler, 25)
    plans = [run_step(scheduler)[0] for _ in range(3)]
    assert [p.chunks[0].num_tokens for p in plans] == [10, 10, 5]
    assert [p.chunks[0].samples for p in plans] == [False, False, True]
    assert request.tokens[-1] == NEXT_TOKEN and request.is_decoding


def test_no_waiting_prompt_starves_while_32_sequences_decode():
    scheduler = make_scheduler(budget=64, max_decode=64, min_chunk=16)
    for _ in range(32):
        add_request(scheduler, 4)
    for _ in range(3):
        run_step(scheduler)
    waiting = [add_request(scheduler, 200) for _ in range(6)]
    first_step = {}
    for _ in range(60):
        plan, _ = run_step(scheduler)
        assert plan.num_decode <= 64 - 16 or not any(not r.is_decoding for r in waiting)
        for chunk in plan.chunks:
            first_step.setdefault(chunk.request_id, plan.step)
    arrival = waiting[0].stats.arrival_step
    # Round-robin: every waiting prompt gets its first chunk within a handful of steps.
    assert all(first_step[r.id] - arrival <= len(waiting) + 1 for r in waiting)
    # ... and all of them finish prefill while the 32 keep decoding.
    assert all(r.num_computed >= r.num_prompt for r in waiting)


def test_decode_cap_rotates_decoders():
    scheduler = make_scheduler(budget=8, max_decode=4, min_chunk=1)
    requests = [add_request(scheduler, 1) for _ in range(8)]
    run_step(scheduler)  # all 8 prompts of 1 token prefill together (8 tokens)
    counts = {r.id: 0 for r in requests}
    for _ in range(6):
        plan, _ = run_step(scheduler)
        assert plan.num_decode == 4
        for chunk in plan.chunks:
            counts[chunk.request_id] += 1
    assert set(counts.values()) == {3}


def test_finish_by_length_and_stop_token_frees_cells():
    scheduler = make_scheduler()
    by_length = add_request(scheduler, 5, max_new=3)
    by_stop = add_request(scheduler, 5, stop_token_ids=frozenset({NEXT_TOKEN}))
    events = []
    while scheduler.has_work():
        events += run_step(scheduler)[1]
    reasons = {e.request_id: e.finish_reason for e in events if e.finish_reason}
    assert reasons == {by_length.id: FinishReason.LENGTH, by_stop.id: FinishReason.STOP}
    assert by_length.stats.completion_tokens == 3
    assert_pool_returns_to_empty(scheduler)


class ContextModel:
    """Stands in for the executor: each cell keeps the (position, token) last written to it, and a sampled
    token is a hash of everything the chunk's cells hold for positions 0..end-1. A recomputation that
    feeds the wrong tokens, a cell still shared with another sequence, or a stale cell changes the token."""

    def __init__(self) -> None:
        self.cells: dict[int, tuple[int, int]] = {}

    def step(self, chunks: list[Chunk]) -> tuple[int | None, ...]:
        for chunk in chunks:  # every write of the step lands before any read, as in a forward
            for position, token in zip(range(chunk.start, chunk.end), chunk.tokens):
                self.cells[int(chunk.cells[position])] = (position, token)
        tokens = []
        for chunk in chunks:
            context = [self.cells.get(int(cell)) for cell in chunk.cells[: chunk.end]]
            assert all(entry is not None and entry[0] == p for p, entry in enumerate(context)), "a stale cell"
            tokens.append(zlib.crc32(repr(context).encode()) % 1000 if chunk.sampling is not None else None)
        return tuple(tokens)


def run_with_model(scheduler: Scheduler, model: ContextModel, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_work():
            return
        plan = scheduler.plan()
        scheduler.commit(plan, model.step(scheduler.executor_chunks(plan)))
    raise AssertionError("the scheduler did not finish its requests")


def run_with_model_in_flight(scheduler: Scheduler, model: ContextModel, max_steps: int = 10_000) -> None:
    """As the runner drives it: each plan is made (and run) before the previous one's tokens are committed; a
    decode fed by an in-flight sample reads it from the previous step's output, as the device does."""
    in_flight, previous = None, ()
    for _ in range(max_steps):
        if not scheduler.has_work() and in_flight is None:
            return
        plan = scheduler.plan()
        chunks = [dataclasses.replace(c, tokens=(previous[c.previous_sample],)) if c.previous_sample is not None
                  else c for c in scheduler.executor_chunks(plan)]
        tokens = model.step(chunks)
        if in_flight is not None:
            scheduler.commit(*in_flight)
        in_flight, previous = ((plan, tokens), tokens) if plan.chunks else (None, ())
    raise AssertionError("the scheduler did not finish its requests")


@pytest.mark.parametrize("drive", [run_with_model, run_with_model_in_flight], ids=["in-turn", "one-in-flight"])
def test_preempted_requests_produce_their_solo_tokens(drive):
    """A pool far too small for the load: requests are preempted and recomputed, and every one produces
    exactly the tokens it produces alone on an ample pool, with or without a step in flight."""
    shapes = [(15 + 3 * i, 8 + 2 * i) for i in range(8)]  # (prompt, new tokens); the longest needs 58 cells
    solo = []
    for i, (prompt, new) in enumerate(shapes):
        scheduler = make_scheduler(num_cells=512, budget=32, min_chunk=1)
        request = add_request_with(scheduler, [1000 + i] + list(range(1, prompt)), max_new=new)
        run_with_model(scheduler, ContextModel())
        assert request.stats.preemptions == 0
        solo.append(request.tokens)

    scheduler = make_scheduler(num_cells=96, budget=32, min_chunk=1)
    model = ContextModel()
    crowded = [add_request_with(scheduler, [1000 + i] + list(range(1, prompt)), max_new=new)
               for i, (prompt, new) in enumerate(shapes)]
    drive(scheduler, model)
    assert sum(r.stats.preemptions for r in crowded) >= 2, [r.stats.preemptions for r in crowded]
    assert scheduler.num_preemptions == sum(r.stats.preemptions for r in crowded)
    for request, expected in zip(crowded, solo):
        assert request.finish_reason is FinishReason.LENGTH
        assert request.tokens == expected, f"request {request.id} ({request.stats.preemptions} preemptions)"
    assert_pool_returns_to_empty(scheduler)


def test_failed_step_fails_only_its_requests():
    scheduler = make_scheduler(budget=4, min_chunk=4)
    first = add_request(scheduler, 4)
    second = add_request(scheduler, 4)
    plan = scheduler.plan()
    assert [c.request_id for c in plan.chunks] == [first.id]
    assert scheduler.fail(plan, "boom") == [first.id]
    assert first.finish_reason is FinishReason.ERROR and first.error == "boom"
    assert second.status is RequestStatus.WAITING
    while scheduler.has_work():
        run_step(scheduler)
    assert second.stats.completion_tokens > 0


def test_a_preempted_request_is_not_starved_by_a_stream_of_new_arrivals():
    """Under steady pool pressure a new short request arrives every step. A long request that arrives
    later waits for room in its turn (first come, first served); it must still finish while arrivals go on,
    rather than wait behind each new arrival for good (seen as a stream silent for minutes under a soak)."""
    scheduler = make_scheduler(num_cells=160, budget=64, min_chunk=8)
    model, shorts, long = ContextModel(), [], None
    for step in range(3000):
        shorts.append(add_request_with(scheduler, [2000 + step] + list(range(1, 24)), max_new=24))
        if step == 40:
            long = add_request_with(scheduler, [1] + list(range(2, 100)), max_new=48)
        plan = scheduler.plan()
        scheduler.commit(plan, model.step(scheduler.executor_chunks(plan)))
        if long is not None and long.finish_reason is not None:
            break
    assert long.finish_reason is FinishReason.LENGTH, f"still waiting after 3000 steps ({long.stats.preemptions} preemptions)"
    assert long.stats.preemptions <= 1
    assert step < 500, f"finished only after {step - 40} steps"
    run_with_model(scheduler, model)
    assert all(r.finish_reason is FinishReason.LENGTH for r in shorts)
    assert_pool_returns_to_empty(scheduler)


def add_request_with(scheduler: Scheduler, prompt: list[int], max_new: int = 4, **spec) -> Request:
    request = Request(next(_ids), RequestSpec(tuple(prompt), max_new, **spec), list(prompt), RequestRandom(0))
    scheduler.add(request)
    return request


class MixedTraffic:
    """The soak's mix on plain data, for a context of `context` tokens: long prompts with long outputs,
    multi-turn sessions that extend their history, prompts sharing one prefix, short requests, and
    cancellations, keeping up to 96 requests live."""

    def __init__(self, scheduler: Scheduler, seed: int, context: int) -> None:
        self.scheduler, self.rng, self.context = scheduler, random.Random(seed), context
        self.shared = self.ids(64)
        self.histories: dict[str, list[int]] = {}
        self.live: dict[int, Request] = {}

    def ids(self, count: int) -> list[int]:
        return [self.rng.randrange(256) for _ in range(count)]

    def arrive(self) -> None:
        rng, context, session = self.rng, self.context, None
        kind = rng.random()
        if kind < 0.05:
            prompt, max_new = self.ids(rng.randint(context // 4, context // 2)), context // 4
        elif kind < 0.2:
            session = f"s{rng.randrange(60)}"
            prompt, max_new = self.histories.get(session, self.ids(rng.randint(4, 32))) + self.ids(8), 16
            if len(prompt) + max_new >= context:
                prompt = self.ids(8)
        elif kind < 0.3:
            prompt, max_new = self.shared + self.ids(rng.randint(1, 16)), 16
        else:
            prompt, max_new = self.ids(rng.randint(1, 48)), rng.choice((rng.randint(1, 48), 200))
        request = add_request_with(self.scheduler, prompt, max_new, session_id=session)
        self.live[request.id] = request

    def step(self) -> None:
        while len(self.live) < 96 and self.rng.random() < 0.5:
            self.arrive()
        if self.live and self.rng.random() < 0.02:
            cancelled = self.rng.choice(list(self.live))
            self.scheduler.finish(self.live.pop(cancelled).id, FinishReason.CANCELLED)

    def commit(self, plan) -> None:
        tokens = tuple(self.rng.randrange(256) if c.samples else None for c in plan.chunks)
        for event in self.scheduler.commit(plan, tokens):
            request = self.live.pop(event.request_id, None) if event.finish_reason else None
            if request is not None and request.spec.session_id is not None:
                self.histories[request.spec.session_id] = list(request.tokens)


@pytest.mark.parametrize("seed", [11, 14])
def test_mixed_traffic_on_a_pool_of_one_context_never_stalls(seed):
    """A pool of one max-context sequence under the soak's mix, one step in flight as the runner keeps it:
    whenever nothing is in flight and requests remain, the plan has work. A soak of the 8B stalled for good
    here: a preempted latecomer first in the prefill order could take no one's cells, and admission stopped
    at it, before the earlier prompts that could (these seeds stall so within 4,300 steps)."""
    scheduler = make_scheduler(num_cells=1025, budget=512, max_decode=512, min_chunk=32, max_sessions=32)
    traffic, in_flight, step = MixedTraffic(scheduler, seed, context=1024), None, 0
    while step < 4000 or in_flight is not None or scheduler.has_work():  # 4,000 steps of arrivals, then drain
        if step < 4000:
            traffic.step()
        plan = scheduler.plan()
        if in_flight is not None:
            traffic.commit(in_flight)
        elif scheduler.has_work():
            assert plan.chunks, (f"stalled at step {step}: {scheduler.num_running} running, {scheduler.num_waiting} "
                                 f"waiting, {scheduler.allocator.num_free} cells free")
        in_flight = plan if plan.chunks else None
        step += 1
    assert scheduler.num_preemptions > 100 and scheduler.num_leaked_cells() == 0


def test_twin_prompts_prefilled_in_one_step_keep_one_copy_of_their_cells():
    """Two requests with one prompt, computed in the same step, each write their own cells; once cached, the
    second takes the first's and frees its copies. Kept, such copies double a request's footprint with cells
    that its cached path protects from eviction and no preemption frees."""
    scheduler = make_scheduler(budget=256)
    first, second = add_request(scheduler, 100), add_request(scheduler, 100)
    plan, _ = run_step(scheduler)
    assert [c.num_tokens for c in plan.chunks] == [100, 100]
    assert scheduler.allocator.num_used == 100
    assert (second.cells.cells == first.cells.cells).all()
    run_to_end(scheduler)
    assert_pool_returns_to_empty(scheduler)


# -- prefix reuse ---------------------------------------------------------------------------------------------


def run_to_end(scheduler: Scheduler) -> None:
    while scheduler.has_work():
        run_step(scheduler)


def test_any_request_reuses_the_longest_cached_prefix():
    scheduler = make_scheduler()
    add_request_with(scheduler, list(range(1, 21)), max_new=2)
    run_to_end(scheduler)
    second = add_request_with(scheduler, list(range(1, 16)) + [99, 98], max_new=2)
    plan, _ = run_step(scheduler)
    assert second.stats.reused_tokens == 15 and plan.chunks[0].start == 15
    assert second.stats.prefilled_tokens == 2
    run_to_end(scheduler)
    # A session names nothing the cache needs: an unrelated prompt under a session id reuses nothing.
    cold = add_request_with(scheduler, [500, 501, 502], session_id="s")
    run_to_end(scheduler)
    assert cold.stats.reused_tokens == 0
    # Tokens looked up: 20 + 17 + 3; reused: 15.
    assert scheduler.prefix_cache.hit_rate == pytest.approx(15 / 40)
    assert_pool_returns_to_empty(scheduler)


def test_a_conversation_whose_reply_comes_back_retokenized_reuses_every_earlier_turn():
    """Each turn's prompt is the last turn's prompt, the reply as the client re-encoded it (other ids than
    the ones sampled), and a new message: the reuse covers every earlier prompt in full."""
    scheduler = make_scheduler(min_chunk=1)
    prompt = [256] + list(range(10, 40))
    for turn in range(4):
        request = add_request_with(scheduler, prompt, max_new=3)
        run_to_end(scheduler)
        assert request.tokens[len(prompt):] == [NEXT_TOKEN] * 3
        assert request.stats.reused_tokens == (0 if turn == 0 else previous_length)
        previous_length = len(prompt)
        prompt = prompt + [60 + turn, 61 + turn] + [100 + turn] * 5  # the reply re-encoded, then a new message
    assert_pool_returns_to_empty(scheduler)


def test_concurrent_prompts_reuse_a_shared_prefix_as_soon_as_it_is_computed():
    scheduler = make_scheduler(budget=40, min_chunk=8)
    system = list(range(1, 61))
    first = add_request_with(scheduler, system + [70, 71], max_new=50)
    run_step(scheduler)
    run_step(scheduler)  # the first's prompt is computed and committed; it keeps decoding
    second = add_request_with(scheduler, system + [80], max_new=2)
    run_step(scheduler)
    assert first.status is RequestStatus.RUNNING
    assert second.stats.reused_tokens == 60 and second.stats.prefilled_tokens == 1


def test_the_cache_frees_exactly_what_a_step_needs_before_anything_is_preempted():
    scheduler = make_scheduler(num_cells=41, budget=64, min_chunk=1)  # 40 usable cells
    old = list(range(1, 21))
    add_request_with(scheduler, old, max_new=1)
    run_to_end(scheduler)
    assert scheduler.prefix_cache.num_cells == 20  # 20 prompt tokens (the sample was never fed back)
    newer = list(range(100, 110))
    add_request_with(scheduler, newer, max_new=1)
    run_to_end(scheduler)
    assert scheduler.prefix_cache.num_cells == 30
    big = add_request_with(scheduler, list(range(200, 221)), max_new=1)
    run_to_end(scheduler)  # needs 21 cells of the 10 free: 11 come from the least recently used path's tail
    assert big.stats.completion_tokens == 1 and scheduler.prefix_cache.num_cells == 9 + 10 + 21
    later = add_request_with(scheduler, newer + [1], max_new=1)
    run_to_end(scheduler)  # its one new cell comes from the same tail; the newer path is whole
    assert later.stats.reused_tokens == 10
    again = add_request_with(scheduler, old, max_new=1)
    run_step(scheduler)
    assert again.stats.reused_tokens == 8  # what is left of the older path
    run_to_end(scheduler)
    assert_pool_returns_to_empty(scheduler)


def test_a_steps_decodes_take_their_cells_from_the_cache_in_one_eviction():
    scheduler = make_scheduler(num_cells=41, budget=64, min_chunk=1)  # 40 usable cells
    add_request_with(scheduler, list(range(100, 120)), max_new=1)
    run_to_end(scheduler)  # 20 cells cached
    for start in (5, 6, 7, 8):
        add_request_with(scheduler, [start, 1, 2, 3], max_new=10)
    run_step(scheduler)  # 16 prompt cells: 4 left free
    run_step(scheduler)  # 4 decodes take them
    asked = []
    evict = scheduler.prefix_cache.evict
    scheduler.prefix_cache.evict = lambda count: asked.append(count) or evict(count)
    plan, _ = run_step(scheduler)
    assert plan.num_decode == 4 and asked == [4]
    assert scheduler.prefix_cache.num_cells == 20 - 4 + 16  # (the decoders' prompts are cached too)


def test_a_session_keeps_its_path_while_unpinned_ones_are_evicted():
    scheduler = make_scheduler(num_cells=41, budget=64, min_chunk=1)
    chat = list(range(1, 16))
    add_request_with(scheduler, chat, max_new=1, session_id="chat")
    run_to_end(scheduler)
    add_request_with(scheduler, list(range(100, 116)), max_new=1)  # used after the session's, unpinned
    run_to_end(scheduler)
    add_request_with(scheduler, list(range(200, 221)), max_new=1)  # needs 21 of 10 free: 11 evicted
    run_to_end(scheduler)
    follow_up = add_request_with(scheduler, chat + [50])
    run_step(scheduler)
    assert follow_up.stats.reused_tokens == 15


def test_a_preempted_request_restarts_from_what_the_cache_kept_of_it():
    scheduler = make_scheduler(num_cells=41, budget=64, min_chunk=1)  # 40 usable cells
    pair = [add_request_with(scheduler, list(range(start, start + 16)), max_new=new)
            for start, new in ((1, 6), (100, 10))]
    computed, restarts = {r.id: 0 for r in pair}, []
    while scheduler.has_work():
        plan, _ = run_step(scheduler)
        for chunk in plan.chunks:
            if chunk.start < computed[chunk.request_id]:
                restarts.append(chunk.start)
            computed[chunk.request_id] = chunk.start + chunk.num_tokens
    # Both decode until the pool runs dry and the second is preempted. It restarts from the cells of its
    # known tokens, generated ones included (all but the one cell the first needed), not from its prompt.
    assert restarts == [16 + 4 - 1]
    assert [r.stats.completion_tokens for r in pair] == [6, 10]
    assert [r.stats.reused_tokens for r in pair] == [0, 0]  # its own cells: nothing came from another request
    assert scheduler.prefix_cache.hit_rate == 0.0  # nor in the metric (its own 19 cells counted before)
    assert_pool_returns_to_empty(scheduler)


def test_prompts_that_do_not_fit_together_wait_for_room_instead_of_going_back_and_forth():
    """Three 900-token prompts on a 3,000-cell pool, as a soak sent them: the third, admitted while the others
    still had to grow, is preempted once and then waits until its tokens fit (it was re-admitted from its own
    cached cells and preempted again each step: 299 times here, 18 in the soak)."""
    scheduler = make_scheduler(num_cells=3001, budget=2048, max_decode=2048, min_chunk=32)
    scheduler.config = dataclasses.replace(scheduler.config, max_context=2048)
    crowded = [add_request_with(scheduler, [1000 + i] + list(range(1, 900)), max_new=400) for i in range(3)]
    run_with_model_in_flight(scheduler, ContextModel())
    assert [r.stats.preemptions for r in crowded] == [0, 0, 1]
    assert [r.stats.reused_tokens for r in crowded] == [0, 0, 0]
    assert all(r.finish_reason is FinishReason.LENGTH for r in crowded)
    assert_pool_returns_to_empty(scheduler)


def test_the_latest_arrival_gives_way_first():
    """Four requests decode on a pool with no cell left: a cell for an earlier one comes from the latest
    arrival, preempted; the two in between keep running (with three, the latest is also the first later
    arrival, and the order would not show)."""
    # 20 usable cells: the four prompts and each one's next cell, which admission makes sure of.
    scheduler = make_scheduler(num_cells=21, budget=64, min_chunk=1)
    requests = [add_request_with(scheduler, list(range(start, start + 4)), max_new=8) for start in (1, 100, 200, 300)]
    run_step(scheduler)  # all four prompts in one step
    run_step(scheduler)  # one decode each: the last free cells
    assert scheduler.allocator.num_free == 0 and all(r.is_decoding for r in requests)
    assert [r.stats.preemptions for r in requests] == [0, 0, 0, 0]
    run_step(scheduler)
    assert [r.stats.preemptions for r in requests] == [0, 0, 0, 1]
    while scheduler.has_work():
        run_step(scheduler)
    assert_pool_returns_to_empty(scheduler)


# -- planning with one step in flight --------------------------------------------------------------------


def test_a_plan_made_while_the_last_runs_decodes_its_in_flight_samples():
    scheduler = make_scheduler(min_chunk=1)
    request = add_request(scheduler, 5, max_new=3)
    prefill = scheduler.plan()
    decode = scheduler.plan()  # before the prefill's sample is known
    (chunk,) = decode.chunks
    assert chunk.start == 5 and chunk.previous_sample == 0 and chunk.samples
    (executor_chunk,) = scheduler.executor_chunks(decode)
    assert executor_chunk.previous_sample == 0 and executor_chunk.tokens == (PLACEHOLDER_TOKEN,)
    assert request.num_unresolved == 2 and request.num_computed == 6
    scheduler.commit(prefill, (11,))
    third = scheduler.plan()  # feeds on the decode's in-flight sample
    assert third.chunks[0].start == 6 and third.chunks[0].previous_sample == 0
    assert not scheduler.plan().chunks  # three samples are scheduled: max_new reached, nothing more to plan
    scheduler.commit(decode, (12,))
    events = scheduler.commit(third, (13,))
    assert request.tokens[5:] == [11, 12, 13]
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert_pool_returns_to_empty(scheduler)


def test_a_stop_token_found_late_drops_the_queued_decode_and_its_cell():
    scheduler = make_scheduler(min_chunk=1, max_sessions=2)
    request = add_request(scheduler, 4, stop_token_ids=frozenset({9}), session_id="s")
    prefill = scheduler.plan()
    decode = scheduler.plan()
    events = scheduler.commit(prefill, (9,))
    assert events[0].finish_reason is FinishReason.STOP and request.status is RequestStatus.FINISHED
    assert scheduler.commit(decode, (3,)) == []  # the queued decode's sample is dropped
    # The cache keeps the cells of the known tokens, pinned under the session: 4 prompt tokens + the stop
    # token, whose K/V the queued decode writes (stream order puts that before any later step that reuses them).
    assert scheduler.prefix_cache.num_cells == 5 and scheduler.prefix_cache.num_pinned == 1
    follow_up = add_request_with(scheduler, request.tokens + [7, 8])
    scheduler.plan()
    assert follow_up.stats.reused_tokens == 5


def test_a_request_preempted_with_a_sample_in_flight_waits_for_it():
    scheduler = make_scheduler(num_cells=14, budget=16, min_chunk=1)  # 13 cells and the scratch cell
    older = add_request(scheduler, 4, max_new=5)
    scheduler.commit(scheduler.plan(), (20,))
    newer = add_request_with(scheduler, list(range(100, 107)), max_new=1)  # shares no prefix with the older
    both = scheduler.plan()  # the older one's decode and the newer one's prompt, one cell to spare
    assert [c.request_id for c in both.chunks] == [older.id, newer.id] and scheduler.allocator.num_free == 1
    last_cell = scheduler.plan()  # the older one's next decode takes it
    assert [c.request_id for c in last_cell.chunks] == [older.id]
    # The older request's next decode needs a cell: the newer one, with its one sample in flight and nothing
    # left to schedule, gives way (its queued step still runs on cells that later, ordered steps reuse).
    plan = scheduler.plan()
    assert [c.request_id for c in plan.chunks] == [older.id]
    assert newer.status is RequestStatus.WAITING and newer.num_computed == 0 and newer.num_unresolved == 1
    scheduler.finish(older.id, FinishReason.CANCELLED)  # room again
    later = scheduler.plan()
    assert not later.chunks  # the newer one is not recomputed before its sample is known
    events = scheduler.commit(both, (21, 22))
    assert [(e.request_id, e.token, e.finish_reason) for e in events] == [(newer.id, 22, FinishReason.LENGTH)]
    assert scheduler.commit(last_cell, (23,)) == [] and scheduler.commit(plan, (24,)) == []
    assert newer.tokens[7:] == [22]
    assert_pool_returns_to_empty(scheduler)


def test_leaked_cells_are_the_used_cells_nothing_holds():
    scheduler = make_scheduler()
    add_request(scheduler, 10, max_new=3, session_id="chat")
    add_request(scheduler, 10, max_new=3)  # the same prompt: its prefix shares the cached cells
    while scheduler.has_work():
        run_step(scheduler)
        assert scheduler.num_leaked_cells() == 0
    assert scheduler.allocator.num_used > 0  # kept by the prefix cache, not leaked
    assert scheduler.num_leaked_cells() == 0
    scheduler.allocator.allocate(3)  # cells nobody holds
    assert scheduler.num_leaked_cells() == 3
