"""Scheduler tests on plain data: hand-made executor outputs, no artifact, no device."""

from __future__ import annotations

import dataclasses

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
    assert scheduler.allocator.num_used == 0


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
    assert sum(r.stats.preemptions for r in crowded) >= 4, [r.stats.preemptions for r in crowded]
    assert scheduler.num_preemptions == sum(r.stats.preemptions for r in crowded)
    for request, expected in zip(crowded, solo):
        assert request.finish_reason is FinishReason.LENGTH
        assert request.tokens == expected, f"request {request.id} ({request.stats.preemptions} preemptions)"
    assert scheduler.allocator.num_used == 0


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


def test_session_reuse_and_reset():
    scheduler = make_scheduler(max_sessions=4)
    first = add_request(scheduler, 10, max_new=3, session_id="s")
    while scheduler.has_work():
        run_step(scheduler)
    history = first.tokens  # 10 prompt + 3 generated; the last one was never computed
    second = add_request_with(scheduler, history + [7, 8], session_id="s")
    run_step(scheduler)
    assert second.stats.reused_tokens == 12
    assert second.stats.prefilled_tokens == 3
    while scheduler.has_work():
        run_step(scheduler)
    other = add_request_with(scheduler, [9, 9, 9], session_id="s")  # does not extend: reset
    run_step(scheduler)
    assert other.stats.reused_tokens == 0
    while scheduler.has_work():
        run_step(scheduler)
    scheduler.sessions.clear()
    assert scheduler.allocator.num_used == 0


def test_prefix_cache_reuses_longest_prefix_and_evicts_lru():
    scheduler = make_scheduler(prefix_cache_entries=2)
    first = add_request_with(scheduler, list(range(1, 21)), max_new=2)
    while scheduler.has_work():
        run_step(scheduler)
    second = add_request_with(scheduler, list(range(1, 16)) + [99, 98], max_new=2)
    run_step(scheduler)
    assert second.stats.reused_tokens == 15
    while scheduler.has_work():
        run_step(scheduler)
    assert scheduler.prefix_cache.hit_rate == pytest.approx(1 / 2)
    for start in (500, 600, 700):
        add_request_with(scheduler, list(range(start, start + 5)), max_new=1)
        while scheduler.has_work():
            run_step(scheduler)
    assert len(scheduler.prefix_cache) == 2
    scheduler.prefix_cache.clear()
    assert scheduler.allocator.num_used == 0
    del first


def add_request_with(scheduler: Scheduler, prompt: list[int], max_new: int = 4, **spec) -> Request:
    request = Request(next(_ids), RequestSpec(tuple(prompt), max_new, **spec), list(prompt), RequestRandom(0))
    scheduler.add(request)
    return request


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
    assert scheduler.allocator.num_used == 0


def test_a_stop_token_found_late_drops_the_queued_decode_and_its_cell():
    scheduler = make_scheduler(min_chunk=1, max_sessions=2)
    request = add_request(scheduler, 4, stop_token_ids=frozenset({9}), session_id="s")
    prefill = scheduler.plan()
    decode = scheduler.plan()
    events = scheduler.commit(prefill, (9,))
    assert events[0].finish_reason is FinishReason.STOP and request.status is RequestStatus.FINISHED
    assert scheduler.commit(decode, (3,)) == []  # the queued decode's sample is dropped
    # The session keeps the cells of the known tokens: 4 prompt tokens + the stop token, whose K/V the queued
    # decode writes (stream order puts that before any later step that reuses them).
    assert len(scheduler.sessions.take("s").cells) == 5


def test_a_request_preempted_with_a_sample_in_flight_waits_for_it():
    scheduler = make_scheduler(num_cells=12, budget=16, min_chunk=1)
    first = add_request(scheduler, 8, max_new=1)
    prefill = scheduler.plan()
    second = add_request(scheduler, 6, max_new=2)
    # The first request has its one sample in flight and nothing left to schedule; the second needs 6 cells
    # of the 3 free: the first is preempted (its queued step still runs on cells that later, ordered steps
    # reuse).
    plan = scheduler.plan()
    assert [c.request_id for c in plan.chunks] == [second.id]
    assert first.status is RequestStatus.WAITING and first.num_computed == 0 and first.num_unresolved == 1
    scheduler.finish(second.id, FinishReason.CANCELLED)  # room again
    later = scheduler.plan()
    assert not later.chunks  # the first is not recomputed before its sample is known
    events = scheduler.commit(prefill, (21,))
    assert [(e.request_id, e.token, e.finish_reason) for e in events] == [(first.id, 21, FinishReason.LENGTH)]
    assert scheduler.commit(plan, (22,)) == []
    assert first.tokens[8:] == [21] and scheduler.allocator.num_used == 0


def test_leaked_cells_are_the_used_cells_nothing_holds():
    scheduler = make_scheduler(prefix_cache_entries=4)
    add_request(scheduler, 10, max_new=3, session_id="chat")
    add_request(scheduler, 10, max_new=3)  # the same prompt: its prefix shares the session's cells
    while scheduler.has_work():
        run_step(scheduler)
        assert scheduler.num_leaked_cells() == 0
    assert scheduler.allocator.num_used > 0  # kept by the session and the prefix cache, not leaked
    assert scheduler.num_leaked_cells() == 0
    scheduler.allocator.allocate(3)  # cells nobody holds
    assert scheduler.num_leaked_cells() == 3
