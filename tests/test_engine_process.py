"""The engine in a process of its own (runtime/engine_process.py): the same tokens, events, stats and refusals as
a Runner in the caller's process, and every request ended, never lost, when the engine process goes away."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from conftest import random_prompts, sampled_alone_and_in_a_batch, toy_recall_continuation
from servers import ServeProcess

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.engine_process import EngineProcess
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.grammar import GrammarSpec
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.runtime.sampling import SamplingParams


def open_engine(artifact) -> EngineProcess:
    """toy_runner's pool and step budget (4,096 cells, 64 tokens a step), in a process of its own."""
    return EngineProcess(artifact, "cpu", ExecutorConfig(num_cells=4097), RunnerConfig(token_budget=64), threads=1)


@pytest.fixture(scope="module")
def engine(recall_artifact):
    engine = open_engine(recall_artifact)
    yield engine
    engine.close()


def test_batched_requests_get_the_tokens_attention_reads_from_their_own_cells(engine):
    # toy-recall's next token is read through attention from RECALL_LAG positions back: K/V written to the wrong
    # cells, or events delivered to the wrong request across the pipe, change them.
    prompts = random_prompts(24, seed=3)
    handles = [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
    for prompt, handle in zip(prompts, handles):
        done = handle.result(timeout=60)
        assert done.token_ids == toy_recall_continuation(prompt, 12)
        assert done.finish_reason is FinishReason.LENGTH
        assert done.stats.completion_tokens == 12 and done.stats.prompt_tokens == len(prompt)
    assert engine.num_active == 0


def test_streamed_events_come_in_order_and_flushed_once_per_turn(engine):
    events, flushes = [], []
    handle = engine.submit([7, 8, 9], max_new_tokens=6, ignore_eos=True, on_event=events.append,
                           on_flush=lambda: flushes.append(len(events)))
    done = handle.result(timeout=60)
    assert [e.token_id for e in events] == done.token_ids == toy_recall_continuation([7, 8, 9], 6)
    assert events[-1].finish_reason is FinishReason.LENGTH and all(e.finish_reason is None for e in events[:-1])
    assert flushes and flushes[-1] == len(events)  # the last event was followed by a flush
    assert flushes == sorted(set(flushes))  # never twice for the same events


def test_a_seeded_sampled_request_beside_greedy_ones_draws_what_it_draws_alone(engine):
    sampling = SamplingParams(temperature=1.5, seed=11)
    alone, batched = sampled_alone_and_in_a_batch(engine, [3, 1, 4, 1, 5], 16, sampling, random_prompts(6, seed=5),
                                                  others_greedy=True)
    assert alone == batched
    other_seed = engine.generate([3, 1, 4, 1, 5], max_new_tokens=16, ignore_eos=True,
                                 sampling=SamplingParams(temperature=1.5, seed=12))
    assert other_seed.token_ids != alone  # the seed crossed the pipe: another one draws otherwise


def test_a_repeated_prompt_reports_its_reused_cells_and_the_engine_its_stats(engine):
    prompt = list(range(40, 100))
    first = engine.generate(prompt, max_new_tokens=2, ignore_eos=True)
    again = engine.generate(prompt, max_new_tokens=2, ignore_eos=True)
    assert first.stats.reused_tokens == 0 and again.stats.reused_tokens > 0  # stats cross with the final event
    stats = engine.stats
    assert stats.num_steps > 0 and stats.prefix_cache_cells > 0 and stats.num_running == 0
    assert engine.device_memory() is None  # on the CPU
    engine.clear_prefix_cache()
    assert engine.stats.prefix_cache_cells == 0


def test_bad_requests_are_refused_in_the_callers_process(engine):
    with pytest.raises(Pt2ServeError, match="exceeds the artifact's max context"):
        engine.submit([1] * 10, max_new_tokens=engine.max_context)
    with pytest.raises(Pt2ServeError, match="outside the vocabulary"):
        engine.submit([engine.vocab_size])
    with pytest.raises(Pt2ServeError, match=r"logprobs must be in \[0, "):
        engine.submit([1], logprobs=10_000)
    assert engine.num_active == 0
    assert engine.generate([5, 6], max_new_tokens=1).token_ids == toy_recall_continuation([5, 6], 1)


def test_cancel_and_a_raising_callback_end_only_their_own_request(engine):
    long = engine.submit([9] * 8, max_new_tokens=240, ignore_eos=True)
    engine.cancel(long)
    assert long.result(timeout=60).finish_reason is FinishReason.CANCELLED

    def explode(event):
        raise RuntimeError("boom")

    failed = engine.submit([1, 2], max_new_tokens=50, ignore_eos=True, on_event=explode).result(timeout=60)
    assert failed.finish_reason is FinishReason.ERROR and "RuntimeError: boom" in failed.error
    assert engine.generate([1, 2], max_new_tokens=3, ignore_eos=True).token_ids == toy_recall_continuation([1, 2], 3)
    deadline = time.monotonic() + 30
    while engine.stats.num_running and time.monotonic() < deadline:  # the engine was told to cancel it
        time.sleep(0.05)
    assert engine.stats.num_running == 0 and engine.num_active == 0


def test_close_ends_live_requests_and_the_process(recall_artifact):
    engine = open_engine(recall_artifact)
    live = engine.submit([4, 4], max_new_tokens=250, ignore_eos=True)
    engine.close()
    assert live.result(timeout=10).finish_reason is FinishReason.CANCELLED
    assert engine._process.poll() == 0
    with pytest.raises(Pt2ServeError, match="shut down"):
        engine.submit([1])


def test_a_killed_engine_fails_its_requests_and_refuses_new_ones(recall_artifact):
    engine = open_engine(recall_artifact)
    live = engine.submit([4, 4], max_new_tokens=250, ignore_eos=True)
    os.kill(engine.pid, signal.SIGKILL)
    done = live.result(timeout=30)
    assert done.finish_reason is FinishReason.ERROR and "the engine process exited (exit code -9)" in done.error
    with pytest.raises(Pt2ServeError, match=r"exit code -9"):
        engine.submit([1])
    with pytest.raises(Pt2ServeError, match=r"exit code -9"):
        engine.stats
    engine.close()  # returns: nothing is left to stop


def test_an_artifact_that_cannot_load_is_a_message(tmp_path):
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"not an artifact")
    with pytest.raises(Pt2ServeError) as err:
        EngineProcess(bad, "cpu")
    assert "Traceback" not in str(err.value) and str(bad) in str(err.value)


