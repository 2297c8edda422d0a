"""The two generating endpoints: from a checked request to the runner, and back as a body or a stream."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.runner import Runner
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.errors import ApiError, bad_request
from pt2serve.serve.generation import Generation
from pt2serve.serve.openai_format import FINISH_REASONS, SSE_DONE, ChatFormat, CompletionFormat, sse
from pt2serve.serve.schemas import MAX_SESSION_ID_CHARS, GenerationRequest, parse_chat, parse_completion
from pt2serve.serve.state import ServerState
from pt2serve.serve.transport import EventStream, read_json, wait_for_disconnect

SESSION_HEADER = "x-session-id"


async def handle(request: Request, state: ServerState, chat: bool) -> Response:
    arrived = time.perf_counter()
    runner, config = state.ready_runner(), state.config
    data = await read_json(request, config.max_body_bytes)
    req = parse_chat(data) if chat else parse_completion(data)
    if req.model is not None and req.model != config.model_name:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {config.model_name!r}",
                       "model", "model_not_found")
    session_id = _session_id(req, request)
    _check_token_ids(runner, req.stop_token_ids, "stop_token_ids")
    prompt_ids = await run_in_threadpool(_prompt_ids, runner, req)
    max_tokens = _max_tokens(runner, config, req, len(prompt_ids))
    try:
        sampling = SamplingParams(req.temperature, req.top_p, req.top_k, req.seed)
    except Pt2ServeError as err:
        raise bad_request(str(err)) from None
    state.check_admission(runner)
    generation = Generation(runner, state.metrics, arrived)
    try:
        generation.start(prompt_ids, max_tokens, sampling, req.stop, req.stop_token_ids, session_id, req.ignore_eos)
    except Pt2ServeError as err:
        raise bad_request(str(err)) from None
    fmt = ChatFormat(config.model_name) if chat else CompletionFormat(config.model_name)
    if req.stream:
        return EventStream(_stream(generation, fmt, req.include_usage), on_close=generation.cancel)
    return await _respond(request, generation, fmt, token_ids=not chat and isinstance(req.prompt, list))


def _session_id(req: GenerationRequest, request: Request) -> str | None:
    if req.session_id is not None:
        return req.session_id
    header = request.headers.get(SESSION_HEADER)
    if header is None:
        return None
    if not header or len(header) > MAX_SESSION_ID_CHARS:
        raise bad_request(f"the X-Session-ID header must have 1 to {MAX_SESSION_ID_CHARS} characters", "session_id")
    return header


def _prompt_ids(runner: Runner, req: GenerationRequest) -> list[int]:
    tokenizer = runner.tokenizer
    if req.messages is not None:
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so it cannot serve chat; send token ids to "
                              "/v1/completions", "messages")
        try:
            return tokenizer.encode_chat(req.messages)
        except Pt2ServeError as err:
            raise bad_request(str(err), "messages") from None
    if isinstance(req.prompt, str):
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as a list of token ids", "prompt")
        return tokenizer.encode(req.prompt)
    assert req.prompt is not None
    _check_token_ids(runner, req.prompt, "prompt")
    return req.prompt


def _check_token_ids(runner: Runner, ids: list[int] | tuple[int, ...], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < runner.vocab_size]
    if bad:
        raise bad_request(f"the {param} has token ids outside the vocabulary [0, {runner.vocab_size}): {bad[:5]}",
                          param, "invalid_token_ids")


def _max_tokens(runner: Runner, config: ServerConfig, req: GenerationRequest, num_prompt: int) -> int:
    context = runner.max_context
    if num_prompt >= context:
        raise bad_request(f"the prompt has {num_prompt} tokens; this model's context is {context} tokens, leaving "
                          "no room to generate", "messages" if req.messages is not None else "prompt",
                          "context_length_exceeded")
    if req.max_tokens is None:
        return min(config.default_max_tokens, context - num_prompt)
    if num_prompt + req.max_tokens > context:
        raise bad_request(f"the prompt ({num_prompt} tokens) + max_tokens ({req.max_tokens}) = "
                          f"{num_prompt + req.max_tokens} tokens exceeds this model's context of {context} tokens",
                          "max_tokens", "context_length_exceeded")
    return req.max_tokens


async def _respond(request: Request, generation: Generation, fmt: ChatFormat | CompletionFormat,
                   token_ids: bool) -> Response:
    """Wait for the whole completion; a client that disconnects first has its request cancelled."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({generation.done, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        generation.cancel()  # a no-op once finished
    if not generation.finished:
        return Response(status_code=499)  # nobody is listening any more
    reason = FINISH_REASONS.get(generation.finish_reason)
    if reason is None:
        return _ended_badly(generation).response()
    body = fmt.body(generation.text, reason, generation.usage(), list(generation.token_ids) if token_ids else None)
    return JSONResponse(body)


async def _stream(generation: Generation, fmt: ChatFormat | CompletionFormat,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """One chunk per generated token (its text may be empty while held back), then one with the finish
    reason, then usage if asked for, then [DONE]. A request that fails ends with an error event.

    The events waiting together go out in one write: a client that falls behind costs fewer writes, and
    one that left is not written to once per queued event (asyncio warns about each such write)."""
    first = True
    async for batch in generation.event_batches():
        parts = []
        for event in batch:
            if event.token_id is not None or event.text:  # a cut request's last event may carry held-back text
                parts.append(sse(fmt.chunk(event.text, first, include_usage)))
                first = False
            if event.finish_reason is None:
                continue
            reason = FINISH_REASONS.get(event.finish_reason)
            if reason is None:
                parts.append(sse(_ended_badly(generation).body()))
            else:  # a clean end always comes with the last token, which carries any held-back text
                parts.append(sse(fmt.finish_chunk(reason, include_usage)))
                if include_usage:
                    parts.append(sse(fmt.usage_chunk(generation.usage())))
        yield b"".join(parts)
    yield SSE_DONE


def _ended_badly(generation: Generation) -> ApiError:
    if generation.error is not None:
        return ApiError(500, "the model failed while generating this request; see the server log",
                        code="generation_failed")
    return ApiError(503, "the request was cancelled because the server is shutting down", code="cancelled")

