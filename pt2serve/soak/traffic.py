"""The soak's traffic: a seeded mix of scenarios, each ending in one or more Outcomes.

    complete, complete_stream   completions through the openai client, text or token-id prompts
    chat, chat_stream           chat completions through the openai client (servers with a tokenizer)
    stop                        stop strings and stop token ids (on a designed preset cut inside the designed text)
    session                     2-3 turns extending one X-Session-ID's history (raw HTTP, token ids)
    prefix                      a long prompt prefix shared by every such request (prefix-cache hits)
    long                        long prompts and outputs: with a small pool, requests get preempted
    burst                       max_queued + concurrency requests at once: some must get 429
    cancel                      a stream the client closes after a few tokens
    disconnect                  a whole completion the client stops waiting for
    stall                       a stream the client stops reading for a while, then reads to its end
    bad                         a malformed or out-of-limits request: the right 4xx, in OpenAI's shape

Greedy requests (70%) are checked exactly on a designed preset; the rest sample with a seed, and some of
those are asked again alone once the traffic is over (replay.py).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import httpx

from pt2serve.soak.calls import (
    Outcome, StreamRead, Target, post, read_events, stream_problem, stream_raw, via_openai,
)
from pt2serve.soak.oracle import Ask

WORDS = ("the", "a", "model", "serves", "tokens", "quickly", "under", "load", "while", "cells", "move", "and",
         "graphs", "replay", "every", "step", "of", "soak", "traffic", "requests")
MAX_BODY_BYTES = 4 * 1024 * 1024  # the server's default limit (ServerConfig.max_body_bytes)


@dataclass
class Shape:
    """What the server is: learnt before the traffic starts."""

    max_context: int
    has_tokenizer: bool  # text prompts and chat work
    shared_prefix: list[int]  # the prefix every `prefix` request starts with


class Traffic:
    def __init__(self, target: Target, shape: Shape, burst_size: int, session_prefix: str,
                 scenario_timeout_s: float) -> None:
        self.target = target
        self.shape = shape
        self.burst_size = burst_size
        # A stream the server keeps alive (keep-alive comments) never trips the client's read timeout: a
        # request the server holds forever must still end its scenario, as a problem.
        self.scenario_timeout_s = scenario_timeout_s
        self._session_prefix = session_prefix  # session ids: PREFIX-1, PREFIX-2, ...
        self._num_sessions = 0
        self._bad: list[tuple[str, dict | bytes, int, str | None]] | None = None
        self._scenarios = {  # name: (weight, scenario)
            "complete": (14, self.complete), "complete_stream": (14, self.complete_stream),
            "chat": (6, self.chat), "chat_stream": (6, self.chat_stream), "stop": (7, self.stop),
            "session": (7, self.session), "prefix": (8, self.prefix), "long": (3, self.long),
            "burst": (2, self.burst), "cancel": (8, self.cancel), "disconnect": (3, self.disconnect),
            "stall": (4, self.stall), "bad": (8, self.bad),
        }
        if not shape.has_tokenizer:  # a model without a tokenizer takes token ids only
            del self._scenarios["chat"], self._scenarios["chat_stream"]

    async def run_one(self, rng: random.Random) -> list[Outcome]:
        names = list(self._scenarios)
        name = rng.choices(names, weights=[self._scenarios[n][0] for n in names])[0]
        try:
            outcome = await asyncio.wait_for(self._scenarios[name][1](rng, name), self.scenario_timeout_s)
        except asyncio.TimeoutError:  # (leaving closes its connections: the server may cancel the requests)
            return [Outcome(name, None, f"not answered within {self.scenario_timeout_s:.0f} s")]
        return outcome if isinstance(outcome, list) else [outcome]

    # -- what to ask -------------------------------------------------------------------------------------------

    def _ids(self, rng: random.Random, low: int, high: int) -> list[int]:
        return [rng.randrange(256) for _ in range(rng.randint(low, high))]  # every model has 256 ids

    def _ask(self, rng: random.Random, prompt, max_new: int = 24) -> Ask:
        if isinstance(prompt, str):
            length = len(prompt.encode()) + 1  # no tokenizer makes more tokens than bytes (+ bos)
        elif prompt and isinstance(prompt[0], dict):  # chat: the contents and a template's words around them
            length = sum(len(m["content"].encode()) + 32 for m in prompt)
        else:
            length = len(prompt)
        max_tokens = rng.randint(1, max(1, min(max_new, self.shape.max_context - length - 1)))
        if rng.random() < 0.7:
            return Ask(prompt, max_tokens)
        # A designed preset's next token has logit 16 against at most 8: at 0.8 it is drawn 998 times in 1,000,
        # at 1.5 about 7 in 8, so there the sampled answers depart from the greedy ones (replay.py checks that).
        temperature = 1.5 if self.target.oracle.knows_tokens else 0.8
        return Ask(prompt, max_tokens, temperature=temperature, seed=rng.randrange(2**31))

    def _prompt(self, rng: random.Random):
        if self.shape.has_tokenizer and rng.random() < 0.5:
            return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        return self._ids(rng, 1, 48)

    def _messages(self, rng: random.Random) -> list[dict[str, str]]:
        turns = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.5 else []
        return turns + [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10)))}]

    # -- scenarios -----------------------------------------------------------------------------------------

    async def complete(self, rng: random.Random, kind: str) -> Outcome:
        return await via_openai(self.target, kind, self._ask(rng, self._prompt(rng)), stream=False)

    async def complete_stream(self, rng: random.Random, kind: str) -> Outcome:
        return await via_openai(self.target, kind, self._ask(rng, self._prompt(rng)), stream=True)

    async def chat(self, rng: random.Random, kind: str) -> Outcome:
        return await via_openai(self.target, kind, self._ask(rng, self._messages(rng)), stream=False)

    async def chat_stream(self, rng: random.Random, kind: str) -> Outcome:
        return await via_openai(self.target, kind, self._ask(rng, self._messages(rng)), stream=True)

    async def stop(self, rng: random.Random, kind: str) -> Outcome:
        ask = self._ask(rng, self._prompt(rng), max_new=48)
        ask = Ask(ask.prompt, ask.max_tokens)  # greedy: on a designed preset the stops fall where designed
        designed = self.target.oracle.expect(ask)
        if designed is not None and designed.ids:
            if rng.random() < 0.5:
                ask = Ask(ask.prompt, ask.max_tokens, stop_token_ids=(rng.choice(designed.ids),))
            else:
                printable = [ch for ch in designed.text if ch.isascii() and ch.isprintable()]
                if printable:
                    ask = Ask(ask.prompt, ask.max_tokens, stop=(rng.choice(printable),))
        else:
            ask = Ask(ask.prompt, ask.max_tokens, stop=tuple(rng.sample((" ", "\n", "e", "the", "."), 2)),
                      stop_token_ids=(rng.randrange(256),))
        return await via_openai(self.target, kind, ask, stream=rng.random() < 0.5)

    async def session(self, rng: random.Random, kind: str) -> list[Outcome]:
        self._num_sessions += 1
        headers = {"X-Session-ID": f"{self._session_prefix}-{self._num_sessions}"}
        history, outcomes = self._ids(rng, 4, 32), []
        for _turn in range(rng.randint(2, 3)):
            room = self.shape.max_context - len(history) - 1
            if room < 2:
                break
            ask = Ask(history, rng.randint(1, min(16, room)))  # greedy: each turn checked on a designed preset
            outcome, got = await post(self.target, kind, ask, headers)
            outcomes.append(outcome)
            if got is None or got.token_ids is None:
                break
            history = history + got.token_ids + self._ids(rng, 1, 8)
        return outcomes

    async def prefix(self, rng: random.Random, kind: str) -> Outcome:
        prompt = self.shape.shared_prefix + self._ids(rng, 1, 16)
        outcome, _ = await post(self.target, kind, self._ask(rng, prompt, max_new=16))
        return outcome

    async def long(self, rng: random.Random, kind: str) -> Outcome:
        context = self.shape.max_context
        prompt = self._ids(rng, context // 4, min(context // 2, 2048))
        max_tokens = rng.randint(context // 8, min(context // 4, 512))  # prompt + this < context
        return await via_openai(self.target, kind, Ask(prompt, max_tokens), stream=True)

    async def burst(self, rng: random.Random, kind: str) -> list[Outcome]:
        asks = [Ask(self._ids(rng, 1, 16), rng.randint(1, 8)) for _ in range(self.burst_size)]
        return [outcome for outcome, _ in await asyncio.gather(*(post(self.target, kind, ask) for ask in asks))]

    async def cancel(self, rng: random.Random, kind: str) -> Outcome:
        ask = Ask(self._ids(rng, 1, 32), min(200, self.shape.max_context - 40))
        read = StreamRead([])
        failed = await stream_raw(self.target, kind, ask,
                                  lambda lines: read_events(lines, read, chat=False, max_tokens=rng.randint(1, 4)))
        # Returning closed the connection mid-stream: the server must cancel and free the request.
        return failed or Outcome(kind, 200, None if read.token_chunks or read.done else "no token before leaving",
                                 left_early=True)

    async def disconnect(self, rng: random.Random, kind: str) -> Outcome:
        ask = Ask(self._ids(rng, 1, 32), min(200, self.shape.max_context - 40))
        outcome, _ = await post(self.target, kind, ask, read_timeout_s=rng.uniform(0.02, 0.3))
        return outcome

    async def stall(self, rng: random.Random, kind: str) -> Outcome:
        ask = Ask(self._ids(rng, 1, 32), rng.randint(16, min(64, self.shape.max_context - 40)))
        read = StreamRead([])

        async def stop_reading_a_while(lines) -> None:
            await read_events(lines, read, chat=False, max_tokens=1)
            await asyncio.sleep(rng.uniform(0.5, 2.0))  # not reading: the server's writes back up
            await read_events(lines, read, chat=False)

        failed = await stream_raw(self.target, kind, ask, stop_reading_a_while)
        return failed or Outcome(kind, 200, stream_problem(self.target, ask, read))

    async def bad(self, rng: random.Random, kind: str) -> Outcome:
        self._bad = self._bad or self._bad_requests()
        path, body, status, param = rng.choice(self._bad)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            reply = await self.target.http.post(f"{self.target.root}{path}", content=content,
                                                headers={"Content-Type": "application/json"})
        except httpx.HTTPError as err:
            return Outcome(kind, None, f"{type(err).__name__}: {err}"[:300])
        problem = None
        try:
            error = reply.json()["error"]
            # A full server refuses before it reads the prompt (admission comes before tokenizing): a 429 for
            # "queue_full" is a right answer to a bad request too.
            is_shed = reply.status_code == 429 and error.get("code") == "queue_full"
            if not is_shed and (reply.status_code != status or error.get("param") != param
                                or not error.get("message")):
                problem = f"expected {status} on {param!r}, got {reply.status_code}: {reply.text[:200]}"
        except (ValueError, KeyError, TypeError):
            problem = f"expected {status} in OpenAI's error shape, got {reply.status_code}: {reply.text[:200]}"
        return Outcome(kind, reply.status_code, problem)

    def _bad_requests(self) -> list[tuple[str, dict | bytes, int, str | None]]:
        """(path, body, status, param): each refused with a clear 4xx before it reaches the runner."""
        model, context = self.target.model, self.shape.max_context
        ok = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4}
        return [
            ("/v1/completions", b"{not json", 400, None),
            ("/v1/completions", b"[1, 2]", 400, None),
            ("/v1/completions", {**ok, "max_tokens": 0}, 400, "max_tokens"),
            ("/v1/completions", {**ok, "max_tokens": context}, 400, "max_tokens"),
            ("/v1/completions", {**ok, "temperature": -1}, 400, "temperature"),
            ("/v1/completions", {**ok, "n": 129}, 400, "n"),
            ("/v1/completions", {**ok, "stop": [str(i) for i in range(17)]}, 400, "stop"),
            ("/v1/completions", {**ok, "stop_token_ids": list(range(17))}, 400, "stop_token_ids"),
            ("/v1/completions", {**ok, "model": "no-such-model"}, 404, "model"),
            ("/v1/completions", {**ok, "prompt": []}, 400, "prompt"),
            ("/v1/completions", {**ok, "prompt": [10**9]}, 400, "prompt"),
            ("/v1/completions", {**ok, "prompt": [1] * (context + 1)}, 400, "prompt"),
            ("/v1/completions", json.dumps({**ok, "prompt": "x" * MAX_BODY_BYTES}).encode(), 413, None),
            ("/v1/chat/completions", {"model": model, "messages": []}, 400, "messages"),
            ("/v1/chat/completions", {"model": model, "messages": [{"role": "wizard", "content": "x"}]}, 400,
             "messages.0.role"),
        ]

