"""Speculative decoding end to end: greedy output identical with any drafts (on toy-greedy and toy-recall),
seeded sampling repeatable, n-gram drafts on toy-greedy accepted, rejected cells freed, limits cut in the
middle of a step's tokens, refusals."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import (
    RecordingExecutor, assert_only_the_cache_holds_cells, random_prompts, sampled_alone_and_in_a_batch,
)
from pt2serve.errors import Pt2ServeError
from pt2serve.model.presets import toy_greedy_continuation
from pt2serve.runtime.cells import CellAllocator
from pt2serve.runtime.drafter import NgramDrafter, Speculation
from pt2serve.runtime.engine import describe_load, open_runner
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.request import FinishReason, Request, RequestSpec
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.runtime.sampling import DrawPurpose, RequestRandom, SamplingParams
from pt2serve.runtime.scheduler import MAX_DRAFT_PAUSE, PLACEHOLDER_TOKEN, Scheduler, SchedulerConfig
from pt2serve.runtime.step import Chunk

CELLS = ExecutorConfig(num_cells=4097)
VOCAB = 258


class ContinuationDrafter:
    """Proposes what the target will say (from `truth`: tokens -> continuation), corrupted at random if asked,
    and in random lengths, so every acceptance count from 0 to k comes up."""

    def __init__(self, truth, corrupt: float = 0.0, seed: int = 0) -> None:
        self.truth = truth
        self.corrupt = corrupt
        self.rng = random.Random(seed)

    def propose(self, tokens, max_drafts):
        count = self.rng.randint(0, max_drafts)
        drafts = list(self.truth(list(tokens), count))
        for i in range(count):
            if self.rng.random() < self.corrupt:
                drafts[i] = (drafts[i] + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
        return tuple(drafts)


class RandomDrafter:
    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def propose(self, tokens, max_drafts):
        return tuple(self.rng.randrange(VOCAB) for _ in range(self.rng.randint(0, max_drafts)))


def speculating_runner(artifact, drafter, num_draft_tokens: int = 4, cells=CELLS, token_budget: int = 64):
    return open_runner(artifact, executor_config=cells, drafter=drafter,
                       runner_config=RunnerConfig(token_budget=token_budget, num_draft_tokens=num_draft_tokens))


@pytest.mark.parametrize("make_drafter, num_draft_tokens", [
    (lambda truth: ContinuationDrafter(truth), 4),
    (lambda truth: ContinuationDrafter(truth, corrupt=0.3, seed=1), 7),
    (lambda truth: RandomDrafter(seed=2), 3),
    (lambda truth: NgramDrafter(), 1),
], ids=["known", "corrupted", "random", "ngram-k1"])
def test_greedy_tokens_are_the_targets_for_any_drafts(designed, make_drafter, num_draft_tokens):
    """On both designed presets: on toy-recall a rejected draft's K/V left in a cell later read shows."""
    drafter = make_drafter(designed.continuation)  # a continuation drafter proposes the designed tokens
    runner = speculating_runner(designed.artifact, drafter, num_draft_tokens)
    try:
        batch = random_prompts(12, seed=num_draft_tokens, max_length=40)
        # Every third request decodes plainly, in the same steps as the speculating ones.
        handles = [runner.submit(p, max_new_tokens=50, speculate=False if i % 3 == 0 else None)
                   for i, p in enumerate(batch)]
        results = [h.result(timeout=120) for h in handles]
        for i, (prompt, result) in enumerate(zip(batch, results)):
            assert result.token_ids == designed.continuation(prompt, 50)
            assert result.finish_reason is FinishReason.LENGTH and result.stats.completion_tokens == 50
            if i % 3 == 0:
                assert result.stats.verify_steps == 0
            elif not isinstance(drafter, NgramDrafter):
                assert result.stats.verify_steps > 0
        assert_only_the_cache_holds_cells(runner)
        stats = runner.stats
        assert stats.cells_leaked == 0 and stats.verify_steps > 0
        if isinstance(drafter, ContinuationDrafter) and not drafter.corrupt:
            assert stats.accepted_tokens == stats.draft_tokens
        else:  # drafts were rejected, and their cells given back
            assert stats.accepted_tokens < stats.draft_tokens
    finally:
        runner.close()
    assert runner.stats.cells_used == 0  # closing returns the pool to empty