def test_the_cli_serves_through_an_engine_process_and_drains_on_sigterm(tiny_artifact):
    served = ServeProcess(tiny_artifact, "--engine-process", "--threads", "1")
    try:
        assert re.search(r"; engine in process \d+, CPU threads: 1;", served.load_line), served.load_line
        with httpx.Client(base_url=served.url, timeout=60) as http:
            done = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4, "ignore_eos": True}).json()
            assert done["usage"]["completion_tokens"] == 4
            # A grammar crosses as its spec and is compiled again in the engine process.
            shaped = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 8,
                                                        "guided_regex": "[xy]{3}"})
            assert re.fullmatch("[xy]{3}", shaped.json()["choices"][0]["text"]), shaped.text
            metrics = http.get("/metrics").text
            assert re.search(r"^pt2serve_requests_running 0\.0$", metrics, re.M) and "pt2serve_kv_cells_used" in metrics
            with http.stream("POST", "/v1/completions", json={"prompt": "ab", "max_tokens": 200, "stream": True,
                                                              "ignore_eos": True}) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # running when the signal comes
                served.process.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # drained: the stream finished
    finally:
        code, stderr = served.stop()
    assert code == 0, stderr
    assert "Traceback" not in stderr


def test_structured_output_compiles_on_both_sides(tiny_artifact):
    engine = EngineProcess(tiny_artifact, "cpu", threads=1)
    try:
        with pytest.raises(Pt2ServeError, match="cannot be compiled"):
            engine.submit([256, 1], grammar=GrammarSpec("regex", "(unclosed"))
        done = engine.generate([256, 3], max_new_tokens=20, sampling=SamplingParams(temperature=1.0, seed=1),
                               grammar=GrammarSpec("regex", "[ab]{4}"))
        assert re.fullmatch("[ab]{4}", done.text), done.text
    finally:
        engine.close()
