"""What real clients send and expect: batched prompts, no max_tokens, HEAD probes, refused and unknown fields.

Served over toy-greedy, whose greedy tokens are known (presets.toy_greedy_continuation).
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from starlette.testclient import TestClient

from pt2serve.model.presets import toy_greedy_continuation
from pt2serve.serve.app import create_app
from pt2serve.serve.config import ServerConfig
from servers import TOY_MODEL

COMPLETIONS = "/v1/completions"
BOS = 256


def complete(url: str, **body) -> dict:
    response = httpx.post(f"{url}{COMPLETIONS}", json={"model": TOY_MODEL, "temperature": 0, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_list_of_prompts_is_answered_one_choice_each_in_one_batch(toy_server, toy_runner):
    prompts = [[BOS, 10, 11], "hello", [BOS, 40]]
    first_step = toy_runner.scheduler.step
    batched = complete(toy_server, prompt=prompts, max_tokens=6, ignore_eos=True)
    steps = [r for r in toy_runner.step_history if r.step > first_step]
    assert max(r.num_decode for r in steps) == 3  # the three ran side by side, not one after another
    assert [c["index"] for c in batched["choices"]] == [0, 1, 2]
    for prompt, choice in zip(prompts, batched["choices"]):
        alone = complete(toy_server, prompt=prompt, max_tokens=6, ignore_eos=True)["choices"][0]
        assert choice["text"] == alone["text"] and choice["finish_reason"] == "length"
    ids = [BOS, *b"hello"]
    assert batched["choices"][0]["token_ids"] == toy_greedy_continuation([BOS, 10, 11], 6)
    assert batched["choices"][1]["token_ids"] == toy_greedy_continuation(ids, 6)
    assert batched["usage"]["prompt_tokens"] == 3 + len(ids) + 2
    assert batched["usage"]["completion_tokens"] == 18

    body = {"model": TOY_MODEL, "prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{toy_server}{COMPLETIONS}", json=body, timeout=60) as response:
        events = sse_events(response)
    texts, finished = {}, {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finished[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in batched["choices"]}
    assert finished == {0: "length", 1: "length", 2: "length"}
    # The same counts (the streamed run may reuse the batched run's prompt cells: cached_tokens differ).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert events[-1]["choices"] == []
    assert {k: events[-1]["usage"][k] for k in counts} == {k: batched["usage"][k] for k in counts}


def test_without_max_tokens_a_request_runs_to_the_end_of_the_context(toy_server, toy_runner):
    prompt = [BOS, 5, 6, 7]
    done = complete(toy_server, prompt=prompt, ignore_eos=True)
    room = toy_runner.max_context - len(prompt)
    assert done["usage"]["completion_tokens"] == room and done["choices"][0]["finish_reason"] == "length"
    assert done["choices"][0]["token_ids"] == toy_greedy_continuation(prompt, room)
    # The server's cap for requests that name none, and a request's own max_tokens above it.
    with TestClient(create_app(ServerConfig(model_name=TOY_MODEL, default_max_tokens=5), toy_runner)) as http:
        capped = http.post(COMPLETIONS, json={"prompt": prompt, "ignore_eos": True}).json()
        assert capped["usage"]["completion_tokens"] == 5
        own = http.post(COMPLETIONS, json={"prompt": prompt, "ignore_eos": True, "max_tokens": 9}).json()
        assert own["usage"]["completion_tokens"] == 9


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_head_answers_like_get_without_a_body(toy_server, path):
    got = httpx.get(f"{toy_server}{path}")
    head = httpx.head(f"{toy_server}{path}")
    assert head.status_code == got.status_code == 200
    assert head.content == b"" and got.content
    assert head.headers["content-type"] == got.headers["content-type"]


def test_refusals_are_logged_with_their_reason_and_unknown_fields_are_named(toy_server, caplog):
    with caplog.at_level(logging.INFO, logger="pt2serve.serve"):
        refused = httpx.post(f"{toy_server}{COMPLETIONS}", json={"prompt": "x", "min_p": 0.2})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_parameter"
        # A field with no effect on the output is accepted; one nobody knows is ignored, and said so.
        done = httpx.post(f"{toy_server}{COMPLETIONS}", json={"prompt": "x", "max_tokens": 2, "user": "me",
                                                               "my_extension": 1})
        assert done.status_code == 200, done.text
    messages = [r.getMessage() for r in caplog.records]
    assert any("400 unsupported_parameter (param min_p)" in m for m in messages), messages
    assert any("ignoring unknown request fields: my_extension" in m for m in messages), messages
    assert not any("user" in m for m in messages if "ignoring" in m)