def test_tiny_greedy_output_is_unchanged_by_speculation(tiny_artifact):
    """On random weights (ties and near-ties included) the emitted tokens are those of plain decoding."""
    batch = random_prompts(8, seed=7, max_length=40)
    plain = open_runner(tiny_artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    try:
        expected = {tuple(p): plain.generate(p, max_new_tokens=40, ignore_eos=True).token_ids for p in batch}
    finally:
        plain.close()

    def truth(tokens, count):
        for prompt, continuation in expected.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                return (continuation + [0] * count)[done:done + count]
        raise AssertionError("a prompt the test did not submit")

    for drafter in (ContinuationDrafter(truth, corrupt=0.2, seed=3), RandomDrafter(seed=4)):
        runner = speculating_runner(tiny_artifact, drafter, num_draft_tokens=5)
        try:
            handles = [runner.submit(p, max_new_tokens=40, ignore_eos=True) for p in batch]
            for prompt, handle in zip(batch, handles):
                assert handle.result(timeout=120).token_ids == expected[tuple(prompt)]
            assert_only_the_cache_holds_cells(runner)
        finally:
            runner.close()


def test_preemption_while_a_verify_step_is_in_flight_keeps_the_tokens(designed):
    # 24 requests of up to 40 + 60 tokens in a pool of 600 cells: requests are preempted and recomputed.
    runner = speculating_runner(designed.artifact, ContinuationDrafter(designed.continuation, corrupt=0.2, seed=5),
                                6, cells=ExecutorConfig(num_cells=600))
    try:
        batch = random_prompts(24, seed=8, max_length=40)
        handles = [runner.submit(p, max_new_tokens=60) for p in batch]
        for prompt, handle in zip(batch, handles):
            assert handle.result(timeout=180).token_ids == designed.continuation(prompt, 60)
        assert runner.scheduler.num_preemptions > 0
        assert_only_the_cache_holds_cells(runner)
    finally:
        runner.close()


def test_ngram_drafts_on_toy_greedy_are_accepted_whole(toy_artifact):
    """toy-greedy's successor cycle has length 64: a prompt that holds the cycle once makes every later token
    predictable from its last three, so prompt lookup drafts exactly what the model says."""
    runner = open_runner(toy_artifact, executor_config=CELLS,
                         runner_config=RunnerConfig(token_budget=64, speculate=Speculation.NGRAM, num_draft_tokens=7))
    try:
        assert "speculating with NgramDrafter, up to 7 drafts per sequence and step" in describe_load(runner)
        prompt = [5] + toy_greedy_continuation([5], 69)
        result = runner.generate(prompt, max_new_tokens=81)
        assert result.token_ids == toy_greedy_continuation(prompt, 81)
        stats = result.stats
        # 1 token from the prompt's step, then 10 steps of 7 accepted drafts + 1 (the last step is cut to fit).
        assert stats.verify_steps == 10 and stats.accepted_tokens == stats.draft_tokens == 70
        assert_only_the_cache_holds_cells(runner)  # (and the runner's stats are fresh)
        assert runner.stats.accepted_tokens == runner.stats.draft_tokens == 70 and runner.stats.verify_steps == 10
    finally:
        runner.close()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_speculating_request_is_launched_again_before_its_verify_comes_back(toy_artifact, sampling):
    """One step in flight with speculation: after each verifying step of a request, greedy or sampled (but the
    last ones, whose drafts might end it), its next step is launched while that verify is still unread on the
    device."""
    from pt2serve.runtime.artifact import load_artifact
    from pt2serve.runtime.executor import Executor
    from pt2serve.runtime.runner import Runner

    executor = RecordingExecutor(Executor(load_artifact(toy_artifact), CELLS))
    runner = Runner(executor, config=RunnerConfig(token_budget=64, speculate=Speculation.NGRAM, num_draft_tokens=7))
    try:
        prompt = [5] + toy_greedy_continuation([5], 69)
        result = runner.generate(prompt, max_new_tokens=81, sampling=sampling)
        if sampling.is_greedy:
            assert result.token_ids == toy_greedy_continuation(prompt, 81)
            assert result.stats.accepted_tokens == result.stats.draft_tokens
        assert result.stats.verify_steps >= 8
        assert_only_the_cache_holds_cells(runner)
    finally:
        runner.close()
    unread, behind = set(), 0  # launches whose result is not read yet; launches behind an unread verify
    for kind, index in executor.log:
        if kind == "result":
            unread.discard(index)
            continue
        behind += any(any(c.drafts for c in executor.chunks[i]) for i in unread)  # (one request: its next step)
        unread.add(index)
    assert behind >= result.stats.verify_steps - 2


def _verify_then_follow(executor, prompt: list[int], drafts: tuple[int, ...], follower_drafts: tuple[int, ...],
                        seed: int, planned: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prefill `prompt` (sampled), verify `drafts` after its token, then one more chunk with `follower_drafts`,
    `planned` "after" the verify's result at its real position, or "behind" the verify in flight as if all its
    drafts were accepted, with windows of draws (or "unshifted", with the draws of that plan's positions alone).
    What the verify and the follower emit."""
    sampling = SamplingParams(temperature=1.0)
    cells = np.arange(1, 64)
    start = len(prompt)
    draw = RequestRandom(seed).uniform

    def verifying(tokens, start, drafts, window, previous):
        positions = range(start + 1 - window, start + 2 + len(drafts))
        return Chunk(cells[:start + 1 + len(drafts)], tokens, start, sampling, previous_sample=previous,
                     drafts=drafts, accept_uniforms=tuple(draw(p, DrawPurpose.ACCEPT) for p in positions[:-1]),
                     sample_uniforms=tuple(draw(p) for p in positions), draw_window=window)

    def follower(first, start, window=0, previous=None):
        if follower_drafts:
            return verifying((first,) + follower_drafts, start, follower_drafts, window, previous)
        draws = tuple(draw(p) for p in range(start + 1 - window, start + 2))
        return Chunk(cells[:start + 1], (first,), start, sampling, draws[-1], previous,
                     sample_uniforms=draws if window else (), draw_window=window)

    (token,) = executor.step([Chunk(cells[:start], tuple(prompt), 0, sampling, draw(start))]).tokens
    verify = executor.launch([verifying((token,) + drafts, start, drafts, 0, None)])
    if planned == "after":
        (emitted,) = verify.result().verified
        after = executor.launch([follower(emitted[-1], start + len(emitted))])
    else:  # before the verify's result is read: after all its drafts (the executor moves it back)
        window = len(drafts) if planned == "behind" else 0
        after = executor.launch([follower(PLACEHOLDER_TOKEN, start + 1 + len(drafts), window, 0)])
        (emitted,) = verify.result().verified
    result = after.result()
    return emitted, result.verified[0] if follower_drafts else result.tokens


@pytest.mark.parametrize("follower_drafts", [(), (7, 9)], ids=["sampled", "verifying"])
def test_a_sampled_chunk_behind_a_verify_draws_at_the_position_the_verify_leaves_it(tiny_artifact,
                                                                                   follower_drafts):
    """Planned behind a verify in flight for all its drafts accepted, a sampled request's next chunk emits what
    it emits when planned after the verify's result, at its real position: the executor takes its draws from
    their windows where the verify left it, on the device. With the all-accepted plan's draws instead, some of
    those tokens differ (so the comparison sees the shift)."""
    from pt2serve.runtime.artifact import load_artifact
    from pt2serve.runtime.executor import Executor

    executor = Executor(load_artifact(tiny_artifact), ExecutorConfig(num_cells=64))
    rng = random.Random(0)
    rejected = differs = 0
    for seed in range(8):
        prompt = [rng.randrange(VOCAB) for _ in range(6)]
        drafts = tuple(rng.randrange(VOCAB) for _ in range(3))
        runs = {planned: _verify_then_follow(executor, prompt, drafts, follower_drafts, seed, planned)
                for planned in ("after", "behind", "unshifted")}
        assert runs["behind"] == runs["after"]
        emitted, after = runs["after"]
        rejected += len(emitted) <= len(drafts)
        differs += runs["unshifted"][1] != after
    assert rejected >= 4 and differs >= 1


def test_seeded_sampling_repeats_alone_and_in_a_batch(tiny_artifact):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = [256, 10, 20, 30, 40, 10, 20, 30]
    runner = open_runner(tiny_artifact, executor_config=CELLS,
                         runner_config=RunnerConfig(token_budget=64, speculate=Speculation.NGRAM, num_draft_tokens=4))
    try:
        others = random_prompts(6, seed=5, max_length=40)
        alone, batched = sampled_alone_and_in_a_batch(runner, prompt, 30, sampling, others)
        assert batched == alone
        assert runner.stats.verify_steps > 0
        assert_only_the_cache_holds_cells(runner)
    finally:
        runner.close()


def test_stop_strings_and_stop_tokens_cut_inside_a_step(toy_artifact):
    prompt = [5] + toy_greedy_continuation([5], 69)
    continuation = toy_greedy_continuation(prompt, 40)
    plain = open_runner(toy_artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    runner = open_runner(toy_artifact, executor_config=CELLS,
                         runner_config=RunnerConfig(token_budget=64, speculate=Speculation.NGRAM, num_draft_tokens=7))
    try:
        stop_token = continuation[10]  # in the middle of the second verifying step's 8 tokens
        assert stop_token not in continuation[:10]
        for kwargs in (dict(stop_token_ids=(stop_token,)), dict(max_new_tokens=11),
                       dict(stop_strings=(plain.tokenizer.decode(continuation[12:14]),))):
            args = dict(max_new_tokens=40, ignore_eos=True) | kwargs
            want, got = plain.generate(prompt, **args), runner.generate(prompt, **args)
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            assert got.stats.verify_steps >= 1 and len(got.token_ids) < 20
        assert_only_the_cache_holds_cells(runner)
    finally:
        plain.close()
        runner.close()


def test_requests_that_cannot_speculate_decode_plainly_or_are_refused(toy_artifact):
    runner = open_runner(toy_artifact, executor_config=CELLS,
                         runner_config=RunnerConfig(speculate=Speculation.NGRAM, num_draft_tokens=4))
    try:
        prompt = [5] + toy_greedy_continuation([5], 69)
        quiet = runner.generate(prompt, max_new_tokens=20, logprobs=2)
        assert quiet.token_ids == toy_greedy_continuation(prompt, 20) and quiet.stats.verify_steps == 0
        with pytest.raises(Pt2ServeError, match="does not combine with logprobs"):
            runner.submit(prompt, logprobs=2, speculate=True)
        with pytest.raises(Pt2ServeError, match="penalties or logit_bias"):
            runner.submit(prompt, sampling=SamplingParams(presence_penalty=0.5), speculate=True)
    finally:
        runner.close()
    plain = open_runner(toy_artifact, executor_config=CELLS)
    try:
        with pytest.raises(Pt2ServeError, match="--speculate ngram"):
            plain.submit(prompt, speculate=True)
    finally:
        plain.close()
    with pytest.raises(Pt2ServeError, match="widest static width"):
        open_runner(toy_artifact, executor_config=CELLS,
                    runner_config=RunnerConfig(speculate=Speculation.NGRAM, num_draft_tokens=64))


# -- plain data: the drafter and the scheduler -----------------------------------------------------------------

def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter()
    assert drafter.propose([1, 2, 3, 9, 9, 1, 2, 3], 3) == (9, 9, 1)
    # The longest n-gram wins over a more recent shorter match.
    assert drafter.propose([1, 2, 3, 4, 5, 7, 3, 6, 2, 3], 2) == (4, 5)
    assert drafter.propose([7, 3, 8, 1, 2, 3], 2) == (8, 1)  # only "3" matches
    # A period shorter than k repeats itself.
    assert drafter.propose([4, 4, 4], 5) == (4, 4, 4, 4, 4)
    assert drafter.propose([1, 2, 1, 2], 5) == (1, 2, 1, 2, 1)
    assert drafter.propose([1, 2, 3], 4) == () and drafter.propose([1], 4) == ()
    assert drafter.propose([1, 2, 1], 0) == ()


class ScriptedDrafter:
    def __init__(self, drafts) -> None:
        self.drafts = drafts

    def propose(self, tokens, max_drafts):
        return tuple(self.drafts[:max_drafts])


def test_scheduler_commits_accepted_drafts_and_frees_the_rejected_cells():
    allocator = CellAllocator(256)
    scheduler = Scheduler(SchedulerConfig(token_budget=16, max_decode_sequences=16, max_context=128),
                          allocator, ScriptedDrafter([50, 51, 52, 53]))
    request = Request(1, RequestSpec((1, 2, 3), 10, num_draft_tokens=4), [1, 2, 3], RequestRandom(0))
    scheduler.add(request)
    plan = scheduler.plan()
    scheduler.commit(plan, (40,))
    plan = scheduler.plan()
    (chunk,) = plan.chunks
    assert chunk.drafts == (50, 51, 52, 53) and chunk.num_tokens == 5 and chunk.start == 3
    # Drafts in flight count as accepted: their cells, num_computed, the limits.
    assert request.cells.length == 8 and request.num_computed == 8 and request.num_sampled == 6
    (executor_chunk,) = scheduler.executor_chunks(plan)
    assert executor_chunk.tokens == (40, 50, 51, 52, 53) and executor_chunk.drafts == (50, 51, 52, 53)
    events = scheduler.commit(plan, (None,), ((50, 51, 60),))
    assert [e.token for e in events] == [50, 51, 60]
    assert request.tokens == [1, 2, 3, 40, 50, 51, 60] and request.num_computed == 6
    assert request.cells.length == 6 and allocator.num_used == 6  # the cells of 52 and 53 are free
    assert (request.stats.draft_tokens, request.stats.accepted_tokens, request.stats.verify_steps) == (4, 2, 1)
    # max_new_tokens 10 with 4 generated: drafts are capped so the step emits at most the 6 left.
    plan = scheduler.plan()
    assert plan.chunks[0].drafts == (50, 51, 52, 53)
    events = scheduler.commit(plan, (None,), ((50, 51, 52, 53, 54),))
    assert len(events) == 5 and events[-1].finish_reason is None
    plan = scheduler.plan()
    assert plan.chunks[0].drafts == ()  # one token left: no room for a draft
    events = scheduler.commit(plan, (70,))
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert allocator.num_used == scheduler.prefix_cache.num_cells


def test_a_verify_in_flight_is_followed_by_the_next_chunk_planned_for_all_its_drafts_accepted():
    """Planned while its verify is in flight, a request's next chunk starts after all the drafts (the executor
    moves it back by the rejected ones on the device) and drafts after a guess of what the verify emits; the
    commit gives back the rejected drafts' cells from the end, and a wrong guess is no drafter's miss."""
    allocator = CellAllocator(256)
    scheduler = Scheduler(SchedulerConfig(token_budget=16, max_decode_sequences=16, max_context=128),
                          allocator, ScriptedDrafter([50, 51, 52, 53]))
    request = Request(1, RequestSpec((1, 2, 3), 10, num_draft_tokens=4), [1, 2, 3], RequestRandom(0))
    scheduler.add(request)
    scheduler.commit(scheduler.plan(), (40,))
    first = scheduler.plan()
    second = scheduler.plan()  # the first in flight
    (chunk,) = second.chunks
    # 10 - 6 sampled (4 drafts in flight counted) - 1 = 3 drafts, after the guess 50 51 52 53 + 50.
    assert (chunk.start, chunk.num_tokens, chunk.drafts, chunk.previous_sample) == (8, 4, (51, 52, 53), 0)
    assert request.guess == (second.step, (50, 51, 52, 53, 50), 4)
    (executor_chunk,) = scheduler.executor_chunks(second)
    assert executor_chunk.tokens == (PLACEHOLDER_TOKEN, 51, 52, 53) and executor_chunk.previous_sample == 0
    assert request.cells.length == request.num_computed == 12
    scheduler.commit(first, (None,), ((50, 51, 60),))  # 2 of 4 accepted: the second chunk runs 2 earlier
    assert request.cells.length == request.num_computed == 10 and allocator.num_used == 10
    assert request.off_track_step == second.step and request.guess is None
    third = scheduler.plan()
    # Behind a chunk that followed a wrong guess: its drafts are likely all rejected, so the guess is its one
    # token, from the known tokens alone.
    assert third.chunks[0].start == 10 and third.chunks[0].drafts == (51,)  # 10 - 8 sampled - 1
    assert request.guess == (third.step, (50,), 0)
    scheduler.commit(second, (None,), ((61,),))
    assert request.draft_misses == 0 and request.draft_pause == 0  # drafts after rejected drafts: no miss
    assert request.cells.length == request.num_computed == 9 and request.off_track_step == third.step
    scheduler.commit(third, (None,), ((51, 70),))
    assert request.tokens[3:] == [40, 50, 51, 60, 61, 51, 70] and request.num_computed == 9
    assert (request.stats.draft_tokens, request.stats.accepted_tokens, request.stats.verify_steps) == (8, 3, 3)
    last = scheduler.plan()
    assert last.chunks[0].drafts == (50, 51)  # 3 tokens left
    events = scheduler.commit(last, (None,), ((50, 51, 54),))
    assert events[-1].finish_reason is FinishReason.LENGTH and request.stats.completion_tokens == 10
    assert allocator.num_used == scheduler.prefix_cache.num_cells


def test_a_sampled_request_behind_its_verify_in_flight_carries_windows_of_draws():
    """A sampled request is planned behind its verify in flight too (after all its drafts), with draws from as many
    positions before as that verify has drafts: the executor picks them where the verify leaves it."""
    allocator = CellAllocator(256)
    scheduler = Scheduler(SchedulerConfig(token_budget=16, max_decode_sequences=16, max_context=128),
                          allocator, ScriptedDrafter([50, 51, 52, 53]))
    sampling = SamplingParams(temperature=0.8, seed=5)
    request = Request(1, RequestSpec((1, 2, 3), 20, sampling=sampling, num_draft_tokens=4), [1, 2, 3],
                      RequestRandom(5))
    scheduler.add(request)
    scheduler.commit(scheduler.plan(), (40,))
    first = scheduler.plan()
    assert first.chunks[0].drafts and first.chunks[0].draw_window == 0
    second = scheduler.plan()  # the first in flight
    (chunk,) = second.chunks
    assert chunk.previous_sample == 0 and chunk.start == 8 and chunk.draw_window == 4
    (verifying,) = scheduler.executor_chunks(second)
    positions = range(9 - 4, 9 + len(chunk.drafts) + 1)  # row j decides start + 1 + j, from 4 positions before
    draws = RequestRandom(5)
    assert verifying.draw_window == 4
    assert verifying.accept_uniforms == tuple(draws.uniform(p, DrawPurpose.ACCEPT) for p in positions[:-1])
    assert verifying.sample_uniforms == tuple(draws.uniform(p) for p in positions)


def test_scheduler_finishes_at_the_first_stop_token_of_a_step():
    allocator = CellAllocator(256)
    scheduler = Scheduler(SchedulerConfig(token_budget=16, max_decode_sequences=16, max_context=128),
                          allocator, ScriptedDrafter([50, 51, 52]))
    request = Request(1, RequestSpec((1, 2, 3), 100, stop_token_ids=frozenset({51}), num_draft_tokens=3),
                      [1, 2, 3], RequestRandom(0))
    scheduler.add(request)
    scheduler.commit(scheduler.plan(), (40,))
    plan = scheduler.plan()
    events = scheduler.commit(plan, (None,), ((50, 51, 52, 53),))
    assert [(e.token, e.finish_reason) for e in events] == [(50, None), (51, FinishReason.STOP)]
    assert request.tokens[-2:] == [50, 51] and not scheduler.has_work()
    assert allocator.num_used == scheduler.prefix_cache.num_cells


class CountingDrafter:
    """Proposes `drafts` and notes the length of the tokens it was asked to continue."""

    def __init__(self, drafts) -> None:
        self.drafts = drafts
        self.asked_at: list[int] = []

    def propose(self, tokens, max_drafts):
        self.asked_at.append(len(tokens))
        return tuple(self.drafts[:max_drafts])


def run_in_flight(scheduler: Scheduler, num_steps: int, emitted=lambda chunk: None) -> None:
    """Plan each step while the last one is in flight, as the runner does; a verifying chunk emits
    `emitted(chunk)` (None: the token 9 alone, every draft rejected), every other sampled chunk emits 9."""
    def commit(plan) -> None:
        tokens = tuple(9 if c.samples and not c.drafts else None for c in plan.chunks)
        scheduler.commit(plan, tokens, tuple((emitted(c) or (9,)) if c.drafts else None for c in plan.chunks))

    in_flight = None
    for _ in range(num_steps):
        plan = scheduler.plan()
        if in_flight is not None:
            commit(in_flight)
        in_flight = plan if plan.chunks else None
    if in_flight is not None:
        commit(in_flight)


def test_a_drafter_that_brings_nothing_is_asked_ever_less_often():
    """Each attempt that brings no accepted token doubles the decodes made without drafts (and with a step in
    flight) before the next, up to MAX_DRAFT_PAUSE; an accepted draft ends the pause."""
    allocator = CellAllocator(512)
    config = SchedulerConfig(token_budget=16, max_decode_sequences=16, max_context=256)
    drafter = CountingDrafter(())  # proposes nothing
    scheduler = Scheduler(config, allocator, drafter)
    scheduler.add(Request(1, RequestSpec((1, 2, 3), 200, num_draft_tokens=4), [1, 2, 3], RequestRandom(0)))
    run_in_flight(scheduler, 120)
    gaps = np.diff(drafter.asked_at).tolist()
    # Between two asks: the decode of the attempt, then the pause's decodes.
    assert gaps[:7] == [2, 3, 5, 9, MAX_DRAFT_PAUSE + 1, MAX_DRAFT_PAUSE + 1, MAX_DRAFT_PAUSE + 1]

    # Drafts proposed but all rejected pause the same way; one accepted draft and it drafts every step again.
    drafter = CountingDrafter((50, 51))
    scheduler = Scheduler(config, CellAllocator(512), drafter)
    request = Request(2, RequestSpec((1, 2, 3), 200, num_draft_tokens=2), [1, 2, 3], RequestRandom(0))
    scheduler.add(request)
    run_in_flight(scheduler, 80)  # every draft rejected
    # Each attempt is two chunks: one drafted after its known tokens, one drafted behind it (after a guess of
    # what it emits) before its verify is back; each misses, and the pause after them doubles twice.
    gaps = np.diff(drafter.asked_at).tolist()
    assert gaps[0::2][:5] == [1] * 5 and gaps[1::2][:4] == [4, 10, MAX_DRAFT_PAUSE + 2, MAX_DRAFT_PAUSE + 2]
    assert request.draft_misses >= 4
    asked = len(drafter.asked_at)
    run_in_flight(scheduler, 60, emitted=lambda chunk: chunk.drafts + (9,))  # every draft accepted
    assert request.draft_misses == 0 and request.draft_pause == 0
    # Drafting every step behind the last: the drafter's first token is the guess, then 1 draft + 1 per step.
    assert set(np.diff(drafter.asked_at[asked + 1:]).tolist()) == {2}


def test_speculating_decodes_share_the_token_budget():
    allocator = CellAllocator(512)
    scheduler = Scheduler(SchedulerConfig(token_budget=10, max_decode_sequences=10, max_context=128),
                          allocator, ScriptedDrafter([7, 7, 7, 7]))
    requests = [Request(i, RequestSpec((1, 2), 50, num_draft_tokens=4), [1, 2], RequestRandom(0))
                for i in range(1, 4)]
    for request in requests:
        scheduler.add(request)
    plan = scheduler.plan()
    scheduler.commit(plan, tuple(9 if c.samples else None for c in plan.chunks))
    plan = scheduler.plan()
    # 3 decodes and 7 budget tokens for drafts: 4, then 3, then none.
    assert [len(c.drafts) for c in plan.chunks] == [4, 3, 0] and plan.num_tokens == 10


# -- the server -------------------------------------------------------------------------------------------------

def test_server_reports_speculation_in_usage_and_metrics(toy_artifact):
    import httpx
    from conftest import served
    from test_server import metrics

    runner = open_runner(toy_artifact, executor_config=CELLS,
                         runner_config=RunnerConfig(token_budget=64, speculate=Speculation.NGRAM, num_draft_tokens=5))
    thread = served(runner, "toy")
    try:
        prompt = [5] + toy_greedy_continuation([5], 69)
        body = {"model": "toy", "prompt": prompt, "max_tokens": 25, "temperature": 0, "ignore_eos": True}
        data = httpx.post(f"{thread.url}/v1/completions", json=body, timeout=60).json()
        assert data["choices"][0]["token_ids"] == toy_greedy_continuation(prompt, 25)
        # 1 token from the prompt's step, then 4 steps of 5 accepted drafts + 1.
        assert data["usage"]["speculation"] == {"draft_tokens": 20, "accepted_tokens": 20, "steps": 4,
                                                "acceptance_rate": 1.0, "mean_accepted_length": 6.0}
        streamed = httpx.post(f"{thread.url}/v1/completions", json=body | {"stream": True}, timeout=60).text
        pieces = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        assert sum(len(p["choices"][0].get("token_ids") or []) for p in pieces if p["choices"]) in (0, 25)
        assert "".join(p["choices"][0]["text"] for p in pieces if p["choices"]) == data["choices"][0]["text"]
        # n > 1 decodes plainly.
        two = httpx.post(f"{thread.url}/v1/completions", json=body | {"n": 2}, timeout=60).json()
        assert two["usage"]["speculation"]["steps"] == 0
        assert [c["token_ids"] for c in two["choices"]] == [data["choices"][0]["token_ids"]] * 2
        samples = metrics(thread.url)
        assert samples["pt2serve_spec_accepted_tokens_total"] == samples["pt2serve_spec_draft_tokens_total"] == 40
        assert samples["pt2serve_spec_verify_steps_total"] == 8
    finally:
        thread.stop()
        runner.close()
