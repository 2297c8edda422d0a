"""n > 1: the choices of one prompt share its cells (cloned after its prefill) and each draws from its own seed."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.sampling import SamplingParams


def wait_idle(chunked_runner) -> None:
    deadline = time.monotonic() + 10
    while chunked_runner.num_active or chunked_runner.stats.num_running or chunked_runner.stats.num_waiting:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_children_share_the_prompt_and_equal_their_seed_alone(chunked_runner):
    prompt = [256, *np.random.default_rng(3).integers(0, 256, 40).tolist()]
    kwargs = dict(max_new_tokens=10, ignore_eos=True, logprobs=1)
    parent = chunked_runner.submit(prompt, sampling=SamplingParams(temperature=1.0, seed=100), **kwargs)
    children = [chunked_runner.submit(prompt, sampling=SamplingParams(temperature=1.0, seed=100 + j), parent=parent,
                                      **kwargs) for j in (1, 2, 3)]
    together = [h.result(timeout=60) for h in [parent, *children]]
    for child in children:
        assert child.stats.reused_tokens == len(prompt) - 1  # only the last prompt token computed again
        assert child.stats.prefilled_tokens == 1
    assert parent.stats.prefilled_tokens == len(prompt)
    for j, done in enumerate(together):
        alone = chunked_runner.generate(prompt, sampling=SamplingParams(temperature=1.0, seed=100 + j), **kwargs)
        assert done.token_ids == alone.token_ids
        assert np.allclose([lp.logprob for lp in done.logprobs], [lp.logprob for lp in alone.logprobs], atol=1e-5)
    assert len({tuple(d.token_ids) for d in together}) > 1  # different seeds, different draws
    wait_idle(chunked_runner)
    assert chunked_runner.stats.cells_leaked == 0


def test_a_child_cancelled_while_held_ends_and_leaks_nothing(chunked_runner):
    prompt = [256, *range(100)]  # a prefill of several steps at a budget of 16
    parent = chunked_runner.submit(prompt, max_new_tokens=4, ignore_eos=True)
    child = chunked_runner.submit(prompt, max_new_tokens=4, ignore_eos=True, parent=parent)
    chunked_runner.cancel(child)
    assert child.result(timeout=30).finish_reason is FinishReason.CANCELLED
    assert parent.result(timeout=30).finish_reason is FinishReason.LENGTH
    wait_idle(chunked_runner)
    assert chunked_runner.stats.cells_leaked == 0
    assert chunked_runner.stats.cells_used == chunked_runner.stats.prefix_cache_cells


def test_a_child_must_have_its_parents_prompt(chunked_runner):
    parent = chunked_runner.submit([256, 1, 2], max_new_tokens=1)
    with pytest.raises(Pt2ServeError, match="parent's prompt"):
        chunked_runner.submit([256, 1, 3], max_new_tokens=1, parent=parent)
    with pytest.raises(Pt2ServeError, match="ask the parent for prompt_logprobs"):
        chunked_runner.submit([256, 1, 2], max_new_tokens=1, parent=parent, prompt_logprobs=0)
    parent.result(timeout=30)


def test_n_choices_over_http_equal_their_seeds_alone(chunked_client):
    client = chunked_client
    kwargs = dict(model="tiny", max_tokens=8, temperature=0.9, logprobs=2, extra_body={"ignore_eos": True})
    together = client.completions.create(prompt=["Hello there", "Bye"], n=3, seed=7, echo=True, **kwargs)
    assert [c.index for c in together.choices] == list(range(6))
    for c in together.choices:
        prompt = ["Hello there", "Bye"][c.index // 3]
        alone = client.completions.create(prompt=prompt, seed=7 + c.index % 3, echo=True, **kwargs).choices[0]
        assert c.text == alone.text
        assert c.logprobs.token_logprobs[1:] == pytest.approx(alone.logprobs.token_logprobs[1:], abs=1e-5)
    # The prompt is counted once per prompt, completions for every choice.
    assert together.usage.prompt_tokens == len("Hello there") + 1 + len("Bye") + 1
    assert together.usage.completion_tokens == 6 * 8

    chat = dict(kwargs, messages=[{"role": "user", "content": "Hi"}], n=2, seed=1, logprobs=None)
    texts = {}
    for chunk in client.chat.completions.create(**chat, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    full = client.chat.completions.create(**chat)
    assert texts == {c.index: c.message.content for c in full.choices}


def test_a_child_whose_parent_fails_computes_its_prompt_itself(chunked_runner, monkeypatch):
    prompt = [256, *range(30, 40)]  # one prefill chunk
    params = SamplingParams(temperature=1.0, seed=21)
    alone = chunked_runner.generate(prompt, max_new_tokens=6, ignore_eos=True, sampling=params)
    chunked_runner.clear_prefix_cache()  # so what the child could reuse would come from its parent alone
    launch = chunked_runner.executor.launch
    calls = []

    def fail_first(chunks, *args):
        calls.append(len(chunks))
        if len(calls) == 1:
            raise RuntimeError("the parent's prompt step failed")
        return launch(chunks, *args)

    monkeypatch.setattr(chunked_runner.executor, "launch", fail_first)
    parent = chunked_runner.submit(prompt, max_new_tokens=6, ignore_eos=True, sampling=params)
    child = chunked_runner.submit(prompt, max_new_tokens=6, ignore_eos=True, sampling=params, parent=parent)
    assert parent.result(timeout=30).finish_reason is FinishReason.ERROR
    done = child.result(timeout=30)
    assert done.finish_reason is FinishReason.LENGTH and done.token_ids == alone.token_ids
    assert done.stats.reused_tokens == 0  # nothing shared from a prompt that was never computed
