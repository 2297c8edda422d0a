"""The batching runner on real compiled artifacts (CPU): exact tokens under batching, prefix reuse,
cancellation, failure isolation. The tests of exact tokens under batching, reuse, preemption and cancels run on
both designed presets: toy-recall's tokens are wrong whenever a K/V cell is, toy-greedy's only when a token is."""

from __future__ import annotations

import random
import re
import threading
import time

import pytest
import torch

from conftest import (
    RecordingExecutor, assert_only_the_cache_holds_cells, random_prompts, sampled_alone_and_in_a_batch, stop_at_token,
    wait_until_idle,
)
from pt2serve.contract import SCRATCH_CELL
from pt2serve.model.presets import toy_greedy_continuation
from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.engine import describe_load, open_runner
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.runner import Runner, RunnerConfig
from pt2serve.runtime.sampling import SamplingParams

CELLS = ExecutorConfig(num_cells=4097)


@pytest.fixture(scope="module")
def tiny_runner(tiny_artifact):
    runner = open_runner(tiny_artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    yield runner
    runner.close()


def test_load_report_says_how_steps_run(toy_runner, toy_artifact):
    line = describe_load(toy_runner)
    assert "KV pool 4.2 MB for 4,096 tokens (as asked)" in line and "every step runs forward_others" in line
    # Where the loading time went, part by part (the device scripts read this line).
    assert re.search(r"^loaded in [\d.]+ s on cpu \(weights [\d.]+ s at [\d.]+ [GM]B/s, methods [\d.]+ s beside them, "
                     r"binding [\d.]+ s, KV pool [\d.]+ s, graph capture [\d.]+ s\)", line), line
    forced = open_runner(toy_artifact, executor_config=ExecutorConfig(num_cells=64, use_static_methods=True))
    try:
        assert "static methods run without them" in describe_load(forced)
    finally:
        forced.close()


def test_staggered_requests_match_their_solo_tokens_and_batch(designed_runner):
    runner, continuation = designed_runner
    batch = random_prompts(16)
    first_step = runner.scheduler.step
    handles = []
    # Arrivals 1 ms apart, each request 120 steps long: they overlap however fast a step is.
    for prompt in batch:
        handles.append(runner.submit(prompt, max_new_tokens=120))
        time.sleep(0.001)
    results = [h.result(timeout=120) for h in handles]
    for prompt, result in zip(batch, results):
        assert result.token_ids == continuation(prompt, 120)
        assert result.finish_reason is FinishReason.LENGTH
        assert result.stats.prompt_tokens == len(prompt) and result.stats.completion_tokens == 120
    solo = runner.generate(batch[3], max_new_tokens=120)
    assert solo.token_ids == results[3].token_ids
    steps = [s for s in runner.step_history if s.step > first_step]
    assert max(s.num_decode for s in steps) >= 8  # many sequences really decoded together
    assert any(s.num_decode and s.num_tokens > s.num_decode for s in steps)  # decode + prefill mixed


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_runner):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = [256, 10, 20, 30, 40]
    alone, batched = sampled_alone_and_in_a_batch(tiny_runner, prompt, 20, sampling, random_prompts(6, seed=5))
    assert batched == alone
    different_seed = tiny_runner.generate(prompt, max_new_tokens=20, ignore_eos=True,
                                          sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99))
    assert different_seed.token_ids != alone


def test_a_seeded_request_among_greedy_ones_is_the_same_as_alone(tiny_runner):
    """Greedy requests share its steps: only a step whose rows are all greedy may take the argmax method, so
    its draws still follow its seed (and its tokens are not the greedy ones)."""
    sampling = SamplingParams(temperature=1.0, seed=7)
    prompt = [256, 50, 60, 70]
    first_step = tiny_runner.scheduler.step
    alone, batched = sampled_alone_and_in_a_batch(tiny_runner, prompt, 20, sampling, random_prompts(6, seed=8),
                                                  others_greedy=True)
    assert batched == alone
    assert alone != tiny_runner.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids
    assert max(s.num_decode for s in tiny_runner.step_history if s.step > first_step) >= 2  # steps were shared


