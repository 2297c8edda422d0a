"""Nothing lost in the text: a finished request's text (its streamed pieces joined, or the whole body)
equals the tokenizer's decode of its generated ids, minus a matched stop string and what follows it.

toy-greedy makes the generated ids known in advance, and its byte-level tokenizer makes incomplete UTF-8
common: about a fifth of the designed continuations below end in the middle of a character.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import random

import openai

from pt2serve.model.presets import byte_tokenizer_files, toy_greedy_continuation
from pt2serve.runtime.events import StreamEvent
from pt2serve.runtime.request import FinishReason
from pt2serve.serve.completions import _stream
from pt2serve.serve.logprob_format import TokenTexts
from pt2serve.serve.openai_format import CompletionFormat
from pt2serve.serve.rendering import Rendering
from pt2serve.tokenizer import IncrementalDecoder, Tokenizer
from servers import TOY_MODEL

TOKENIZER = Tokenizer(byte_tokenizer_files())
BOS, EOS = 256, 257
MODEL = TOY_MODEL


def ends_mid_character(ids: list[int]) -> bool:
    """The bytes end inside a multi-byte character (a decoder would still wait for more)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(bytes(t for t in ids if t < 256), final=False)
    return bool(decoder.getstate()[0])


def random_byte_ids(rng: random.Random, count: int) -> list[int]:
    """ASCII, lead bytes of 2-4 byte characters, continuation bytes and the special ids, mixed."""
    kinds = (lambda: rng.randrange(0x20, 0x7F), lambda: rng.randrange(0xC2, 0xF5), lambda: rng.randrange(0x80, 0xC0),
             lambda: rng.choice((BOS, EOS)), lambda: rng.randrange(256))
    return [rng.choice(kinds)() for _ in range(count)]


def test_incremental_decoder_pieces_join_to_the_decode():
    rng = random.Random(0)
    mid_character = 0
    for _ in range(1000):
        ids = random_byte_ids(rng, rng.randint(1, 24))
        decoder = IncrementalDecoder(TOKENIZER)
        pieces = [decoder.push(token) for token in ids]
        pieces.append(decoder.flush())
        assert "".join(pieces) == TOKENIZER.decode(ids), ids
        assert decoder.flush() == ""  # nothing is given twice
        mid_character += ends_mid_character(ids)
    assert mid_character > 100  # the case that lost text is well covered


# -- the runner ------------------------------------------------------------------------------------------------


def designed_case(rng: random.Random, max_new: int = 40) -> tuple[list[int], list[int]]:
    """A prompt and the ids toy-greedy generates from it."""
    prompt = [BOS, *(rng.randrange(256) for _ in range(rng.randint(1, 12)))]
    return prompt, toy_greedy_continuation(prompt, rng.randint(1, max_new))


def stop_string_in(text: str, rng: random.Random) -> str | None:
    """A short piece of `text` free of U+FFFD (which can stand for an incomplete character at the end)."""
    starts = [i for i, ch in enumerate(text) if ch != "\ufffd"]
    if not starts:
        return None
    start = rng.choice(starts)
    piece = text[start:start + rng.randint(1, 3)]
    return piece.split("\ufffd")[0]


def test_runner_text_equals_the_decode_for_length_stop_token_and_stop_string(toy_runner):
    rng = random.Random(1)
    cases, mid_character = [], 0
    for i in range(90):
        prompt, expected = designed_case(rng)
        ending = ("length", "stop token", "stop string")[i % 3]
        kwargs = {}
        if ending == "stop token":
            stop_token = rng.choice(expected)
            expected = expected[: expected.index(stop_token) + 1]
            kwargs["stop_token_ids"] = (stop_token,)
        stop = stop_string_in(TOKENIZER.decode(expected), rng) if ending == "stop string" else None
        if stop:
            kwargs["stop_strings"] = (stop,)
        mid_character += ends_mid_character(expected) and not stop
        cases.append((expected, stop, toy_runner.submit(prompt, max_new_tokens=len(expected) if not kwargs else 40,
                                                        **kwargs)))
    for expected, stop, handle in cases:
        done = handle.result(timeout=120)
        if stop:
            full = TOKENIZER.decode(expected)
            assert done.finish_reason is FinishReason.STOP
            assert done.token_ids == expected[: len(done.token_ids)]
            assert done.text == full[: full.index(stop)]
        else:
            assert done.token_ids == expected
            assert done.text == TOKENIZER.decode(expected)
    assert mid_character >= 10


