"""Driving a running server over its OpenAI completions API (streaming, so TTFT is real).

Each request is POST {url}/v1/completions with the prompt as token ids, max_tokens, stream=true and
stream_options.include_usage; the reply is read as server-sent events (`data: {...}` lines, ending with
`data: [DONE]`). A chunk that carries a choice is a token arrival: the first one sets the first-token time,
the last one the end. The output token count is the usage's completion_tokens when the server sends it,
else the number of chunks that carried text or no finish reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

import httpx

from pt2serve.bench.options import RequestsOptions
from pt2serve.bench.requests_mode import RequestTiming, RequestsResult, arrival_times, make_prompts, summarise
from pt2serve.errors import Pt2ServeError

Progress = Callable[[str], None]
FALLBACK_VOCAB = 256  # prompt ids are drawn from [0, this) when no artifact says the vocabulary size


def drive_server(options: RequestsOptions, vocab_size: int | None, progress: Progress | None = None) -> RequestsResult:
    return asyncio.run(_drive(options, vocab_size or FALLBACK_VOCAB, progress))


async def _drive(options: RequestsOptions, vocab_size: int, progress: Progress | None) -> RequestsResult:
    base = options.url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    limits = httpx.Limits(max_connections=max(100, options.requests + 1), max_keepalive_connections=20)
    timeout = httpx.Timeout(options.timeout, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = options.model or await _first_model(client, base)
        prompts = make_prompts(options, vocab_size)
        if options.warmup_request:
            warm = RequestTiming(-1, 0.0, min(8, options.prompt_tokens))
            await _one(client, base, model, prompts[0][:8], 2, warm, time.perf_counter())
            if warm.error is not None:
                raise Pt2ServeError(f"the server at {base} failed a warm-up request: {warm.error}")
        timings = [RequestTiming(i, t, options.prompt_tokens) for i, t in enumerate(arrival_times(options))]
        origin = time.perf_counter()

        async def launch(timing: RequestTiming, prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, origin + timing.arrival - time.perf_counter()))
            await _one(client, base, model, prompt, options.max_new_tokens, timing, origin)

        tasks = [asyncio.create_task(launch(t, p)) for t, p in zip(timings, prompts)]
        pending = set(tasks)
        deadline = origin + options.timeout
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.1)
            if progress is not None:
                submitted = sum(t.submit is not None for t in timings)
                done = len(tasks) - len(pending)
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
    return result


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


async def _one(
    client: httpx.AsyncClient, base: str, model: str, prompt: list[int], max_tokens: int,
    timing: RequestTiming, origin: float,
) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    timing.submit = time.perf_counter() - origin
    chunks_counted = 0
    usage_tokens = None
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                timing.error = f"HTTP {reply.status_code}: {text[:300]}"
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                chunk = _parse(payload)
                if chunk is None:
                    timing.error = f"unreadable event: {payload[:200]}"
                    return
                if chunk.get("error"):
                    timing.error = str(chunk["error"])
                    return
                now = time.perf_counter() - origin
                choices = chunk.get("choices") or []
                if choices:
                    if timing.first_token is None:
                        timing.first_token = now
                    timing.end = now
                    choice = choices[0]
                    if choice.get("text") or choice.get("finish_reason") is None:
                        chunks_counted += 1
                        timing.output_tokens = chunks_counted
                    if choice.get("finish_reason") is not None:
                        timing.finish_reason = str(choice["finish_reason"])
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
    except httpx.HTTPError as err:
        timing.error = f"{type(err).__name__}: {err}"
        return
    timing.output_tokens = usage_tokens if usage_tokens is not None else chunks_counted
    if timing.first_token is None:
        timing.error = timing.error or "the stream ended without a token"


def _parse(payload: str) -> dict[str, Any] | None:
    try:
        value = json.loads(payload)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
