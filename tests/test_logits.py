"""Penalties, logit_bias and min_tokens, applied on the device, against a host reference on the eager model."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pt2serve.errors import Pt2ServeError
from pt2serve.model.eager import EagerSequence
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.sampling import SamplingParams

NEW_TOKENS = 16


def reference_greedy(model, prompt: list[int], params: SamplingParams, stops: set[int], num: int) -> list[int]:
    """Greedy tokens with the controls applied on the host, as logits.py defines them."""
    sequence = EagerSequence(model, len(prompt) + num + 1)
    logits = sequence.extend(prompt)[-1]
    generated: list[int] = []
    for _ in range(num):
        x = logits.double().clone()
        counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=x.numel()).double()
        seen = (counts > 0) | torch.isin(torch.arange(x.numel()), torch.tensor(prompt))
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
        for token, value in params.logit_bias:
            x[token] += value
        if len(generated) < params.min_tokens:
            x[list(stops)] = float("-inf")
        token = int(x.argmax())
        generated.append(token)
        if token in stops:
            break
        logits = sequence.extend([token])[-1]
    return generated


CONTROLS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.8),
    "repetition-below-one": dict(repetition_penalty=0.6),
    "bias": dict(logit_bias=((65, 4.0), (66, -100.0), (10, 2.5))),
    "all": dict(presence_penalty=-0.5, frequency_penalty=1.1, repetition_penalty=1.3, logit_bias=((97, 3.0),)),
}


def test_controls_match_the_host_reference_side_by_side(chunked_runner, tiny_model):
    rng = np.random.default_rng(5)
    prompts = {name: [256, *rng.integers(0, 256, 12 + 3 * i).tolist()] for i, name in enumerate(CONTROLS)}
    handles = {name: chunked_runner.submit(prompts[name], max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                           sampling=SamplingParams(**controls)) for name, controls in CONTROLS.items()}
    plain = chunked_runner.submit(prompts["all"], max_new_tokens=NEW_TOKENS, ignore_eos=True)  # shares the steps
    for name, handle in handles.items():
        expected = reference_greedy(tiny_model, prompts[name], SamplingParams(**CONTROLS[name]), set(), NEW_TOKENS)
        assert handle.result(timeout=60).token_ids == expected, name
    assert plain.result(timeout=60).token_ids == reference_greedy(tiny_model, prompts["all"], SamplingParams(), set(),
                                                                  NEW_TOKENS)
    deadline = time.monotonic() + 10
    while chunked_runner.executor.logits_processor.num_slots_held:  # every penalized request gave its slot back
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_min_tokens_masks_stop_tokens_until_reached(chunked_runner, tiny_model):
    prompt = [256, 5, 6, 7]
    first = chunked_runner.generate(prompt, max_new_tokens=8, ignore_eos=True).token_ids
    stops = {first[0], first[1]}  # greedy would stop at once
    stopped = chunked_runner.generate(prompt, max_new_tokens=8, stop_token_ids=tuple(stops))
    assert stopped.token_ids == [first[0]] and stopped.finish_reason is FinishReason.STOP
    params = SamplingParams(min_tokens=5)
    held = chunked_runner.generate(prompt, max_new_tokens=8, stop_token_ids=tuple(stops), sampling=params)
    expected = reference_greedy(tiny_model, prompt, params, stops | set(chunked_runner.tokenizer.eos_token_ids), 8)
    assert held.token_ids == expected
    assert not stops & set(held.token_ids[:5])


def test_seeded_sampling_with_penalties_is_reproducible_and_differs(chunked_runner):
    params = SamplingParams(temperature=1.0, seed=9, frequency_penalty=2.0)
    first = chunked_runner.generate([256, 1, 2, 3], max_new_tokens=24, ignore_eos=True, sampling=params)
    again = chunked_runner.generate([256, 1, 2, 3], max_new_tokens=24, ignore_eos=True, sampling=params)
    unpenalized = chunked_runner.generate([256, 1, 2, 3], max_new_tokens=24, ignore_eos=True,
                                          sampling=SamplingParams(temperature=1.0, seed=9))
    assert first.token_ids == again.token_ids != unpenalized.token_ids


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=3.0), dict(repetition_penalty=0.0),
                                    dict(logit_bias=((1, 101.0),)), dict(min_tokens=-1)])
def test_out_of_range_controls_are_refused(kwargs):
    with pytest.raises(Pt2ServeError):
        SamplingParams(**kwargs)


# -- through the HTTP API, and the checkpoint's defaults -----------------------------------------------------------


def complete(chunked_url: str, **body) -> dict:
    import httpx

    body = {"max_tokens": 10, "ignore_eos": True, **body}
    response = httpx.post(f"{chunked_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_http_controls_equal_the_runners(chunked_url, chunked_runner):
    prompt = [256, 70, 71, 72]
    body = dict(prompt=prompt, temperature=0.8, seed=4, presence_penalty=0.5, frequency_penalty=1.0,
                repetition_penalty=1.2, logit_bias={"65": 5.0, "10": -3}, min_tokens=3)
    params = SamplingParams(temperature=0.8, seed=4, presence_penalty=0.5, frequency_penalty=1.0,
                            repetition_penalty=1.2, logit_bias=((65, 5.0), (10, -3.0)), min_tokens=3)
    alone = chunked_runner.generate(prompt, max_new_tokens=10, ignore_eos=True, sampling=params)
    assert complete(chunked_url, **body)["token_ids"] == alone.token_ids
    assert set(complete(chunked_url, prompt=prompt, temperature=0, logit_bias={"66": 100})["token_ids"]) == {66}


def test_the_checkpoints_generation_defaults_fill_what_a_request_leaves_out(chunked_url, chunked_runner, monkeypatch):
    greedy = complete(chunked_url, prompt=[256, 1, 2], temperature=0)["token_ids"]
    monkeypatch.setattr(chunked_runner, "generation_defaults", {"temperature": 0.0, "top_k": 5})
    assert complete(chunked_url, prompt=[256, 1, 2])["token_ids"] == greedy  # no temperature: the model's 0
    monkeypatch.setattr(chunked_runner, "generation_defaults", {"repetition_penalty": 3.0})
    penalized = chunked_runner.generate([256, 1, 2], max_new_tokens=10, ignore_eos=True,
                                        sampling=SamplingParams(repetition_penalty=3.0)).token_ids
    assert complete(chunked_url, prompt=[256, 1, 2], temperature=0)["token_ids"] == penalized != greedy


def test_generation_config_is_read_and_checked(tmp_path):
    import json

    from pt2serve.model.checkpoint import read_generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": [1, 2],
         "repetition_penalty": 1.05, "max_length": 4096}))
    assert read_generation_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                  "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(Pt2ServeError, match="temperature must be a number"):
        read_generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert read_generation_defaults(tmp_path) == {}
