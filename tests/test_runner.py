"""The batching runner on real compiled artifacts (CPU): exact tokens under batching, prefix reuse,
cancellation, failure isolation."""

from __future__ import annotations

import random
import threading
import time

import pytest

from pt2serve.model.presets import toy_greedy_continuation
from pt2serve.runtime.engine import describe_load, open_runner
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.runtime.sampling import SamplingParams

CELLS = ExecutorConfig(num_cells=4097)


@pytest.fixture(scope="module")
def toy_runner(toy_artifact):
    runner = open_runner(toy_artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def tiny_runner(tiny_artifact):
    runner = open_runner(tiny_artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    yield runner
    runner.close()


def wait_until_idle(runner, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while runner.num_active and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the engine refreshes its stats after draining commands


def assert_only_the_cache_holds_cells(runner) -> None:
    """Once idle, every cell in use is the prefix cache's; closing the runner returns the pool to empty."""
    wait_until_idle(runner)
    assert runner.stats.cells_used == runner.stats.prefix_cache_cells


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 90))] for _ in range(count)]


def test_load_report_says_how_steps_run(toy_runner, toy_artifact):
    line = describe_load(toy_runner)
    assert "KV pool 4.2 MB for 4,096 tokens (as asked)" in line and "every step runs forward_others" in line
    forced = open_runner(toy_artifact, executor_config=ExecutorConfig(num_cells=64, use_static_methods=True))
    try:
        assert "static methods run without them" in describe_load(forced)
    finally:
        forced.close()


def test_staggered_requests_match_their_solo_tokens_and_batch(toy_runner):
    batch = prompts(16)
    first_step = toy_runner.scheduler.step
    handles = []
    # Arrivals 1 ms apart, each request 120 steps long: they overlap however fast a step is.
    for prompt in batch:
        handles.append(toy_runner.submit(prompt, max_new_tokens=120))
        time.sleep(0.001)
    results = [h.result(timeout=120) for h in handles]
    for prompt, result in zip(batch, results):
        assert result.token_ids == toy_greedy_continuation(prompt, 120)
        assert result.finish_reason is FinishReason.LENGTH
        assert result.stats.prompt_tokens == len(prompt) and result.stats.completion_tokens == 120
    solo = toy_runner.generate(batch[3], max_new_tokens=120)
    assert solo.token_ids == results[3].token_ids
    steps = [s for s in toy_runner.step_history if s.step > first_step]
    assert max(s.num_decode for s in steps) >= 8  # many sequences really decoded together
    assert any(s.num_decode and s.num_tokens > s.num_decode for s in steps)  # decode + prefill mixed


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_runner):
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = [256, 10, 20, 30, 40]
    alone = tiny_runner.generate(prompt, max_new_tokens=20, sampling=sampling, ignore_eos=True)
    others = [tiny_runner.submit(p, max_new_tokens=20, sampling=SamplingParams(temperature=1.0, seed=i),
                                 ignore_eos=True) for i, p in enumerate(prompts(6, seed=5))]
    batched = tiny_runner.submit(prompt, max_new_tokens=20, sampling=sampling, ignore_eos=True)
    assert batched.result(timeout=60).token_ids == alone.token_ids
    for handle in others:
        handle.result(timeout=60)
    different_seed = tiny_runner.generate(prompt, max_new_tokens=20, ignore_eos=True,
                                          sampling=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99))
    assert different_seed.token_ids != alone.token_ids


def test_a_continuation_prefills_only_its_new_suffix_with_or_without_a_session(toy_runner):
    history = [256, 1, 2, 3, 4, 5, 6, 7]
    first = toy_runner.generate(history, max_new_tokens=6, session_id="chat")
    follow_up = history + first.token_ids + [40, 41, 42]
    warm = toy_runner.generate(follow_up, max_new_tokens=6)
    assert warm.token_ids == toy_greedy_continuation(follow_up, 6)
    # All of the first exchange but its last sampled token (never fed back) was already in cells.
    assert warm.stats.reused_tokens == len(history) + len(first.token_ids) - 1
    assert warm.stats.prefilled_tokens == len(follow_up) - warm.stats.reused_tokens
    shares_one_token = toy_runner.generate([256, 99, 98], max_new_tokens=2, session_id="chat")
    assert shares_one_token.stats.reused_tokens == 1