def test_a_continuation_prefills_only_its_new_suffix_with_or_without_a_session(designed_runner):
    runner, continuation = designed_runner
    history = [256, 1, 2, 3, 4, 5, 6, 7]
    first = runner.generate(history, max_new_tokens=6, session_id="chat")
    follow_up = history + first.token_ids + [40, 41, 42]
    warm = runner.generate(follow_up, max_new_tokens=6)
    assert warm.token_ids == continuation(follow_up, 6)
    # All of the first exchange but its last sampled token (never fed back) was already in cells.
    assert warm.stats.reused_tokens == len(history) + len(first.token_ids) - 1
    assert warm.stats.prefilled_tokens == len(follow_up) - warm.stats.reused_tokens
    shares_one_token = runner.generate([256, 99, 98], max_new_tokens=2, session_id="chat")
    assert shares_one_token.stats.reused_tokens == 1


def test_greedy_tokens_with_reuse_equal_those_without(tiny_artifact):
    """Families of random prompts that share prefixes of random lengths, run with the prefix cache and
    without it (tiny-random: random weights, so any K/V mix-up changes the tokens)."""
    rng = random.Random(5)
    families = [[256] + [rng.randrange(256) for _ in range(60)] for _ in range(3)]
    batch = []
    for _ in range(24):
        base = rng.choice(families)
        batch.append(base[: rng.randint(1, len(base))] + [rng.randrange(256) for _ in range(rng.randint(1, 20))])
    outputs = {}
    for enabled in (True, False):
        runner = open_runner(tiny_artifact, executor_config=ExecutorConfig(num_cells=600),
                             runner_config=RunnerConfig(token_budget=48, prefix_cache=enabled))
        try:
            handles = []
            for prompt in batch:
                handles.append(runner.submit(prompt, max_new_tokens=16, ignore_eos=True))
                time.sleep(0.002)
            results = [h.result(timeout=300) for h in handles]
            outputs[enabled] = [r.token_ids for r in results]
            reused = sum(r.stats.reused_tokens for r in results)
            assert (reused > 200) if enabled else reused == 0
            assert_only_the_cache_holds_cells(runner)
        finally:
            runner.close()
        assert runner.executor.allocator.num_used == 0
    assert outputs[True] == outputs[False]


def test_prefix_cache_hit_rate_counts_reused_tokens(designed):
    runner = open_runner(designed.artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    try:
        system = [256] + list(range(100, 140))
        runner.generate(system + [1, 2, 3], max_new_tokens=4)
        prompt = system + [7, 8]
        reused = runner.generate(prompt, max_new_tokens=5)
        assert reused.token_ids == designed.continuation(prompt, 5)
        assert reused.stats.reused_tokens == len(system)
        wait_until_idle(runner)
        assert runner.stats.prefix_cache_hit_rate == pytest.approx(len(system) / (len(system) * 2 + 5))
    finally:
        runner.close()


def test_cancel_mid_prefill_and_mid_decode_frees_cells_and_spares_the_others(designed):
    """Cancels land between steps: one after part (not all) of a 200-token prompt is in cells, one after a
    few decoded tokens, while two other requests run. Before every step the pool holds exactly the cells
    of the live requests (a cancelled one's are freed at once), and the others' tokens are their solo ones."""
    runner = open_runner(designed.artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    real_launch = runner.executor.launch
    long_prompt = [random.Random(1).randrange(256) for _ in range(200)]  # four steps of prefill at most
    targets: dict[str, object] = {}
    leaks: list[str] = []

    def launch_and_cancel(chunks, *args):
        # The engine thread, before a step: check the pool, and send the cancels once their moment comes.
        scheduler = runner.scheduler
        leaked = scheduler.num_leaked_cells()  # cells in use that neither a request nor the prefix cache holds
        if leaked:
            leaks.append(f"step {scheduler.step}: {leaked} cells leaked")
        for name, done in (("prefilling", lambda r: 0 < r.num_computed < r.num_prompt),
                           ("decoding", lambda r: len(r.tokens) - r.num_prompt >= 3)):
            handle = targets.get(name)
            request = scheduler.requests.get(handle.id) if handle is not None else None
            if request is not None and done(request) and name not in targets.get("sent", ()):
                targets.setdefault("sent", set()).add(name)
                runner.cancel(handle)
        return real_launch(chunks, *args)

    runner.executor.launch = launch_and_cancel
    try:
        others = [[256, 1, 2, 3], [256, 9]]
        other_handles = [runner.submit(p, max_new_tokens=40) for p in others]
        targets["decoding"] = runner.submit([256, 5], max_new_tokens=200)
        targets["prefilling"] = runner.submit(long_prompt, max_new_tokens=5)
        prefilling = targets["prefilling"].result(timeout=60)
        decoding = targets["decoding"].result(timeout=60)
        assert prefilling.finish_reason is FinishReason.CANCELLED and prefilling.token_ids == []
        assert 0 < prefilling.stats.prefilled_tokens < len(long_prompt), prefilling.stats
        assert decoding.finish_reason is FinishReason.CANCELLED
        assert 3 <= len(decoding.token_ids) < 200
        assert decoding.token_ids == designed.continuation([256, 5], len(decoding.token_ids))
        for prompt, handle in zip(others, other_handles):
            result = handle.result(timeout=60)
            assert result.finish_reason is FinishReason.LENGTH
            assert result.token_ids == designed.continuation(prompt, 40)
        wait_until_idle(runner)
        assert leaks == []
        assert_only_the_cache_holds_cells(runner)
    finally:
        runner.close()


def test_two_hundred_mixed_requests_leave_the_pool_empty(designed):
    # Prompts wait for room rather than enter a full pool: the pressure comes from outputs that outgrow it.
    runner = open_runner(designed.artifact, executor_config=ExecutorConfig(num_cells=600),
                         runner_config=RunnerConfig(token_budget=64))
    try:
        rng = random.Random(7)
        handles = []
        batch = random_prompts(200, seed=11)
        for prompt in batch:
            sampling = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99))
            handle = runner.submit(prompt, max_new_tokens=rng.randint(1, 48), sampling=sampling)
            handles.append((handle, sampling))
            if rng.random() < 0.2:
                runner.cancel(handle)
        results = [h.result(timeout=300) for h, _ in handles]
        assert {r.finish_reason for r in results} <= {FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.STOP}
        # Every greedy output, preempted or not, is its solo run (the designed continuation); a cancelled one
        # is a prefix of it.
        preempted_greedy = 0
        for prompt, (_, sampling), result in zip(batch, handles, results):
            if sampling.is_greedy:
                assert result.token_ids == designed.continuation(prompt, len(result.token_ids))
                preempted_greedy += result.stats.preemptions > 0 and result.finish_reason is FinishReason.LENGTH
        assert preempted_greedy >= 10, f"only {preempted_greedy} greedy requests were preempted: no pressure"
        assert_only_the_cache_holds_cells(runner)
    finally:
        runner.close()


