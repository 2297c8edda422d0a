"""Driving a running server over its OpenAI API (streaming, so TTFT is real).

Each request is POST {url}/v1/completions with the prompt as token ids (the chat workload: POST
{url}/v1/chat/completions with the conversation's messages), max_tokens, temperature 0 and ignore_eos (as the
in-process driver runs them), stream=true and stream_options.include_usage; the reply is read as server-sent
events (`data: {...}` lines, ending with `data: [DONE]`). A chunk that carries a choice is a token arrival: the
first one sets the first-token time, the last one the end. The output token count is the usage's
completion_tokens when the server sends it, else the number of chunks that carried text or no finish reason; the
usage also gives the prompt tokens and those reused from the server's prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from pt2serve.bench.conversations import ChatScript, chat_script, conversation_timings
from pt2serve.bench.options import RequestsOptions
from pt2serve.bench.progress import Progress
from pt2serve.bench.request_timing import RequestsResult, RequestTiming, summarise
from pt2serve.bench.workload import arrival_times, make_prompts
from pt2serve.errors import Pt2ServeError
from pt2serve.tokenizer import Tokenizer

FALLBACK_VOCAB = 256  # prompt ids are drawn from [0, this) when no artifact says the vocabulary size


def drive_server(options: RequestsOptions, vocab_size: int | None, tokenizer: Tokenizer | None = None,
                 progress: Progress | None = None) -> RequestsResult:
    """The workload against options.url; `tokenizer` (the artifact's, if given) sizes chat text in tokens."""
    return asyncio.run(_drive(options, vocab_size or FALLBACK_VOCAB, tokenizer, progress))


async def _drive(options: RequestsOptions, vocab_size: int, tokenizer: Tokenizer | None,
                 progress: Progress | None) -> RequestsResult:
    base = options.url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    # Every connection a load opens is kept for the next (a load after a warm-up reuses them all, as a
    # long-running client would): with fewer kept, a 64-request load opened 44 new ones each time.
    connections = max(100, options.requests + 1)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(options.timeout, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = options.model or await _first_model(client, base)
        if options.warmup_request:
            warm = RequestTiming(-1, 0.0, 8)
            # Ids no workload prompt is likely to start with: the warm-up leaves nothing in the cache for them.
            await _one(client, f"{base}/v1/completions", _completion(model, [vocab_size - 1] * 8, 2), warm,
                       time.perf_counter())
            if warm.error is not None:
                raise Pt2ServeError(f"the server at {base} failed a warm-up request: {warm.error}")
        origin = time.perf_counter()
        cpu_at_origin = time.process_time()
        if options.workload == "chat":
            timings = conversation_timings(options)
            tasks = _conversations(client, base, model, options, chat_script(options, tokenizer), timings, origin)
        else:
            timings = [RequestTiming(i, t, options.prompt_tokens) for i, t in enumerate(arrival_times(options))]
            tasks = _random_requests(client, base, model, options, make_prompts(options, vocab_size), timings, origin)
        pending = set(tasks)
        deadline = origin + options.timeout
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.1)
            if progress is not None:
                submitted = sum(t.submit is not None for t in timings)
                done = sum(t.end is not None or t.error is not None for t in timings)
                tokens = sum(t.output_tokens for t in timings)
                progress(f"requests to {base}: {submitted}/{len(timings)} sent, {done} finished, {tokens} tokens out")
            if pending and time.perf_counter() > deadline:
                for task in pending:
                    task.cancel()
                raise Pt2ServeError(f"the requests did not finish within --timeout {options.timeout:.0f} s")
    if all(t.error is not None for t in timings):
        raise Pt2ServeError(f"every request to {base} failed; the first error: {timings[0].error}")
    result = RequestsResult(base, options, timings)
    result.summary = summarise(timings, options.targets)
    # The client's own CPU over the load: near the load's duration, the client (one Python thread reading every
    # stream) limits what it measures.
    result.summary["client_cpu_seconds"] = time.process_time() - cpu_at_origin
    return result


def _random_requests(client: httpx.AsyncClient, base: str, model: str, options: RequestsOptions,
                     prompts: list[list[int]], timings: list[RequestTiming], origin: float) -> list[asyncio.Task]:
    async def launch(timing: RequestTiming, prompt: list[int]) -> None:
        await asyncio.sleep(max(0.0, origin + timing.arrival - time.perf_counter()))
        await _one(client, f"{base}/v1/completions", _completion(model, prompt, options.max_new_tokens), timing,
                   origin)

    return [asyncio.create_task(launch(t, p)) for t, p in zip(timings, prompts)]


def _conversations(client: httpx.AsyncClient, base: str, model: str, options: RequestsOptions, script: ChatScript,
                   timings: list[RequestTiming], origin: float) -> list[asyncio.Task]:
    async def converse(conversation: int) -> None:
        turns = timings[conversation * options.turns:(conversation + 1) * options.turns]
        await asyncio.sleep(max(0.0, origin + turns[0].arrival - time.perf_counter()))
        replies: list[str] = []
        for timing in turns:
            if timing.turn:
                timing.arrival = time.perf_counter() - origin  # sent as soon as the turn before it ended
            body = {"model": model, "messages": script.messages(conversation, replies),
                    "max_tokens": options.max_new_tokens, **AS_IN_PROCESS}
            replies.append(await _one(client, f"{base}/v1/chat/completions", body, timing, origin))
            if timing.error is not None:
                for later in turns[timing.turn + 1:]:
                    later.error = f"turn {timing.turn} of its conversation failed"
                return

    return [asyncio.create_task(converse(c)) for c in range(options.requests)]


async def _first_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        reply = await client.get(f"{base}/v1/models")
    except httpx.HTTPError as err:
        raise Pt2ServeError(f"cannot reach a server at {base}: {err or type(err).__name__}") from None
    try:
        models = reply.json().get("data") or []
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return "default"  # the server does not list models; it most likely ignores the name


# What every request asks besides its prompt, as the in-process driver runs it: greedy (a server's default
# temperature samples, which cost the 8B about 0.8 ms a step at 64 sequences), every token to max_tokens.
AS_IN_PROCESS = {"temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _completion(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **AS_IN_PROCESS}


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], timing: RequestTiming,
               origin: float) -> str:
    """Send one streamed request, timing its chunks; returns the text it produced."""
    timing.submit = time.perf_counter() - origin
    chunks_counted = 0
    usage_tokens = None
    parts: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                timing.error = f"HTTP {reply.status_code}: {text[:300]}"
                return ""
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                chunk = _parse(payload)
                if chunk is None:
                    timing.error = f"unreadable event: {payload[:200]}"
                    return ""
                if chunk.get("error"):
                    timing.error = str(chunk["error"])
                    return ""
                now = time.perf_counter() - origin
                choices = chunk.get("choices") or []
                if choices:
                    if timing.first_token is None:
                        timing.first_token = now
                    timing.end = now
                    choice = choices[0]
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    parts.append(text)
                    if text or choice.get("finish_reason") is None:
                        chunks_counted += 1
                        timing.output_tokens = chunks_counted
                    if choice.get("finish_reason") is not None:
                        timing.finish_reason = str(choice["finish_reason"])
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = _read_usage(usage, timing, usage_tokens)
    except httpx.HTTPError as err:
        timing.error = f"{type(err).__name__}: {err}"
        return ""
    timing.output_tokens = usage_tokens if usage_tokens is not None else chunks_counted
    if timing.first_token is None:
        timing.error = timing.error or "the stream ended without a token"
    return "".join(parts)


def _read_usage(usage: dict[str, Any], timing: RequestTiming, completion_tokens: int | None) -> int | None:
    """Take the prompt and cached token counts into `timing`; returns the completion tokens, if given."""
    if usage.get("prompt_tokens") is not None:
        timing.prompt_tokens = int(usage["prompt_tokens"])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        timing.cached_tokens = int(cached)
    given = usage.get("completion_tokens")
    return int(given) if given is not None else completion_tokens


def _parse(payload: str) -> dict[str, Any] | None:
    try:
        value = json.loads(payload)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
