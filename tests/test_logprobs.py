"""Log probabilities computed on the device equal log_softmax of the model's own logits at the same positions."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
import torch

from pt2serve.model.eager import EagerSequence
from pt2serve.model.presets import byte_tokenizer_files
from pt2serve.runtime import executor as executor_module
from pt2serve.runtime.executor import Executor, ExecutorConfig
from pt2serve.runtime.artifact import load_artifact
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.runtime.step import Chunk
from pt2serve.tokenizer import Tokenizer

TOP = 5
TOKENIZER = Tokenizer(byte_tokenizer_files())
TOLERANCE = 1e-4


def reference(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the eager model's logits after each token, [len(tokens), vocab]."""
    return EagerSequence(model, len(tokens) + 1).extend(tokens).log_softmax(dim=-1)


def assert_scored(logprob, expected_row: torch.Tensor, token: int, top: int) -> None:
    assert logprob.token == token
    assert abs(logprob.logprob - expected_row[token].item()) < TOLERANCE
    values, ids = expected_row.topk(top)
    assert [t for t, _ in logprob.top] == ids.tolist()
    assert np.allclose([v for _, v in logprob.top], values.numpy(), atol=TOLERANCE)


def test_sampled_and_prompt_logprobs_equal_the_models(chunked_runner, tiny_model):
    rng = np.random.default_rng(0)
    prompts = [[256, *rng.integers(0, 256, n).tolist()] for n in (37, 9, 21)]
    handles = [
        chunked_runner.submit(prompts[0], max_new_tokens=12, sampling=SamplingParams(temperature=1.0, seed=1),
                              logprobs=TOP, prompt_logprobs=TOP, ignore_eos=True),
        chunked_runner.submit(prompts[1], max_new_tokens=12, ignore_eos=True),  # asks for nothing, shares the steps
        chunked_runner.submit(prompts[2], max_new_tokens=12, sampling=SamplingParams(temperature=0.7, seed=2),
                              logprobs=0, ignore_eos=True),
    ]
    results = [h.result(timeout=120) for h in handles]
    first, plain, third = results
    assert plain.logprobs is None and plain.prompt_logprobs is None and third.prompt_logprobs is None

    expected = reference(tiny_model, prompts[0] + first.token_ids)
    assert len(first.prompt_logprobs) == len(prompts[0]) - 1
    for position, scored in enumerate(first.prompt_logprobs):  # prompt token position + 1, given what precedes
        assert_scored(scored, expected[position], prompts[0][position + 1], TOP)
    assert len(first.logprobs) == len(first.token_ids) == 12
    for k, scored in enumerate(first.logprobs):
        assert_scored(scored, expected[len(prompts[0]) - 1 + k], first.token_ids[k], TOP)

    expected = reference(tiny_model, prompts[2] + third.token_ids)
    for k, scored in enumerate(third.logprobs):
        assert scored.top == ()
        assert abs(scored.logprob - expected[len(prompts[2]) - 1 + k, third.token_ids[k]].item()) < TOLERANCE


def test_a_prompt_longer_than_a_step_is_scored_across_pieces(tiny_artifact, tiny_model):
    """A chunk wider than the artifact's max step tokens runs as several calls; each scores its own rows."""
    executor = Executor(load_artifact(tiny_artifact, device="cpu"), ExecutorConfig(num_cells=512))
    prompt = np.random.default_rng(1).integers(0, 256, 200).tolist()
    cells = executor.allocator.allocate(len(prompt))
    chunk = Chunk(cells, tuple(prompt), 0, SamplingParams(), logprobs=2, prompt_targets=tuple(prompt[1:]),
                  prompt_logprobs=3)
    assert len(executor.method_calls([chunk])) == 2
    result = executor.step([chunk])
    expected = reference(tiny_model, prompt)
    assert len(result.prompt_logprobs[0]) == len(prompt) - 1
    for position, scored in enumerate(result.prompt_logprobs[0]):
        assert_scored(scored, expected[position], prompt[position + 1], 3)
    assert_scored(result.logprobs[0], expected[-1], result.tokens[0], 2)


def test_a_request_that_asks_for_nothing_runs_no_scoring(chunked_runner, monkeypatch):
    def refuse(*args):
        raise AssertionError("scored a step nobody asked to score")

    monkeypatch.setattr(executor_module, "score", refuse)
    done = chunked_runner.generate([256, 1, 2, 3], max_new_tokens=4, sampling=SamplingParams(temperature=0.5, seed=3))
    assert done.error is None and len(done.token_ids) >= 1 and done.logprobs is None


# -- through the HTTP API ----------------------------------------------------------------------------------------


