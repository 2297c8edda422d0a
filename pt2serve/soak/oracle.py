"""What a soak request must return.

Any model: a finish reason of length or stop; length means exactly max_tokens; a stream has one chunk
per token and ends with [DONE]; no stop string in the text.

A designed preset (greedy output known in advance, see pt2serve.model.presets: toy-greedy, toy-recall and
their -8b twins): a greedy request returns exactly its designed ids, cut after the first stop token id or
once the text holds a stop string, and its text is their decode up to that stop string. The stop strings
the soak asks for there have no U+FFFD, which can stand for an unfinished character that later tokens
complete. On toy-recall each designed id is read from the K/V of a token 6 positions back, so an answer is
wrong when a K/V cell it reads is (written to the wrong cell, reused from the wrong prefix or lost in a
preemption), where toy-greedy's answers only see the newest token. The -8b twins have no tokenizer: their
prompts are token ids, their text is empty and no stop string can match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pt2serve.errors import Pt2ServeError


@dataclass(frozen=True)
class Ask:
    """One generating request as the soak sends it."""

    prompt: str | list[int] | list[dict[str, str]]  # text, token ids, or chat messages
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @property
    def is_chat(self) -> bool:
        return bool(self.prompt) and isinstance(self.prompt[0], dict)

    def body(self, model: str) -> dict[str, Any]:
        """The JSON body for raw HTTP (the openai client builds the same from these fields)."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        body["messages" if self.is_chat else "prompt"] = self.prompt
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        return body


@dataclass
class Got:
    """What came back for one request."""

    text: str
    finish: str | None
    completion_tokens: int | None
    token_ids: list[int] | None = None  # non-streamed completions of token-id prompts
    token_chunks: int | None = None  # streams: chunks that carried a token


@dataclass
class SampledLog:
    """The seeded sampled answers the oracle accepted (asked again alone after the load: replay.py), and how
    many departed from the greedy design (designed presets)."""

    answers: list[tuple[Ask, Got]] = field(default_factory=list)
    departing: int = 0

    def add(self, ask: Ask, got: Got, departs: bool) -> None:
        # Streams of a model without a tokenizer carry neither text nor ids: nothing to compare them by.
        if got.token_ids is not None or got.text:
            self.answers.append((ask, got))
            self.departing += departs


@dataclass(frozen=True)
class Expected:
    ids: list[int]
    text: str
    finish: str


class Oracle:
    def __init__(self, designed: str | None, has_tokenizer: bool = True) -> None:
        """`designed`: the designed preset the server serves, or None for any other model."""
        self._designed = None
        self.tokenizer = None  # the server's byte tokenizer, on a designed preset; None: the server has none
        if designed is not None:  # imported only here: the model code pulls in torch
            from pt2serve.model.presets import DESIGNED_CONTINUATIONS, byte_tokenizer_files
            from pt2serve.tokenizer import Tokenizer

            if designed not in DESIGNED_CONTINUATIONS:
                raise Pt2ServeError(f"--designed {designed!r} is not a designed preset; designed presets: "
                                    f"{', '.join(DESIGNED_CONTINUATIONS)}")
            self.tokenizer = Tokenizer(byte_tokenizer_files()) if has_tokenizer else None
            self._designed = DESIGNED_CONTINUATIONS[designed]

    @property
    def knows_tokens(self) -> bool:
        return self._designed is not None

    def expect(self, ask: Ask) -> Expected | None:
        """The exact answer to a greedy request on a designed preset; None where only the general rules apply."""
        if self._designed is None or ask.temperature != 0:
            return None
        prompt = ask.prompt
        if ask.is_chat:
            prompt_ids = self.tokenizer.encode_chat(prompt)
        elif isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = prompt
        ids = self._designed(prompt_ids, ask.max_tokens)
        finish = "length"
        for i, token in enumerate(ids):
            if token in ask.stop_token_ids:
                ids, finish = ids[: i + 1], "stop"
                break
        if self.tokenizer is None:
            return Expected(ids, "", finish)
        for count in range(1, len(ids) + 1) if ask.stop else ():
            text = self.tokenizer.decode(ids[:count])
            cuts = [text.find(stop) for stop in ask.stop if stop in text]
            if cuts:
                return Expected(ids[:count], text[: min(cuts)], "stop")
        return Expected(ids, self.tokenizer.decode(ids), finish)

    def departs_from_design(self, ask: Ask, got: Got) -> bool:
        """Whether a sampled answer differs from what the same request asks greedily (designed presets; False
        elsewhere)."""
        greedy = self.expect(Ask(ask.prompt, ask.max_tokens, stop=ask.stop, stop_token_ids=ask.stop_token_ids))
        if greedy is None:
            return False
        if got.token_ids is not None:
            return got.token_ids != greedy.ids
        return got.text != greedy.text

    def problem(self, ask: Ask, got: Got) -> str | None:
        """What is wrong with `got`, or None."""
        if got.finish not in ("length", "stop"):
            return f"finish_reason {got.finish!r}"
        tokens = got.completion_tokens
        if tokens is None or not 1 <= tokens <= ask.max_tokens:
            return f"completion_tokens {tokens} for max_tokens {ask.max_tokens}"
        if got.finish == "length" and tokens != ask.max_tokens:
            return f"finish_reason length after {tokens} of {ask.max_tokens} tokens"
        if got.token_chunks is not None and got.token_chunks != tokens:
            return f"{got.token_chunks} token chunks streamed for {tokens} completion tokens"
        if any(stop in got.text for stop in ask.stop):
            return "a stop string is in the text"
        expected = self.expect(ask)
        if expected is None:
            return None
        if got.token_ids is not None and got.token_ids != expected.ids:
            return f"token ids {got.token_ids[:8]}... differ from the designed {expected.ids[:8]}..."
        if (got.text, got.finish, tokens) != (expected.text, expected.finish, len(expected.ids)):
            return (f"got {got.text!r} ({got.finish}, {tokens} tokens), designed {expected.text!r} "
                    f"({expected.finish}, {len(expected.ids)} tokens)")
        return None