def test_runner_text_of_a_cancelled_request_equals_the_decode(toy_runner):
    rng = random.Random(2)
    for _ in range(8):
        prompt = [BOS, rng.randrange(256)]
        handle = toy_runner.submit(prompt, max_new_tokens=250)
        events = handle.events(timeout=30)
        for _ in range(rng.randint(1, 6)):
            next(events)
        toy_runner.cancel(handle)
        done = handle.result(timeout=30)
        assert done.finish_reason is FinishReason.CANCELLED
        assert done.token_ids == toy_greedy_continuation(prompt, len(done.token_ids))
        assert done.text == TOKENIZER.decode(done.token_ids)


def test_a_stop_string_completed_by_the_last_token_ends_with_stop(toy_runner):
    # Found by search: the 10 ids after [0] decode to '\x03\x18????{`?x' (? is U+FFFD), and 'x' first
    # appears as the last character, completed by the 10th and last allowed token.
    expected = toy_greedy_continuation([0], 10)
    text = TOKENIZER.decode(expected)
    assert text.index("x") == len(text) - 1
    done = toy_runner.generate([BOS, 0], max_new_tokens=10, stop_strings=("x",))
    assert done.token_ids == expected
    assert done.finish_reason is FinishReason.STOP
    assert done.text == text[:-1]


# -- over HTTP, streamed and not -------------------------------------------------------------------------------


async def complete(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, stream: bool,
                   **extra) -> tuple[str, str, int]:
    """Text, finish reason and completion tokens of one request."""
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra)
    if not stream:
        done = await client.completions.create(**kwargs)
        return done.choices[0].text, done.choices[0].finish_reason, done.usage.completion_tokens
    pieces, finish, usage = [], None, None
    async for chunk in await client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage.completion_tokens


def test_http_text_equals_the_decode_streamed_and_not(toy_server):
    rng = random.Random(3)
    cases = []
    for i in range(60):
        prompt, expected = designed_case(rng)
        ending = ("length", "stop token", "stop string")[i % 3]
        extra, want_text, want_finish, want_tokens = {}, TOKENIZER.decode(expected), "length", len(expected)
        if ending == "stop token":
            stop_token = rng.choice(expected)
            want_tokens = expected.index(stop_token) + 1
            want_text, want_finish = TOKENIZER.decode(expected[:want_tokens]), "stop"
            extra["extra_body"] = {"stop_token_ids": [stop_token]}
        stop = stop_string_in(want_text, rng) if ending == "stop string" else None
        if stop:
            want_text, want_finish, want_tokens = want_text[: want_text.index(stop)], "stop", None
            extra["stop"] = stop
        cases.append((prompt, len(expected), extra, want_text, want_finish, want_tokens))

    async def main() -> list[tuple]:
        async with openai.AsyncOpenAI(base_url=f"{toy_server}/v1", api_key="x", timeout=60, max_retries=0) as client:
            return await asyncio.gather(*(complete(client, prompt, max_tokens, stream, **extra)
                                          for prompt, max_tokens, extra, *_ in cases for stream in (False, True)))

    results = asyncio.run(main())
    for i, (_prompt, _max, _extra, want_text, want_finish, want_tokens) in enumerate(cases):
        for text, finish, tokens in results[2 * i: 2 * i + 2]:  # not streamed, then streamed
            assert (text, finish) == (want_text, want_finish)
            if want_tokens is not None:
                assert tokens == want_tokens


def test_a_cut_stream_still_sends_the_text_held_back():
    """A request cut mid-character (cancelled at shutdown) ends with an event that has text but no token."""

    class CutGeneration:
        error = None

        def cancel(self) -> None:  # a bad end cancels the request's other choices
            pass

        async def event_batches(self, idle_s=None):
            yield [StreamEvent(0xE2, "")]  # the first byte of a 3-byte character: held back
            yield [StreamEvent(None, "\ufffd", FinishReason.CANCELLED)]

    async def collect() -> list[str]:
        render = Rendering(CompletionFormat(MODEL), TokenTexts(TOKENIZER), [[0]], None, False, False)
        return [part.decode() async for part in _stream([CutGeneration()], render, False)]

    events = [event + "\n\n" for part in asyncio.run(collect()) for event in part.split("\n\n") if event]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-2]]
    assert "".join(texts) == TOKENIZER.decode([0xE2])
    assert json.loads(events[-2][6:])["error"]["code"] == "cancelled" and events[-1] == "data: [DONE]\n\n"
