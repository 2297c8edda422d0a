"""The two generating endpoints: from a checked request to the runner, and back as a body or a stream."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.runner import Runner, StreamEvent
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.errors import ApiError, bad_request
from pt2serve.serve.generation import Generation
from pt2serve.serve.openai_format import FINISH_REASONS, SSE_DONE, ChatFormat, Choice, CompletionFormat, Usage, sse
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
    if session_id is not None and req.num_choices > 1:
        raise bad_request("a session continues one conversation: send one prompt with n=1", "session_id",
                          "invalid_value")
    _check_token_ids(runner, req.stop_token_ids, "stop_token_ids")
    prompts = await run_in_threadpool(_prompt_ids, runner, req)
    max_tokens = [_max_tokens(runner, config, req, len(ids)) for ids in prompts]
    try:
        sampling = [SamplingParams(req.temperature, req.top_p, req.top_k, _choice_seed(req.seed, j))
                    for j in range(req.n)]
    except Pt2ServeError as err:
        raise bad_request(str(err)) from None
    state.check_admission(runner, req.num_choices)
    generations = []
    try:
        for prompt_index, (ids, limit) in enumerate(zip(prompts, max_tokens)):
            for params in sampling:
                generation = Generation(runner, state.metrics, arrived, prompt_index)
                generations.append(generation)
                generation.start(ids, limit, params, req.stop, req.stop_token_ids, session_id, req.ignore_eos)
    except Pt2ServeError as err:
        for generation in generations:
            generation.cancel()
        raise bad_request(str(err)) from None
    fmt = ChatFormat(config.model_name) if chat else CompletionFormat(config.model_name)
    if req.stream:
        return EventStream(_stream(generations, fmt, req.include_usage), on_close=lambda: _cancel(generations))
    token_ids = not chat and any(isinstance(prompt, list) for prompt in req.prompts)
    return await _respond(request, generations, fmt, token_ids)


def _choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice j of a seeded request draws from seed + j: each choice equals the request with that seed alone."""
    return None if seed is None else seed + choice


def _cancel(generations: list[Generation]) -> None:
    for generation in generations:
        generation.cancel()


def _session_id(req: GenerationRequest, request: Request) -> str | None:
    if req.session_id is not None:
        return req.session_id
    header = request.headers.get(SESSION_HEADER)
    if header is None:
        return None
    if not header or len(header) > MAX_SESSION_ID_CHARS:
        raise bad_request(f"the X-Session-ID header must have 1 to {MAX_SESSION_ID_CHARS} characters", "session_id")
    return header


def _prompt_ids(runner: Runner, req: GenerationRequest) -> list[list[int]]:
    """Each prompt's token ids (a chat is one prompt)."""
    tokenizer = runner.tokenizer
    if req.messages is not None:
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so it cannot serve chat; send token ids to "
                              "/v1/completions", "messages", "no_tokenizer")
        try:
            return [tokenizer.encode_chat(req.messages)]
        except Pt2ServeError as err:
            raise bad_request(str(err), "messages", "chat_template_failed") from None
    assert req.prompts is not None
    prompts = []
    for i, prompt in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            if tokenizer is None:
                raise bad_request("this model has no tokenizer: send the prompt as a list of token ids", param,
                                  "no_tokenizer")
            prompts.append(tokenizer.encode(prompt))
        else:
            _check_token_ids(runner, prompt, param)
            prompts.append(prompt)
    return prompts


def _check_token_ids(runner: Runner, ids: list[int] | tuple[int, ...], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < runner.vocab_size]
    if bad:
        raise bad_request(f"the {param} has token ids outside the vocabulary [0, {runner.vocab_size}): {bad[:5]}",
                          param, "invalid_token_ids")