def test_requests_preempted_while_decoding_produce_their_solo_tokens(designed):
    """Short prompts, long outputs, a small pool: decoding requests run the pool dry and are preempted with
    tokens already generated; each recomputes its prompt and its own tokens and goes on exactly as alone."""
    runner = open_runner(designed.artifact, executor_config=ExecutorConfig(num_cells=400),
                         runner_config=RunnerConfig(token_budget=64))
    try:
        batch = random_prompts(24, seed=3)
        batch = [p[:10] for p in batch]
        handles = [runner.submit(p, max_new_tokens=60) for p in batch]
        results = [h.result(timeout=300) for h in handles]
        for prompt, result in zip(batch, results):
            assert result.token_ids == designed.continuation(prompt, 60)
        assert sum(r.stats.preemptions for r in results) >= 10
        assert_only_the_cache_holds_cells(runner)
    finally:
        runner.close()
    assert runner.executor.allocator.num_used == 0


def test_a_failing_step_fails_only_its_requests(toy_artifact):
    runner = open_runner(toy_artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    real_launch = runner.executor.launch
    armed = threading.Event()

    def flaky_launch(chunks, *args):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected device failure")
        return real_launch(chunks, *args)

    runner.executor.launch = flaky_launch
    try:
        armed.set()
        failed = runner.generate([256, 1, 2], max_new_tokens=4)
        assert failed.finish_reason is FinishReason.ERROR and "injected" in failed.error
        ok = runner.generate([256, 1, 2], max_new_tokens=4)
        assert ok.token_ids == toy_greedy_continuation([256, 1, 2], 4)
        assert ok.stats.reused_tokens == 0  # the failed step's cells were not cached
        assert_only_the_cache_holds_cells(runner)
    finally:
        runner.close()


def test_submit_refuses_what_can_never_run(toy_runner):
    from pt2serve.errors import Pt2ServeError

    with pytest.raises(Pt2ServeError, match="exceeds the artifact's max context"):
        toy_runner.submit([1] * 250, max_new_tokens=10)
    with pytest.raises(Pt2ServeError, match="outside the vocabulary"):
        toy_runner.submit([1, 100000], max_new_tokens=1)
    with pytest.raises(Pt2ServeError, match="empty"):
        toy_runner.submit([], max_new_tokens=1)
    with pytest.raises(Pt2ServeError, match="max_new_tokens"):
        toy_runner.submit([1], max_new_tokens=0)


def test_stop_strings_end_the_text(tiny_runner):
    free = tiny_runner.generate("stop test", max_new_tokens=30, ignore_eos=True)
    assert len(free.text) > 4
    stop = free.text[2:4]
    stopped = tiny_runner.generate("stop test", max_new_tokens=30, ignore_eos=True, stop_strings=(stop,))
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.text == free.text[: free.text.index(stop)]


def test_the_next_step_is_launched_before_the_last_ones_ids_are_read(toy_artifact):
    """One step in flight: step k+1 is planned, packed and launched before step k's ids are read, and the
    decodes fed by in-flight samples still produce every request's exact tokens."""
    from pt2serve.runtime.artifact import load_artifact
    from pt2serve.runtime.executor import Executor
    from pt2serve.runtime.runner import Runner

    executor = RecordingExecutor(Executor(load_artifact(toy_artifact), CELLS))
    runner = Runner(executor, config=RunnerConfig(token_budget=64))
    try:
        batch = random_prompts(6, seed=3)
        handles = [runner.submit(p, max_new_tokens=12) for p in batch]
        for handle, prompt in zip(handles, batch):
            assert handle.result(timeout=300).token_ids == toy_greedy_continuation(prompt, 12)
        assert_only_the_cache_holds_cells(runner)
    finally:
        runner.close()
    order = {entry: position for position, entry in enumerate(executor.log)}
    launches = [index for kind, index in executor.log if kind == "launch"]
    assert len(launches) >= 12
    overlapped = [k for k in launches[:-1] if order[("launch", k + 1)] < order[("result", k)]]
    # Every step that has a successor was still unread when that successor was launched (the engine only
    # waits on a step with nothing else to launch: at the very end).
    assert len(overlapped) == len(launches) - 1


def test_a_turns_events_are_flushed_once_for_all_the_requests_that_share_an_on_flush(toy_runner):
    """on_flush runs once per engine turn, after that turn's events, however many requests share it: a server
    wakes its event loop once a step, not once per event (serve/generation.py's EventBridge)."""
    log: list[int | str] = []  # request index per event, "flush" per flush; both written on the engine thread
    prompts = random_prompts(6, seed=5)

    def flush() -> None:  # one callable for every request, as a server's bridge
        log.append("flush")

    handles = [toy_runner.submit(prompt, max_new_tokens=10, on_event=lambda event, i=i: log.append(i),
                                 on_flush=flush)
               for i, prompt in enumerate(prompts)]
    for handle in handles:
        handle.result(timeout=300)
    deadline = time.monotonic() + 10
    while log[-1] != "flush":  # the final events are flushed as the engine next waits
        assert time.monotonic() < deadline, "the last events were never flushed"
        time.sleep(0.01)
    bursts, burst = [], []
    for entry in log:
        if entry == "flush":
            bursts.append(burst)
            burst = []
        else:
            burst.append(entry)
    assert sorted(i for burst in bursts for i in burst) == sorted(i for i in range(6) for _ in range(10))
    assert all(burst for burst in bursts)  # a flush always has something new to hand over
    assert all(len(set(burst)) == len(burst) for burst in bursts)  # one step's events: one token a request
    assert max(len(burst) for burst in bursts) == 6  # the requests decoding together come in one burst
    assert len(bursts) <= 10 + 6  # about one flush a step: far fewer than the 60 events


def test_a_stop_string_completed_by_the_last_allowed_token_reports_stop(tiny_runner):
    """The token that completes a stop string is also the last one max_new_tokens allows: the text is cut
    and the finish reason is still "stop" (not "length")."""
    free = tiny_runner.submit("stop test", max_new_tokens=30, ignore_eos=True)
    last, text, stop = stop_at_token([event.text for event in free.events(timeout=60) if event.token_id is not None])
    stopped = tiny_runner.generate("stop test", max_new_tokens=last, ignore_eos=True, stop_strings=(stop,))
    assert stopped.stats.completion_tokens == last
    assert stopped.text == text[:-2]
    assert stopped.finish_reason is FinishReason.STOP


def test_a_stop_string_ends_the_request_in_the_engine_too(tiny_runner):
    """After the token that completes a stop string the request decodes no further (the steps run are its
    prefill, its decodes up to that token and the one already in flight), runs no more and holds no cell
    but those the prefix cache keeps."""
    free = tiny_runner.submit("stop test", max_new_tokens=200, ignore_eos=True)
    last, _, stop = stop_at_token([event.text for event in free.events(timeout=60) if event.token_id is not None])
    wait_until_idle(tiny_runner)
    first_step = tiny_runner.scheduler.step
    stopped = tiny_runner.generate("stop test", max_new_tokens=200, ignore_eos=True, stop_strings=(stop,))
    assert stopped.finish_reason is FinishReason.STOP and stopped.stats.completion_tokens == last
    assert_only_the_cache_holds_cells(tiny_runner)
    assert tiny_runner.scheduler.step - first_step <= last + 1


def test_prefill_pieces_are_never_shorter_than_the_min_prefill_chunk(tiny_artifact):
    """Two long prompts at once under a small budget: a prompt's piece that does not end it is at least
    min_prefill_chunk tokens; a step whose room left is smaller runs without it."""
    min_chunk = 14
    runner = open_runner(tiny_artifact, executor_config=CELLS,
                         runner_config=RunnerConfig(token_budget=16, min_prefill_chunk=min_chunk))
    real_launch = runner.executor.launch
    pieces: list[tuple[int, bool]] = []  # (tokens, ends its prompt) of every prefill chunk

    def recording_launch(chunks, *args):
        pieces.extend((len(c.tokens), c.sampling is not None) for c in chunks if len(c.tokens) > 1)
        return real_launch(chunks, *args)

    runner.executor.launch = recording_launch
    try:
        handles = [runner.submit([256] + list(range(length)), max_new_tokens=2) for length in (19, 59)]
        for handle in handles:
            assert handle.result(timeout=60).finish_reason is FinishReason.LENGTH
    finally:
        runner.close()
    assert all(count >= min_chunk for count, ends in pieces if not ends), pieces
    assert any(ends and count < min_chunk for count, ends in pieces)  # a remainder may be shorter


def test_the_widest_step_run_at_start_touches_no_real_cell(toy_artifact, monkeypatch):
    """The step a runner runs at start to hold its widest step's memory (on by default on CUDA) is its token
    budget with every decode sampled; it writes only the scratch cell, and the runner then serves the designed
    tokens."""
    steps = []
    original = Executor.step
    monkeypatch.setattr(Executor, "step", lambda self, chunks: steps.append(chunks) or original(self, chunks))
    executor = Executor(load_artifact(toy_artifact), ExecutorConfig(num_cells=512))
    runner = Runner(executor, None, RunnerConfig(token_budget=96, max_decode_sequences=40, reserve_widest_step=True))
    try:
        (chunks,) = steps
        assert sum(len(c.tokens) for c in chunks) == 96 and sum(c.is_sampled for c in chunks) == 40
        pools = torch.stack(executor.pools)  # [2 * layers, cells, kv heads, head dim]
        assert pools[:, SCRATCH_CELL].abs().sum() > 0 and not pools[:, SCRATCH_CELL + 1:].any()
        assert executor.allocator.num_used == 0
        prompt = [5, 9, 11]
        assert runner.generate(prompt, max_new_tokens=6).token_ids == toy_greedy_continuation(prompt, 6)
    finally:
        runner.close()


def test_long_prompts_on_a_small_pool_are_preempted_at_most_once_and_reuse_none_of_their_own(tiny_artifact):
    """Three prompts that do not fit the pool together (a soak's three 900-token prompts on 3,000 cells took 18
    preemptions, and the third reported its own recomputed prompt as cached_tokens: 900): the latest waits
    for room instead of being admitted and preempted again, step after step, and a request restarting from
    the cells it computed itself before its preemption reports none of them as reused."""
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(200)] for _ in range(3)]  # no shared first token (bos)
    runner = open_runner(tiny_artifact, device="cpu", executor_config=ExecutorConfig(num_cells=601))
    try:
        handles = [runner.submit(prompt, max_new_tokens=56, ignore_eos=True) for prompt in prompts]
        crowded = [handle.result(timeout=300) for handle in handles]
        alone = [runner.generate(prompt, max_new_tokens=56, ignore_eos=True) for prompt in prompts[2:]]
    finally:
        runner.close()
    preemptions = [done.stats.preemptions for done in crowded]
    assert max(preemptions) <= 1 and sum(preemptions) >= 1, preemptions  # pressure, but no back-and-forth
    assert [done.stats.reused_tokens for done in crowded] == [0, 0, 0]
    assert crowded[2].token_ids == alone[0].token_ids
    assert alone[0].stats.reused_tokens == 199  # a later request with the same prompt does reuse its cells