def test_greedy_tokens_with_reuse_equal_those_without(tiny_artifact):
    """Families of random prompts that share prefixes of random lengths, run with the prefix cache and
    without it (tiny: random weights, so any K/V mix-up changes the tokens)."""
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


def test_prefix_cache_hit_rate_counts_reused_tokens(toy_artifact):
    runner = open_runner(toy_artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    try:
        system = [256] + list(range(100, 140))
        runner.generate(system + [1, 2, 3], max_new_tokens=4)
        prompt = system + [7, 8]
        reused = runner.generate(prompt, max_new_tokens=5)
        assert reused.token_ids == toy_greedy_continuation(prompt, 5)
        assert reused.stats.reused_tokens == len(system)
        wait_until_idle(runner)
        assert runner.stats.prefix_cache_hit_rate == pytest.approx(len(system) / (len(system) * 2 + 5))
    finally:
        runner.close()


def test_cancel_mid_decode_and_mid_prefill_frees_every_cell(toy_runner):
    decoding = toy_runner.submit([256, 5], max_new_tokens=200)
    events = decoding.events(timeout=30)
    next(events)
    next(events)
    toy_runner.cancel(decoding)
    assert decoding.result(timeout=30).finish_reason is FinishReason.CANCELLED
    long_prompt = [random.Random(1).randrange(256) for _ in range(200)]
    prefilling = toy_runner.submit(long_prompt, max_new_tokens=5)
    toy_runner.cancel(prefilling)
    assert prefilling.result(timeout=30).finish_reason is FinishReason.CANCELLED
    assert_only_the_cache_holds_cells(toy_runner)


def test_two_hundred_mixed_requests_leave_the_pool_empty(toy_artifact):
    runner = open_runner(toy_artifact, executor_config=ExecutorConfig(num_cells=1200),
                         runner_config=RunnerConfig(token_budget=64))
    try:
        rng = random.Random(7)
        handles = []
        for prompt in prompts(200, seed=11):
            handle = runner.submit(prompt, max_new_tokens=rng.randint(1, 12),
                                   sampling=SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99)))
            handles.append(handle)
            if rng.random() < 0.2:
                runner.cancel(handle)
        reasons = {h.result(timeout=300).finish_reason for h in handles}
        assert reasons <= {FinishReason.LENGTH, FinishReason.CANCELLED, FinishReason.STOP}
        assert_only_the_cache_holds_cells(runner)
    finally:
        runner.close()
    assert runner.executor.allocator.num_used == 0


def test_a_failing_step_fails_only_its_requests(toy_artifact):
    runner = open_runner(toy_artifact, executor_config=CELLS, runner_config=RunnerConfig(token_budget=64))
    real_launch = runner.executor.launch
    armed = threading.Event()

    def flaky_launch(chunks):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected device failure")
        return real_launch(chunks)

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


class RecordingExecutor:
    """The real executor, with the order of launches and result reads recorded."""

    def __init__(self, executor) -> None:
        self._executor = executor
        self.log: list[tuple[str, int]] = []

    def __getattr__(self, name: str):
        return getattr(self._executor, name)

    def launch(self, chunks):
        index = sum(kind == "launch" for kind, _ in self.log)
        self.log.append(("launch", index))
        pending = self._executor.launch(chunks)
        log = self.log

        class Recorded:
            def result(self):
                log.append(("result", index))
                return pending.result()

        return Recorded()


def test_the_next_step_is_launched_before_the_last_ones_ids_are_read(toy_artifact):
    """One step in flight: step k+1 is planned, packed and launched before step k's ids are read, and the
    decodes fed by in-flight samples still produce every request's exact tokens."""
    from pt2serve.runtime.artifact import load_artifact
    from pt2serve.runtime.executor import Executor
    from pt2serve.runtime.runner import Runner

    executor = RecordingExecutor(Executor(load_artifact(toy_artifact), CELLS))
    runner = Runner(executor, config=RunnerConfig(token_budget=64))
    try:
        batch = prompts(6, seed=3)
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