def _max_tokens(runner: Runner, config: ServerConfig, req: GenerationRequest, num_prompt: int) -> int:
    """The request's max_tokens, checked; without one, the room left in the context (or the server's cap)."""
    context = runner.max_sequence_tokens
    if num_prompt >= context:
        raise bad_request(f"the prompt has {num_prompt} tokens; this model's context is {context} tokens, leaving "
                          "no room to generate", "messages" if req.messages is not None else "prompt",
                          "context_length_exceeded")
    if req.max_tokens is None:
        room = context - num_prompt
        return room if config.default_max_tokens is None else min(config.default_max_tokens, room)
    if num_prompt + req.max_tokens > context:
        raise bad_request(f"the prompt ({num_prompt} tokens) + max_tokens ({req.max_tokens}) = "
                          f"{num_prompt + req.max_tokens} tokens exceeds this model's context of {context} tokens",
                          "max_tokens", "context_length_exceeded")
    return req.max_tokens


async def _respond(request: Request, generations: list[Generation], fmt: ChatFormat | CompletionFormat,
                   token_ids: bool) -> Response:
    """Wait for every choice; a client that disconnects first has its requests cancelled."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(request.receive))
    done = asyncio.gather(*(generation.done for generation in generations))
    try:
        await asyncio.wait({done, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
        _cancel(generations)  # a no-op for those finished
    if not all(generation.finished for generation in generations):
        done.cancel()
        return Response(status_code=499)  # nobody is listening any more
    choices = []
    for index, generation in enumerate(generations):
        reason = FINISH_REASONS.get(generation.finish_reason)
        if reason is None:
            return _ended_badly(generation).response()
        choices.append(Choice(index, generation.text, reason, list(generation.token_ids) if token_ids else None))
    return JSONResponse(fmt.body(choices, _usage(generations)))


def _usage(generations: list[Generation]) -> Usage:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice."""
    prompts = {g.prompt_index: g.usage() for g in reversed(generations)}.values()
    return Usage(sum(u.prompt_tokens for u in prompts), sum(g.usage().completion_tokens for g in generations),
                 sum(u.cached_tokens for u in prompts))


async def _merged(generations: list[Generation]) -> AsyncIterator[tuple[int, list[StreamEvent]]]:
    """(choice index, batch of events) as they come from every choice, until all have finished."""
    queue: asyncio.Queue[tuple[int, list[StreamEvent]]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        async for batch in generation.event_batches():
            queue.put_nowait((index, batch))

    pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(generations)
        while remaining:
            index, batch = await queue.get()
            remaining -= batch[-1].finish_reason is not None
            yield index, batch
    finally:
        for task in pumps:
            task.cancel()


async def _stream(generations: list[Generation], fmt: ChatFormat | CompletionFormat,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """Per choice, one chunk per generated token (its text may be empty while held back), then one with the
    finish reason; after every choice, usage if asked for, then [DONE]. A choice that fails ends the stream
    with an error event.

    The events waiting together go out in one write: a client that falls behind costs fewer writes, and
    one that left is not written to once per queued event (asyncio warns about each such write)."""
    started: set[int] = set()
    async for index, batch in _merged(generations):
        parts = []
        for event in batch:
            if event.token_id is not None or event.text:  # a cut request's last event may carry held-back text
                parts.append(sse(fmt.chunk(index, event.text, index not in started, include_usage)))
                started.add(index)
            if event.finish_reason is None:
                continue
            reason = FINISH_REASONS.get(event.finish_reason)
            if reason is None:
                yield b"".join(parts) + sse(_ended_badly(generations[index]).body()) + SSE_DONE
                _cancel(generations)
                return
            # a clean end always comes with the last token, which carries any held-back text
            parts.append(sse(fmt.finish_chunk(index, reason, include_usage)))
        yield b"".join(parts)
    if include_usage:
        yield sse(fmt.usage_chunk(_usage(generations)))
    yield SSE_DONE


def _ended_badly(generation: Generation) -> ApiError:
    if generation.error is not None:
        return ApiError(500, "the model failed while generating this request; see the server log",
                        code="generation_failed")
    return ApiError(503, "the request was cancelled because the server is shutting down", code="cancelled")

