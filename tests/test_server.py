"""The HTTP server: real uvicorn on 127.0.0.1, driven with the official openai client and raw httpx.

Two server instances share one runner over the tiny artifact (the cells that requests hold, all in use
but the prefix cache's, return to their baseline once a request ends): `server` is open, `strict` wants an
API key and sheds load past one active request.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from conftest import stop_at_token
from pt2serve.runtime.engine import open_runner
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.serve import completions
from pt2serve.serve.app import attach_runner, create_app
from pt2serve.serve.command import default_threads
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.generation import EventBridge
from servers import ServeProcess, ServerThread
from pt2serve.serve.openai_format import CompletionFormat, sse

MODEL = "tiny"
API_KEY = "test-key-123"
VOCAB = 258  # the tiny-random preset's byte vocabulary: 256 bytes, bos, eos


@pytest.fixture(scope="module")
def runner(tiny_artifact):
    runner = open_runner(tiny_artifact, device="cpu", runner_config=RunnerConfig(max_sessions=8))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def server(runner):
    thread = ServerThread(create_app(ServerConfig(model_name=MODEL), runner)).start()
    yield thread.url
    thread.stop()


@pytest.fixture(scope="module")
def strict(runner):
    config = ServerConfig(model_name=MODEL, api_key=API_KEY, max_queued=1)
    thread = ServerThread(create_app(config, runner)).start()
    yield thread.url
    thread.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="x", timeout=60, max_retries=0) as client:
        yield client


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. 'pt2serve_requests_total{finish_reason="stop"}'."""
    response = httpx.get(f"{url}/metrics", headers=headers or {})
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def stream_tokens(chunks, chat: bool) -> tuple[str, int, str | None, object]:
    """Text, token chunks, finish reason and usage of a streamed response."""
    text, tokens, finish, usage = [], 0, None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finish = choice.finish_reason
                continue
            tokens += 1
            text.append((choice.delta.content if chat else choice.text) or "")
    return "".join(text), tokens, finish, usage


# -- basics ------------------------------------------------------------------------------------------------


def test_health_and_models(server, client):
    response = httpx.get(f"{server}/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_health_reports_loading_until_a_runner_is_attached(runner):
    app = create_app(ServerConfig(model_name=MODEL))
    with TestClient(app) as http:
        assert http.get("/health").status_code == 503
        busy = http.post("/v1/completions", json={"prompt": "hi"})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_loading"
        attach_runner(app, runner, owns_runner=False)
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=1234)],
                         ids=["greedy", "seeded"])
def test_completion_streamed_equals_non_streamed(client, sampling):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=24, **sampling)
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == MODEL
    assert full.usage.prompt_tokens == len("The capital of France is") + 1  # bytes + bos
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 24

    chunks = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text, tokens, finish, usage = stream_tokens(chunks, chat=False)
    assert text == choice.text
    assert finish == choice.finish_reason
    assert tokens == usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.8, seed=7)], ids=["greedy", "seeded"])