def test_completions_echo_scores_the_prompt_and_the_completion(chunked_client, tiny_model):
    prompt = "The cat sat"
    done = chunked_client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                             echo=True, extra_body={"ignore_eos": True})
    choice = done.choices[0]
    ids = [256, *prompt.encode()]
    generated = len(choice.logprobs.tokens) - len(ids)
    assert generated == 4 and choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.tokens[1:len(ids)] == list(prompt)  # byte tokens: each its own character
    generated_ids = [ord(t) if len(t) == 1 else None for t in lp.tokens[len(ids):]]
    expected = reference(tiny_model, ids)
    for position in range(1, len(ids)):
        assert abs(lp.token_logprobs[position] - expected[position - 1, ids[position]].item()) < TOLERANCE
        assert len(lp.top_logprobs[position]) <= 4  # three alternatives, and the token itself
    greedy = expected[-1].argmax().item()
    if generated_ids[0] is not None:
        assert generated_ids[0] == greedy
    assert abs(lp.token_logprobs[len(ids)] - expected[-1, greedy].item()) < TOLERANCE
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + 1]


def test_streamed_logprobs_equal_non_streamed(chunked_client):
    kwargs = dict(model="tiny", prompt="Once", max_tokens=6, temperature=0.9, seed=11, logprobs=2,
                  extra_body={"ignore_eos": True})
    full = chunked_client.completions.create(**kwargs).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in chunked_client.completions.create(**kwargs, stream=True)
                if c.choices and c.choices[0].logprobs is not None]
    # Equal up to float rounding: the second run may compute from the first one's cached cells, in other steps.
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(full.token_logprobs, abs=1e-5)
    assert [t for lp in streamed for t in lp.top_logprobs] == [
        {token: pytest.approx(value, abs=1e-5) for token, value in top.items()} for top in full.top_logprobs]
    echoed = chunked_client.completions.create(**kwargs, echo=True)
    chunks = list(chunked_client.completions.create(**kwargs, echo=True, stream=True))
    assert chunks[0].choices[0].text == "Once"  # the prompt first, scored
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    assert [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] \
        == echoed.choices[0].logprobs.token_logprobs

    messages = [{"role": "user", "content": "Hi"}]
    chat_kwargs = dict(model="tiny", messages=messages, max_tokens=5, temperature=0.9, seed=5, logprobs=True,
                       top_logprobs=2, extra_body={"ignore_eos": True})
    chat = chunked_client.chat.completions.create(**chat_kwargs).choices[0].logprobs.content
    assert len(chat) == 5 and all(len(entry.top_logprobs) == 2 for entry in chat)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - TOLERANCE for entry in chat)
    chat_streamed = [e for c in chunked_client.chat.completions.create(**chat_kwargs, stream=True)
                     if c.choices and c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in chat_streamed] == [(e.token, e.logprob) for e in chat]


def test_completion_alternatives_never_share_a_name_and_include_the_chosen_token(chunked_client, chunked_url):
    """Each of the tiny model's bytes from 0x80 up decodes alone to U+FFFD: named by their bytes, each keeps
    its own value (keyed by text, the chosen token at -0.187 once showed another's -3.57)."""
    done = chunked_client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0,
                                             logprobs=20, extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    named_by_bytes = 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 20  # greedy: the chosen token is the best alternative, not a 21st entry
        assert top[token] == value and max(top, key=top.get) == token  # what lm-eval's is_greedy reads
        named_by_bytes += sum(name.startswith("bytes:\\x") for name in top)
    assert named_by_bytes > 0
    byte = re.compile(r"bytes:\\x([89a-f][0-9a-f])")
    assert all(byte.fullmatch(name) for top in lp.top_logprobs for name in top if "\ufffd" in name or
               name.startswith("bytes:"))

    with httpx.Client(base_url=chunked_url, timeout=60) as http:
        body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 8, "temperature": 0, "logprobs": 3,
                "ignore_eos": True, "echo": True, "return_tokens_as_token_ids": True}
        as_ids = http.post("/v1/completions", json=body).json()["choices"][0]
        ids = [256, *b"Once upon"]
        generated = http.post("/v1/completions", json={**body, "prompt": ids, "echo": False}).json()
        ids += generated["choices"][0]["token_ids"]
        assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
        assert all(re.fullmatch(r"token_id:\d+", name) for top in as_ids["logprobs"]["top_logprobs"][1:]
                   for name in top)
        chat = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "return_tokens_as_token_ids": True}).json()
    for entry in chat["choices"][0]["logprobs"]["content"]:
        token = int(entry["token"].removeprefix("token_id:"))
        assert entry["bytes"] == ([token] if token < 256 else list(TOKENIZER.token_text(token).encode()))
        assert all(alt["token"].startswith("token_id:") for alt in entry["top_logprobs"])
