"""Structured output: sampled at temperature 1 from the tiny tiny_model, the output always follows the grammar."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime import executor as executor_module
from pt2serve.runtime.grammar import GrammarSpec
from pt2serve.runtime.request import FinishReason
from pt2serve.runtime.sampling import SamplingParams

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

HOT = SamplingParams(temperature=1.0)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema whose every document is short (bounded strings, numbers and arrays), so it always completes."""
    kinds = ["integer", "string", "boolean", "enum", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        return {"type": "integer", "minimum": -50, "maximum": rng.randint(0, 500)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", 'q"uote'], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, 2), "maxItems": rng.randint(0, 3)}
    names = rng.sample(["id", "name", "ok", "tags", "size", "meta", "when"], rng.randint(1, 3))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names}, "required": names,
            "additionalProperties": False}


def test_random_schemas_always_parse_and_validate(chunked_runner):
    rng = random.Random(1)
    schemas = [random_schema(rng) for _ in range(12)]
    handles = [chunked_runner.submit([256, *b"JSON:"], max_new_tokens=200,
                                     sampling=SamplingParams(temperature=1.0, seed=i),
                                     grammar=GrammarSpec("json_schema", json.dumps(schema)))
               for i, schema in enumerate(schemas)]
    plain = chunked_runner.submit([256, 1, 2], max_new_tokens=30, sampling=HOT, ignore_eos=True)  # unconstrained beside
    for schema, handle in zip(schemas, handles):
        done = handle.result(timeout=120)
        assert done.finish_reason is FinishReason.STOP, (schema, done.text)
        jsonschema.validate(json.loads(done.text), schema)
    assert len(plain.result(timeout=60).token_ids) == 30


def test_json_object_regex_and_ebnf(chunked_runner):
    for seed in range(3):
        obj = chunked_runner.generate([256, 7], max_new_tokens=200, sampling=SamplingParams(temperature=1.0, seed=seed),
                                      grammar=GrammarSpec("json"))
        if obj.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(obj.text), dict)
        else:  # a random model may write a long object; what it wrote so far is still a JSON object's start
            assert obj.text.startswith("{")
    pattern = r"(cat|dog)-[0-9]{2,4}"
    for seed in range(4):
        done = chunked_runner.generate([256, 9], max_new_tokens=20, sampling=SamplingParams(temperature=1.0, seed=seed),
                                       grammar=GrammarSpec("regex", pattern))
        assert re.fullmatch(pattern, done.text) and done.finish_reason is FinishReason.STOP
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    done = chunked_runner.generate([256, 3], max_new_tokens=20, sampling=HOT, grammar=GrammarSpec("ebnf", grammar))
    assert re.fullmatch(r"yes|no|maybe [0-9]", done.text)


def test_a_bad_grammar_is_refused_at_submit(chunked_runner):
    with pytest.raises(Pt2ServeError, match="cannot be compiled"):
        chunked_runner.submit([256, 1], grammar=GrammarSpec("regex", "(unclosed"))
    with pytest.raises(Pt2ServeError, match="cannot be compiled"):
        chunked_runner.submit([256, 1], grammar=GrammarSpec("ebnf", "root ::= undefined_rule"))


def test_without_xgrammar_or_a_tokenizer_structured_output_is_refused(monkeypatch):
    from pt2serve.model.presets import byte_tokenizer_files
    from pt2serve.runtime.grammar import GrammarCompiler

    with pytest.raises(Pt2ServeError, match="needs the model's tokenizer"):
        GrammarCompiler(None, 258, ()).compile(GrammarSpec("json"))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if it were not installed
    with pytest.raises(Pt2ServeError, match=r"pip install 'pt2serve\[structured\]'"):
        GrammarCompiler(byte_tokenizer_files().tokenizer_json, 258, (257,)).compile(GrammarSpec("json"))


def test_masks_change_what_is_sampled(chunked_runner, monkeypatch):
    """Without the masks applied the same seeds leave the grammar: the device mask is what constrains."""
    spec = GrammarSpec("regex", "[a-c]{5}")
    monkeypatch.setattr(executor_module, "apply_masks", lambda logits, mask: None)
    unmasked = [chunked_runner.generate([256, 5], max_new_tokens=5, sampling=SamplingParams(temperature=1.0, seed=s),
                                        grammar=spec) for s in range(3)]
    assert any(d.finish_reason is FinishReason.ERROR for d in unmasked)  # a token the grammar refuses


# -- through the HTTP API ------------------------------------------------------------------------------------------


def test_response_format_and_guided_fields_over_http(chunked_client):
    schema = random_schema(random.Random(7))
    messages = [{"role": "user", "content": "JSON please"}]
    for seed in range(3):
        done = chunked_client.chat.completions.create(
            model="tiny", messages=messages, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), schema)
        streamed = chunked_client.chat.completions.create(
            model="tiny", messages=messages, temperature=1.0, seed=seed, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            done.choices[0].message.content
    choices = ["alpha", "beta gamma", 'with "quotes"']
    for seed in range(4):
        picked = chunked_client.completions.create(model="tiny", prompt="pick", temperature=1.0, seed=seed,
                                                   extra_body={"guided_choice": choices})
        assert picked.choices[0].text in choices
    pattern = r"[0-9]{3}-[a-z]{2}"
    matched = chunked_client.completions.create(model="tiny", prompt="code", temperature=1.0, seed=1, n=3,
                                                extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.text) for c in matched.choices)
    obj = chunked_client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                                 response_format={"type": "json_object"},
                                         extra_body={"guided_json": None})
    assert obj.choices[0].message.content.startswith("{")