def test_chat_streamed_equals_non_streamed(client, sampling):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=20, **sampling)
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text, tokens, finish, usage = stream_tokens(chunks, chat=True)
    assert text == choice.message.content
    assert finish == choice.finish_reason
    assert tokens == usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_token_id_prompt_returns_token_ids(server):
    # Token 1 first: no other request starts with it, so nothing of it is cached yet.
    body = {"model": MODEL, "prompt": [1, 72, 105], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    assert all(0 <= t < VOCAB for t in choice["token_ids"])
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    again = httpx.post(f"{server}/v1/completions", json=body).json()
    assert again["choices"][0]["token_ids"] == choice["token_ids"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2  # all but the newest prompt token


def test_stop_string_is_honoured_and_cut(client):
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = full.choices[0].text
    if len(text) < 4:
        pytest.skip("the greedy continuation is too short to cut")
    stop = text[2:4]
    cut = client.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_streamed_stop_strings_and_a_stop_on_the_last_allowed_token(client):
    """Streaming with stop strings gives the non-streamed text and finish reason; a stop string completed
    by the last token max_tokens allows still finishes with "stop"."""
    kwargs = dict(model=MODEL, prompt="stream a stop", temperature=0, extra_body={"ignore_eos": True})
    deltas = [c.choices[0].text for c in client.completions.create(**kwargs, max_tokens=30, stream=True)
              if c.choices and c.choices[0].finish_reason is None]
    last, text, stop = stop_at_token(deltas)
    for max_tokens, expected in ((30, text[:-2]), (last, text[:-2])):
        full = client.completions.create(**kwargs, max_tokens=max_tokens, stop=[stop, "never seen"])
        assert (full.choices[0].text, full.choices[0].finish_reason) == (expected, "stop"), max_tokens
        chunks = client.completions.create(**kwargs, max_tokens=max_tokens, stop=[stop, "never seen"], stream=True,
                                           stream_options={"include_usage": True})
        streamed, tokens, finish, usage = stream_tokens(chunks, chat=False)
        assert (streamed, finish) == (expected, "stop"), max_tokens
        assert tokens == usage.completion_tokens == full.usage.completion_tokens == last


# -- concurrency --------------------------------------------------------------------------------------------


def test_32_concurrent_streams_have_exact_usage(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> None:
        max_tokens = 8 + i % 9
        stream = await client.completions.create(
            model=MODEL, prompt=f"client {i} says", max_tokens=max_tokens, temperature=0.7, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        text, tokens, finish, usage = stream_tokens(chunks, chat=False)
        assert finish == "length"
        assert tokens == usage.completion_tokens == max_tokens
        assert usage.prompt_tokens == len(f"client {i} says") + 1
        assert usage.total_tokens == usage.prompt_tokens + max_tokens

    async def main() -> None:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", timeout=60, max_retries=0) as client:
            await asyncio.gather(*(one(client, i) for i in range(32)))

    before = metrics(server)
    asyncio.run(main())
    after = metrics(server)
    assert after['pt2serve_requests_total{finish_reason="length"}'] - before.get(
        'pt2serve_requests_total{finish_reason="length"}', 0) == 32
    assert after["pt2serve_completion_tokens_total"] - before["pt2serve_completion_tokens_total"] == sum(
        8 + i % 9 for i in range(32))


def test_an_event_stays_one_line_for_clients_that_split_lines_like_python():
    """httpx's aiter_lines and requests' iter_lines split where str.splitlines does, which includes U+0085,
    U+2028 and U+2029: characters JSON leaves raw inside strings."""
    text = "a\x85b\u2028c\u2029d\re\nf"
    event = sse(CompletionFormat(MODEL).chunk(0, text, True, False)).decode()
    (line,) = [line for line in event.splitlines() if line]
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


# -- prefix reuse -------------------------------------------------------------------------------------------


def test_engine_events_reach_the_loop_in_order_with_one_wake_up_per_flush(caplog):
    """Events wait on the bridge until the engine flushes (once a step, as it is about to wait), then all of
    them run on the loop after one wake-up: none while the engine is still committing the step."""
    async def deliver() -> tuple[list[int], int, list[int]]:
        bridge = EventBridge(asyncio.get_running_loop())
        received, wake_ups, done = [], 0, asyncio.Event()
        before_flush = []  # how many events had reached the loop when each burst was flushed
        run_pending = bridge._run_pending

        def counted() -> None:
            nonlocal wake_ups
            wake_ups += 1
            run_pending()

        bridge._run_pending = counted

        def on_event(i: int) -> None:
            if i == 3:
                raise RuntimeError("a callback that breaks")
            received.append(i)
            if i == 199:
                done.set()

        def engine() -> None:  # two steps' bursts of 100 events, as the runner delivers a step's events
            for burst in range(2):
                for i in range(100 * burst, 100 * (burst + 1)):
                    bridge.call_soon(on_event, i)
                time.sleep(0.05)  # the loop is idle: it would have run anything it had been woken for
                before_flush.append(len(received))
                bridge.flush()
                bridge.flush()  # (a second flush before the loop has run wakes it no more)
                time.sleep(0.05)

        thread = threading.Thread(target=engine)
        thread.start()
        await asyncio.wait_for(done.wait(), 10)
        thread.join()
        return received, wake_ups, before_flush

    received, wake_ups, before_flush = asyncio.run(deliver())
    assert received == [i for i in range(200) if i != 3]  # in order; one failing callback stops no other
    assert before_flush == [0, 99]  # nothing of a burst runs before its flush
    assert wake_ups == 2  # one wake-up per flushed burst, not one per event
    assert any("a callback that breaks" in r.getMessage() or r.exc_info for r in caplog.records)


def test_only_text_prompts_and_grammars_wait_on_the_thread_pool(server, monkeypatch):
    """A prompt of token ids without a grammar goes straight to the runner: each hop to the thread pool and
    back waits for the GIL while the engine steps, and made a burst of requests late to start."""
    from pt2serve.serve import completions

    hops = []

    async def counted(function, *args):
        hops.append(function.__name__)
        return function(*args)

    monkeypatch.setattr(completions, "run_in_threadpool", counted)

    def complete(prompt, **fields) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, **fields}
        response = httpx.post(f"{server}/v1/completions", json=body)
        assert response.status_code == 200, response.text

    complete([256, 72, 105])
    assert hops == []
    complete("Hello")
    assert hops == ["_prompt_ids"]
    complete([256, 72, 105], response_format={"type": "json_object"})
    assert hops == ["_prompt_ids", "_compile_grammar"]


def test_a_continuation_reuses_the_previous_turn_with_or_without_a_session(server):
    prompt = [256, *b"Once upon a time in a session test"]

    def complete(ids, session=None):
        body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        headers = {"X-Session-ID": session} if session else {}
        response = httpx.post(f"{server}/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.json()

    first = complete(prompt, "story-1")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < len(prompt)
    follow_up = prompt + first["choices"][0]["token_ids"] + list(b" and then")
    second = complete(follow_up, "story-1")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Everything computed in the first turn: its prompt and all its tokens but the last sampled one.
    assert cached == len(prompt) + 8 - 1
    other = complete(follow_up)  # no session: the same cells serve it
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == len(follow_up) - 1
    # The body field works as the header does.
    body = {"model": MODEL, "prompt": follow_up + second["choices"][0]["token_ids"], "max_tokens": 2,
            "session_id": "story-1", "temperature": 0}
    third = httpx.post(f"{server}/v1/completions", json=body).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > cached


def session_turn(http, prompt: list[int], session: str | None, max_tokens: int = 8) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body, headers={"X-Session-ID": session} if session else {})
    assert response.status_code == 200, response.text
    return response.json()


def test_two_concurrent_requests_on_one_session(server, slow_engine):
    """Both extend the session's history at once: both reuse its cached prefix, both give the solo tokens, and
    no cell leaks."""
    prompt = [256, *b"Twins share a session"]
    with httpx.Client(base_url=server, timeout=30) as http:
        first = session_turn(http, prompt, "twins")
        follow_up = prompt + first["choices"][0]["token_ids"] + list(b" and")
        solo = session_turn(http, follow_up, None, max_tokens=20)

    async def both() -> list[dict]:
        async with httpx.AsyncClient(base_url=server, timeout=30) as http:
            bodies = {"model": MODEL, "prompt": follow_up, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            replies = await asyncio.gather(*(http.post("/v1/completions", json=bodies,
                                                       headers={"X-Session-ID": "twins"}) for _ in range(2)))
        assert [r.status_code for r in replies] == [200, 200]
        return [r.json() for r in replies]

    replies = asyncio.run(both())
    for reply in replies:
        assert reply["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt)
    deadline = time.monotonic() + 10
    while metrics(server).get("pt2serve_kv_cells_leaked", 0) or metrics(server)["pt2serve_requests_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("header, message", [("", "1 to 256 characters"), ("x" * 257, "1 to 256 characters")],
                         ids=["empty", "too-long"])
def test_a_bad_session_header_is_a_400(server, header, message):
    response = httpx.post(f"{server}{COMPLETIONS}", json=OK, headers={"X-Session-ID": header})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "session_id" and message in error["message"]
def test_a_chat_reuses_every_earlier_turn_though_its_replies_come_back_as_text(server):
    """Each turn sends the whole conversation as messages, the model's replies as the text it was given;
    that text re-encodes to other ids than the ones sampled (the tiny model emits bytes that are not
    UTF-8), yet every earlier turn's prompt is reused."""
    messages = [{"role": "system", "content": "You answer every question with a riddle."}]
    earlier_prompt = earlier_completion = 0
    short_of_the_whole_exchange = 0
    for turn in range(3):
        messages.append({"role": "user", "content": f"What is riddle number {turn}?"})
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server}{CHAT}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if turn:
            assert cached >= earlier_prompt
            short_of_the_whole_exchange += cached < earlier_prompt + earlier_completion - 1
        earlier_prompt, earlier_completion = usage["prompt_tokens"], usage["completion_tokens"]
        messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
    assert short_of_the_whole_exchange  # some reply did come back as other ids


# -- bad input -----------------------------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 4}

BAD_REQUESTS = [
    # (path, body: dict for JSON or bytes as sent, status, message substring, param)
    (COMPLETIONS, b"{not json", 400, "not valid JSON", None),
    (COMPLETIONS, b"", 400, "body is empty", None),
    (COMPLETIONS, b"[1, 2]", 400, "must be a JSON object", None),
    (COMPLETIONS, {**OK, "max_tokens": "ten"}, 400, "valid integer", "max_tokens"),
    (COMPLETIONS, {**OK, "max_tokens": 0}, 400, "greater than or equal to 1", "max_tokens"),
    (COMPLETIONS, {**OK, "max_tokens": 10**6}, 400, "exceeds this model's context", "max_tokens"),
    (COMPLETIONS, {**OK, "temperature": -0.5}, 400, "greater than or equal to 0", "temperature"),
    (COMPLETIONS, {**OK, "temperature": 1000}, 400, "less than or equal to 100", "temperature"),
    (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, "finite number", "temperature"),
    (COMPLETIONS, {**OK, "top_p": 0}, 400, "greater than 0", "top_p"),
    (COMPLETIONS, {**OK, "top_p": 1.5}, 400, "less than or equal to 1", "top_p"),
    (COMPLETIONS, {**OK, "top_k": -1}, 400, "greater than or equal to 0", "top_k"),
    (COMPLETIONS, {**OK, "n": 129}, 400, "less than or equal to 128", "n"),
    (COMPLETIONS, {"model": MODEL, "prompt": ["a"] * 65, "n": 2}, 400, "more than 128 choices", "n"),
    (COMPLETIONS, {**OK, "stream": "yes"}, 400, "valid boolean", "stream"),
    (COMPLETIONS, {**OK, "stop": [1, 2]}, 400, "stop must be", "stop"),
    (COMPLETIONS, {**OK, "stop": [str(i) for i in range(17)]}, 400, "at most 16 stop strings", "stop"),
    (COMPLETIONS, {**OK, "stop_token_ids": list(range(17))}, 400, "at most 16 items", "stop_token_ids"),
    (COMPLETIONS, {**OK, "stop_token_ids": [VOCAB]}, 400, "outside the vocabulary", "stop_token_ids"),
    (COMPLETIONS, {**OK, "stop_token_ids": ["a"]}, 400, "valid integer", "stop_token_ids.0"),
    (COMPLETIONS, {**OK, "seed": 1.5}, 400, "valid integer", "seed"),
    (COMPLETIONS, {**OK, "model": "gpt-9"}, 404, "'gpt-9' does not exist", "model"),
    (COMPLETIONS, {"model": MODEL}, 400, "Field required", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "must not be empty", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "must not be empty", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": 42}, 400, "string or a list of integer token ids", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, True]}, 400, "list of integer token ids", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, VOCAB]}, 400, "outside the vocabulary", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [-1]}, 400, "outside the vocabulary", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": ["a", ""]}, 400, "must not be empty", "prompt.1"),
    (COMPLETIONS, {"model": MODEL, "prompt": ["a", [1, VOCAB]]}, 400, "outside the vocabulary", "prompt.1"),
    (COMPLETIONS, {"model": MODEL, "prompt": ["a"] * 257}, 400, "at most 256 prompts", "prompt"),
    (COMPLETIONS, {**OK, "min_p": 0.1}, 400, "min_p is not supported", "min_p"),
    (COMPLETIONS, {**OK, "tools": []}, 400, "tools is not supported on /v1/completions", "tools"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "echo": True}, 400,
     "echo is not supported on /v1/chat/completions", "echo"),
    (COMPLETIONS, {**OK, "guided_regex": "(a"}, 400, "the regex cannot be compiled", "guided_regex"),
    (COMPLETIONS, {**OK, "guided_json": "{no"}, 400, "guided_json is not valid JSON", "guided_json"),
    (COMPLETIONS, {**OK, "guided_choice": []}, 400, "non-empty list", "guided_choice"),
    (COMPLETIONS, {**OK, "guided_regex": "a", "guided_grammar": "root ::= \"a\""}, 400, "at most one of",
     "guided_grammar"),
    (COMPLETIONS, {**OK, "structured_outputs": {"regex": "a"}}, 400, "structured_outputs is not supported",
     "structured_outputs"),
    (COMPLETIONS, b'{"prompt": "a\\ud800"}', 400, "not valid Unicode", "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [7] * 300}, 400, "context", "prompt"),
    (COMPLETIONS, {**OK, "logit_bias": {"a": 1}}, 400, "keys must be token ids", "logit_bias"),
    (COMPLETIONS, {**OK, "logit_bias": {"5": 101}}, 400, "values must be numbers in [-100, 100]", "logit_bias"),
    (COMPLETIONS, {**OK, "logit_bias": {str(VOCAB): 1}}, 400, "outside the vocabulary", "logit_bias"),
    (COMPLETIONS, {**OK, "presence_penalty": 2.5}, 400, "less than or equal to 2", "presence_penalty"),
    (COMPLETIONS, {**OK, "repetition_penalty": 0}, 400, "greater than 0", "repetition_penalty"),
    (COMPLETIONS, {**OK, "min_tokens": -1}, 400, "greater than or equal to 0", "min_tokens"),
    (COMPLETIONS, {**OK, "logprobs": 21}, 400, "logprobs must be an integer in [0, 20]", "logprobs"),
    (COMPLETIONS, {**OK, "logprobs": True}, 400, "logprobs must be an integer", "logprobs"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs", "top_logprobs"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400,
     "logprobs must be true or false", "logprobs"),
    (COMPLETIONS, {**OK, "stream_options": {"include_usage": True}}, 400, "only allowed with stream",
     "stream_options"),
    (COMPLETIONS, {**OK, "session_id": ""}, 400, "at least 1 character", "session_id"),
    (CHAT, {"model": MODEL}, 400, "Field required", "messages"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "non-empty list", "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role must be one of",
     "messages.0.role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "string or a list of text parts",
     "messages.0.content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "greater than or equal", "n"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "not valid Unicode", "messages.0.content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     400, "response_format type must be", "response_format"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
     "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
     400, "cannot be compiled", "response_format"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     400, "tool_choice needs tools", "tool_choice"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
     "function": {"name": "f"}}]}, 400, "chat template takes no tools", "tools"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
     "function": {"name": "bad name"}}]}, 400, "with a name of letters", "tools.0"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "4",
     "tool_call_id": "1"}]}, 400, "chat template takes no tools", "messages.1"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}]},
     400, "tool_call_id must be", "messages.1.tool_call_id"),
    (CHAT, {"model": MODEL, "messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     400, "must be {", "messages.0.tool_calls.0"),
]


@pytest.mark.parametrize("path,body,status,message,param", BAD_REQUESTS,
                         ids=[f"{i}-{case[3][:24]}" for i, case in enumerate(BAD_REQUESTS)])
def test_bad_request(server, path, body, status, message, param):
    if isinstance(body, bytes):
        response = httpx.post(f"{server}{path}", content=body, headers={"Content-Type": "application/json"})
    else:
        response = httpx.post(f"{server}{path}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"], error  # every 4xx says what kind of error it is
    assert message in error["message"], error
    assert error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert "Traceback" not in response.text


def test_the_tokenizer_endpoints_answer_as_vllms_and_as_the_generating_endpoints_tokenize(server, strict, runner):
    messages = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=server, timeout=30) as http:
        text = http.post("/tokenize", json={"model": MODEL, "prompt": "h\u00e9llo"}).json()
        assert text == {"count": 7, "max_model_len": runner.max_context, "tokens": [256, *"h\u00e9llo".encode()],
                        "token_strs": None}
        bare = http.post("/tokenize", json={"prompt": " hi", "add_special_tokens": False, "return_token_strs": True})
        assert bare.json()["tokens"] == [32, 104, 105] and bare.json()["token_strs"] == ["\u0120", "h", "i"]
        chat = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
        done = http.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
        assert chat["count"] == done["usage"]["prompt_tokens"]
        assert chat["tokens"] == runner.tokenizer.encode_chat(messages)
        unprompted = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        assert unprompted["count"] < chat["count"] and chat["tokens"][:unprompted["count"]] == unprompted["tokens"]
        detokenized = http.post("/detokenize", json={"model": MODEL, "tokens": text["tokens"]})
        assert detokenized.json() == {"prompt": "h\u00e9llo"}
        info = http.get("/tokenizer_info").json()
        assert (info["bos_token"], info["eos_token"]) == ("<|bos|>", "<|eos|>")
        assert info["chat_template"] == runner.tokenizer.chat_template
        assert info["model_max_length"] == runner.max_context
        # lm-eval's remote tokenizer finds the eos id so
        assert http.post("/tokenize", json={"prompt": "<|eos|>", "add_special_tokens": False}).json()["tokens"] == [257]
        for path, body, param in (("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                                  ("/tokenize", {"prompt": 3}, "prompt"),
                                  ("/tokenize", {"messages": [{"role": "robot"}]}, "messages.0.role"),
                                  ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
                                  ("/detokenize", {"tokens": "ab"}, "tokens")):
            refused = http.post(path, json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        assert http.post("/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404
    assert httpx.post(f"{strict}/tokenize", json={"prompt": "a"}).status_code == 401
    assert httpx.post(f"{strict}/tokenize", json={"prompt": "a"}, headers=AUTH).json()["count"] == 2


def test_oversized_body_and_unknown_route(server):
    huge = json.dumps({"model": MODEL, "prompt": "x" * (5 * 1024 * 1024)}).encode()
    response = httpx.post(f"{server}{COMPLETIONS}", content=huge, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "larger than" in response.json()["error"]["message"]
    before = metrics(server)
    assert response.json()["error"]["code"] == "request_too_large"
    missing = httpx.get(f"{server}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    assert missing.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(f"{server}{COMPLETIONS}")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    after = metrics(server)
    for status in (404, 405):
        key = f'pt2serve_requests_rejected_total{{status="{status}"}}'
        assert after[key] - before.get(key, 0) == 1


def test_server_is_healthy_after_bad_requests(server, client):
    key = 'pt2serve_requests_rejected_total{status="400"}'
    before = metrics(server).get(key, 0)
    with httpx.Client(base_url=server) as http:  # the whole table again, back to back on one connection
        for path, body, *_ in BAD_REQUESTS:
            http.post(path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert metrics(server)[key] - before == sum(1 for case in BAD_REQUESTS if case[2] == 400)
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    done = client.completions.create(model=MODEL, prompt="still here", max_tokens=4)
    assert done.usage.completion_tokens >= 1


def test_engine_failure_is_an_error_without_details(server, client, runner, monkeypatch):
    def broken_launch(chunks, *args):
        raise RuntimeError("device exploded at 0xdeadbeef")

    errors_before = metrics(server).get('pt2serve_requests_total{finish_reason="error"}', 0)
    monkeypatch.setattr(runner.executor, "launch", broken_launch)
    response = httpx.post(f"{server}{COMPLETIONS}", json=OK)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "generation_failed"
    assert "deadbeef" not in response.text
    with pytest.raises(openai.APIError, match="failed while generating"):
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True))
    monkeypatch.undo()
    assert client.completions.create(model=MODEL, prompt="recovered", max_tokens=2).usage.completion_tokens >= 1
    assert metrics(server)['pt2serve_requests_total{finish_reason="error"}'] - errors_before == 2


# -- auth, load shedding, disconnects ------------------------------------------------------------------------


def test_api_key_is_required_when_set(strict, server):
    assert httpx.get(f"{strict}/health").status_code == 200  # never behind the key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(f"{strict}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{strict}/metrics").status_code == 401
    assert httpx.post(f"{strict}{COMPLETIONS}", json=OK).status_code == 401
    with openai.OpenAI(base_url=f"{strict}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with openai.OpenAI(base_url=f"{strict}/v1", api_key=API_KEY, max_retries=0) as good:
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.prompt_tokens == 3
    assert httpx.get(f"{server}/v1/models").status_code == 200  # the open server needs none


LONG = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 100, "ignore_eos": True, "stream": True,
        "temperature": 0.9, "seed": 3}


@pytest.fixture
def slow_engine(runner, monkeypatch):
    """Each engine step takes at least 10 ms, so a long request is surely still running when the test acts."""
    launch = runner.executor.launch

    def slow_launch(chunks, *args):
        time.sleep(0.01)
        return launch(chunks, *args)

    monkeypatch.setattr(runner.executor, "launch", slow_launch)


def test_full_queue_answers_429(strict, slow_engine):
    with httpx.Client(base_url=strict, headers=AUTH, timeout=30) as http:
        with http.stream("POST", COMPLETIONS, json=LONG) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # kept: closing this iterator would close the connection
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            rejected = httpx.post(f"{strict}{COMPLETIONS}", json=OK, headers=AUTH)
            assert rejected.status_code == 429
            assert rejected.headers["Retry-After"] == "1"
            assert rejected.json()["error"]["type"] == "rate_limit_error"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10
    while True:  # the in-flight request has ended; the queue has room again
        response = httpx.post(f"{strict}{COMPLETIONS}", json=OK, headers=AUTH)
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert response.status_code == 200, response.text


def test_a_full_queue_answers_429_before_tokenizing_or_compiling_a_grammar(strict, slow_engine, monkeypatch):
    """A burst past the queue is refused at once: a 429 waits for no tokenizer and no grammar compiler (each
    runs on the thread pool, where a burst queues them)."""
    work = []
    with httpx.Client(base_url=strict, headers=AUTH, timeout=30) as http:
        with http.stream("POST", COMPLETIONS, json=LONG) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            monkeypatch.setattr(completions, "_prompt_ids", lambda *args: work.append("tokenized"))
            monkeypatch.setattr(completions, "_compile_grammar", lambda *args: work.append("compiled"))
            for body in ({**OK, "guided_regex": "[ab]+"}, {"model": MODEL, "messages": [{"role": "user",
                                                                                        "content": "hi"}]}):
                path = COMPLETIONS if "prompt" in body else CHAT
                rejected = http.post(path, json=body)
                assert rejected.status_code == 429 and rejected.json()["error"]["code"] == "queue_full"
            list(lines)
    assert work == []


def cells_used(url: str) -> float:
    """Cells held by requests: those in use but the prefix cache's."""
    samples = metrics(url, AUTH)
    return samples["pt2serve_kv_cells_used"] - samples["pt2serve_prefix_cache_cells"]


def assert_cancelled_and_freed(url: str, baseline: float, cancelled_before: float) -> None:
    deadline = time.monotonic() + 10
    while cells_used(url) != baseline:
        assert time.monotonic() < deadline, "the cells of a disconnected request were not freed"
        time.sleep(0.05)
    after = metrics(url, AUTH)
    assert after['pt2serve_requests_total{finish_reason="cancelled"}'] == cancelled_before + 1
    assert after["pt2serve_requests_running"] == 0 and after["pt2serve_requests_waiting"] == 0


def test_a_waiting_stream_gets_keep_alive_comments_that_clients_skip(strict, server, slow_engine, monkeypatch):
    """Every gap between a slow engine's steps is longer than the (shortened) keep-alive interval: the raw
    stream carries comments, and the openai client reads the same text as a whole completion."""
    monkeypatch.setattr(completions, "KEEP_ALIVE_S", 0.002)
    body = {**LONG, "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=strict, headers=AUTH, timeout=30) as http:
        with http.stream("POST", COMPLETIONS, json=body) as stream:
            lines = list(stream.iter_lines())
        whole = http.post(COMPLETIONS, json={**body, "stream": False}).json()["choices"][0]["text"]
    assert ": keep-alive" in lines
    assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    with httpx.Client(base_url=server, timeout=30) as http:  # two choices (strict runs one): merged streams
        with http.stream("POST", COMPLETIONS, json={**body, "n": 2}) as stream:
            two = list(stream.iter_lines())
    assert ": keep-alive" in two
    finished = [json.loads(line[6:])["choices"][0] for line in two if line.startswith("data: {")]
    assert sorted(c["index"] for c in finished if c["finish_reason"] == "length") == [0, 1]
    with openai.OpenAI(base_url=f"{strict}/v1", api_key=API_KEY, max_retries=0) as client:
        chunks = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                           extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole


def test_disconnect_mid_stream_frees_cells(strict, slow_engine):
    baseline = cells_used(strict)
    cancelled = metrics(strict, AUTH).get('pt2serve_requests_total{finish_reason="cancelled"}', 0)
    with httpx.Client(base_url=strict, headers=AUTH, timeout=30) as http:
        with http.stream("POST", COMPLETIONS, json={**LONG, "max_tokens": 230}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert cells_used(strict) > baseline
    assert_cancelled_and_freed(strict, baseline, cancelled)


def test_disconnect_while_waiting_for_a_whole_completion(strict, slow_engine, caplog):
    baseline = cells_used(strict)
    cancelled = metrics(strict, AUTH).get('pt2serve_requests_total{finish_reason="cancelled"}', 0)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{strict}{COMPLETIONS}", json={**LONG, "stream": False, "max_tokens": 230}, headers=AUTH,
                   timeout=httpx.Timeout(30, read=0.5))
    assert_cancelled_and_freed(strict, baseline, cancelled)
    gc.collect()  # an abandoned future complains when collected
    assert not [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


# -- connections ------------------------------------------------------------------------------------------


def connect(url: str, count: int) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    return [socket.create_connection((host, int(port)), timeout=5) for _ in range(count)]


def assert_closed_by_the_server(sockets: list[socket.socket], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    for sock in sockets:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass


def test_silent_connections_are_closed_and_keep_no_request_out(runner):
    """600 sockets that never send a request (one client opened them and left them): requests, /health and
    /metrics are answered meanwhile, and the server closes every one after the header timeout, and a socket
    that sends part of its headers and stops too. (They were held for ever, and past 512 of them every request
    got a 503.)"""
    thread = ServerThread(create_app(ServerConfig(model_name=MODEL, header_timeout_s=1.0), runner)).start()
    silent = connect(thread.url, 600)
    try:
        stalled = connect(thread.url, 1)[0]
        stalled.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
        with httpx.Client(base_url=thread.url, timeout=10) as http:
            assert http.get("/health").json() == {"status": "ok"}
            assert http.get("/metrics").status_code == 200
            assert http.post(COMPLETIONS, json=OK).status_code == 200
        assert_closed_by_the_server(silent + [stalled], within_s=10)
    finally:
        for sock in silent:
            sock.close()
        thread.stop()


def test_past_the_connection_budget_waiting_connections_give_way_and_requests_get_503_but_health(runner):
    config = ServerConfig(model_name=MODEL, max_connections=4, max_queued=1, header_timeout_s=60)
    thread = ServerThread(create_app(config, runner)).start()
    silent = connect(thread.url, 4)
    uploading = []
    try:
        with httpx.Client(base_url=thread.url, timeout=10) as http:
            assert http.post(COMPLETIONS, json=OK).status_code == 200
            assert_closed_by_the_server(silent[:1], within_s=5)  # the longest waiting, long before its timeout
            # Requests whose bodies never come stay in progress: four fill the budget.
            uploading = connect(thread.url, 4)
            for sock in uploading:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.2)
            refused = http.post(COMPLETIONS, json=OK)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "too_many_requests"
            assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
            assert metrics(thread.url)['pt2serve_requests_rejected_total{status="503"}'] >= 1
    finally:
        for sock in silent + uploading:
            sock.close()
        thread.stop()


def test_a_body_that_never_arrives_gets_408_and_frees_its_slot(runner):
    """Headers, then part of the body, then nothing: after --body-timeout the request is answered 408 and its
    connection closed, so it no longer counts against the connection budget (it held it for ever)."""
    config = ServerConfig(model_name=MODEL, max_connections=2, max_queued=1, body_timeout_s=1.0)
    thread = ServerThread(create_app(config, runner)).start()
    stalled = connect(thread.url, 2)
    try:
        for sock in stalled:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        for sock in stalled:  # read to the end: the server answers, then closes (the socket's 5 s bound the wait)
            reply = b"".join(iter(lambda: sock.recv(4096), b""))
            assert reply.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in reply
        with httpx.Client(base_url=thread.url, timeout=10) as http:  # the two slots are free again
            assert http.post(COMPLETIONS, json=OK).status_code == 200
    finally:
        for sock in stalled:
            sock.close()
        thread.stop()


# -- metrics and CLI ------------------------------------------------------------------------------------------


def test_metrics_parse_and_count(server, client):
    before = metrics(server)
    done = client.completions.create(model=MODEL, prompt="count me", max_tokens=5, extra_body={"ignore_eos": True})
    after = metrics(server)
    assert after["pt2serve_prompt_tokens_total"] - before["pt2serve_prompt_tokens_total"] == done.usage.prompt_tokens
    assert after["pt2serve_completion_tokens_total"] - before["pt2serve_completion_tokens_total"] == 5
    ttft = "pt2serve_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert after["pt2serve_time_per_output_token_seconds_count"] >= 1
    # One step computes the prompt and the first token, then one step per token.
    assert after["pt2serve_engine_steps_total"] - before["pt2serve_engine_steps_total"] >= 5
    for gauge in ("pt2serve_requests_waiting", "pt2serve_requests_running", "pt2serve_kv_cells_used",
                  "pt2serve_kv_cells_free", "pt2serve_prefix_cache_cells", "pt2serve_prefix_cache_hit_rate",
                  "pt2serve_preemptions_total"):
        assert gauge in after
    assert after["pt2serve_kv_cells_free"] > 0
    assert after["pt2serve_kv_cells_leaked"] == 0
    assert after["process_resident_memory_bytes"] > 10e6  # the process's own, for soak and leak checks


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_serves_until_signalled_then_exits_0(tiny_artifact, sig):
    served = ServeProcess(tiny_artifact, "--model-name", "cli-model", "--api-key", API_KEY)
    try:
        assert served.load_line.startswith("loaded in ") and "KV pool" in served.load_line
        assert "graphs" in served.load_line and re.search(r"; ready [\d.]+ s after launch$", served.load_line.rstrip())
        assert f"; CPU threads: {default_threads()};" in served.load_line
        assert served.ready_line.startswith("serving cli-model at http://127.0.0.1:")
        assert served.ready_line.rstrip().endswith("(ready)")
        assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
        with openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0) as cli_client:
            done = cli_client.completions.create(model="cli-model", prompt="hi", max_tokens=3)
            assert done.usage.prompt_tokens == 3 and done.model == "cli-model"
    finally:
        code, stderr = served.stop(sig)
    assert code == 0, stderr
    assert "Traceback" not in stderr


def test_cli_logs_at_info_why_a_request_was_refused_and_the_fields_it_ignored(tiny_artifact):
    served = ServeProcess(tiny_artifact, "--log-level", "info", "--threads", "2", "--header-timeout", "5")
    try:
        assert "; CPU threads: 2;" in served.load_line
        with httpx.Client(base_url=served.url, timeout=30) as http:
            ignored = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "frobnicate": 1})
            assert ignored.status_code == 200
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}).status_code == 400
    finally:
        code, stderr = served.stop()
    assert code == 0, stderr
    assert re.search(r"INFO: +ignoring unknown request fields: frobnicate", stderr), stderr
    assert re.search(r"INFO: +POST /v1/completions answered 400 invalid_value \(param max_tokens\): ", stderr), stderr


def test_the_server_leaves_a_core_to_its_event_loop(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert default_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert default_threads() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert default_threads() == 15


def test_cli_reports_a_missing_artifact_without_traceback(tmp_path):
    missing = tmp_path / "missing.pt2"
    result = subprocess.run([sys.executable, "-m", "pt2serve.cli", "serve-artifact", str(missing)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_a_pool_smaller_than_the_context_is_the_length_the_server_advertises(tiny_artifact):
    """With --num-cells below the artifact's max context, /v1/models, /tokenize and /tokenizer_info give the
    longest request the server accepts (prompt + max_tokens), as clients size their requests by them."""
    from pt2serve.runtime.executor import ExecutorConfig

    small = open_runner(tiny_artifact, device="cpu", executor_config=ExecutorConfig(num_cells=65))
    thread = ServerThread(create_app(ServerConfig(model_name=MODEL), small)).start()
    try:
        accepted = small.max_sequence_tokens
        assert accepted < small.max_context
        with httpx.Client(base_url=thread.url, timeout=30) as http:
            assert http.get("/v1/models").json()["data"][0]["max_model_len"] == accepted
            assert http.get(f"/v1/models/{MODEL}").json()["max_model_len"] == accepted
            assert http.post("/tokenize", json={"prompt": "a"}).json()["max_model_len"] == accepted
            assert http.get("/tokenizer_info").json()["model_max_length"] == accepted
            body = {"model": MODEL, "prompt": [1] * (accepted - 4), "max_tokens": 4, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
            assert http.post("/v1/completions", json={**body, "max_tokens": 5}).status_code == 400
    finally:
        thread.stop()
        small.close()
