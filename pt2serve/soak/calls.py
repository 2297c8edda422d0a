"""One soak request, sent through the official openai client or as raw HTTP, turned into an Outcome.

A 429 is a valid answer to a valid request (the server sheds load); any other error status, a stream
that ends with an error event or without [DONE], and an answer the oracle refuses is a problem.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import openai

from pt2serve.soak.oracle import Ask, Got, Oracle, SampledLog


@dataclass
class Outcome:
    kind: str
    status: int | None  # the HTTP status; None: the client left (or failed) before one came
    problem: str | None = None
    latency_s: float | None = None  # submit to the end of the answer, for complete answers
    ttft_s: float | None = None  # streams: submit to the first token
    cached_tokens: int = 0
    left_early: bool = False  # the client disconnected on purpose


@dataclass
class Target:
    """Where and how requests go."""

    root: str
    model: str
    http: httpx.AsyncClient
    client: openai.AsyncOpenAI
    oracle: Oracle
    sampled: SampledLog | None = None  # where the seeded sampled answers the oracle accepts are kept (replay.py)

    def check(self, ask: Ask, got: Got) -> str | None:
        """What is wrong with `got` (the oracle's verdict); an accepted seeded sampled answer is logged."""
        problem = self.oracle.problem(ask, got)
        if problem is None and self.sampled is not None and ask.seed is not None and ask.temperature > 0:
            self.sampled.add(ask, got, self.oracle.departs_from_design(ask, got))
        return problem


def _path(ask: Ask) -> str:
    return "/v1/chat/completions" if ask.is_chat else "/v1/completions"


def rejected(kind: str, status: int, message: str) -> Outcome:
    """A valid request answered with an error status: only 429 is fine."""
    return Outcome(kind, status, None if status == 429 else f"HTTP {status}: {message[:200]}")


async def via_openai(target: Target, kind: str, ask: Ask, stream: bool) -> Outcome:
    kwargs: dict[str, Any] = {"model": target.model, "max_tokens": ask.max_tokens, "temperature": ask.temperature}
    if ask.seed is not None:
        kwargs["seed"] = ask.seed
    if ask.stop:
        kwargs["stop"] = list(ask.stop)
    if ask.stop_token_ids:
        kwargs["extra_body"] = {"stop_token_ids": list(ask.stop_token_ids)}
    if stream:
        kwargs.update(stream=True, stream_options={"include_usage": True})
    create = target.client.chat.completions.create if ask.is_chat else target.client.completions.create
    started = time.perf_counter()
    ttft, status = None, None
    try:
        if ask.is_chat:
            kwargs["messages"] = ask.prompt
        else:
            kwargs["prompt"] = ask.prompt
        answer = await create(**kwargs)
        status = 200
        if not stream:
            choice = answer.choices[0]
            text = choice.message.content if ask.is_chat else choice.text
            got = Got(text or "", choice.finish_reason, answer.usage.completion_tokens,
                      token_ids=getattr(choice, "token_ids", None))
            usage = answer.usage
        else:
            pieces, finish, usage, chunks = [], None, None, 0
            async for chunk in answer:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    piece = (choice.delta.content if ask.is_chat else choice.text) or ""
                    if choice.finish_reason is None:
                        chunks += 1
                        ttft = ttft if ttft is not None else time.perf_counter() - started
                    pieces.append(piece)
                    finish = choice.finish_reason or finish
            got = Got("".join(pieces), finish, usage.completion_tokens if usage else None, token_chunks=chunks)
    except openai.APIStatusError as err:
        return rejected(kind, err.status_code, err.message)
    except openai.APIError as err:  # an error event in a stream, a dropped connection, a timeout
        return Outcome(kind, status, f"{type(err).__name__}: {err}"[:300])
    except Exception as err:  # a transport error while a stream is read, which not every client version wraps
        return Outcome(kind, status, f"{type(err).__name__}: {err}"[:300])
    cached = _cached(usage)
    return Outcome(kind, 200, target.check(ask, got), time.perf_counter() - started, ttft, cached)


def _cached(usage: Any) -> int:
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return (getattr(details, "cached_tokens", None) or 0) if details is not None else 0


async def post(target: Target, kind: str, ask: Ask, headers: dict[str, str] | None = None,
               read_timeout_s: float | None = None) -> tuple[Outcome, Got | None]:
    """A non-streamed request as raw HTTP; also returns what came back (with the generated ids for token-id
    prompts), None without a 200.
    With `read_timeout_s` the client gives up that soon: a disconnect while the server works."""
    started = time.perf_counter()
    timeout = httpx.USE_CLIENT_DEFAULT if read_timeout_s is None else httpx.Timeout(60, read=read_timeout_s)
    try:
        reply = await target.http.post(f"{target.root}{_path(ask)}", json=ask.body(target.model), headers=headers,
                                       timeout=timeout)
    except httpx.HTTPError as err:
        if read_timeout_s is not None and isinstance(err, httpx.ReadTimeout):
            return Outcome(kind, None, left_early=True), None
        # Without an answer in the client's time (a request queued too long, a server that stalls) the request
        # has its problem; the soak goes on.
        return Outcome(kind, None, f"{type(err).__name__}: {str(err) or 'no answer in time'}"[:300]), None
    if reply.status_code != 200:
        return rejected(kind, reply.status_code, reply.text), None
    data = reply.json()
    choice = data["choices"][0]
    text = choice["message"]["content"] if ask.is_chat else choice["text"]
    got = Got(text, choice["finish_reason"], data["usage"]["completion_tokens"], token_ids=choice.get("token_ids"))
    cached = data["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return Outcome(kind, 200, target.check(ask, got), time.perf_counter() - started, None, cached), got


@dataclass
class StreamRead:
    """A raw stream read so far."""

    pieces: list[str]
    token_chunks: int = 0
    finish: str | None = None
    completion_tokens: int | None = None
    error: str | None = None
    done: bool = False  # [DONE] came


async def read_events(lines: AsyncIterator[str], into: StreamRead, chat: bool, max_tokens: int | None = None) -> None:
    """Read server-sent events until [DONE], or until `max_tokens` token chunks have come."""
    async for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            into.done = True
            return
        event = json.loads(payload)
        if "error" in event:
            into.error = str(event["error"].get("message"))
            continue
        if event.get("usage"):
            into.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            into.pieces.append((choice["delta"].get("content") if chat else choice["text"]) or "")
            if choice["finish_reason"] is None:
                into.token_chunks += 1
            into.finish = choice["finish_reason"] or into.finish
        if max_tokens is not None and into.token_chunks >= max_tokens:
            return


async def stream_raw(target: Target, kind: str, ask: Ask,
                     consume: Callable[[AsyncIterator[str]], Awaitable[None]]) -> Outcome | None:
    """Send a streamed request as raw HTTP and hand its lines to `consume`; the connection closes when that
    returns, read through or not. An Outcome when the request failed, None when `consume` ran."""
    body = {**ask.body(target.model), "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with target.http.stream("POST", f"{target.root}{_path(ask)}", json=body) as reply:
            if reply.status_code != 200:
                return rejected(kind, reply.status_code, (await reply.aread()).decode(errors="replace"))
            await consume(reply.aiter_lines())
    except httpx.HTTPError as err:
        return Outcome(kind, 200, f"{type(err).__name__}: {err}"[:300])
    return None


def stream_problem(target: Target, ask: Ask, read: StreamRead) -> str | None:
    if read.error is not None:
        return f"the stream ended with an error event: {read.error}"
    if not read.done:
        return "the stream ended without [DONE]"
    return target.check(ask, Got("".join(read.pieces), read.finish, read.completion_tokens,
                                 token_chunks=read.token_chunks))
