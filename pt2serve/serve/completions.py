"""The two generating endpoints: from a checked request to the runner, and back as a body or a stream."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.events import StreamEvent
from pt2serve.runtime.runner import Runner
from pt2serve.runtime.sampling import SamplingParams
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.errors import ApiError, bad_request
from pt2serve.runtime.grammar import CompiledGrammar, GrammarSpec
from pt2serve.serve.generation import Generation
from pt2serve.serve.logprob_format import TokenTexts
from pt2serve.serve.rendering import Rendering
from pt2serve.serve.tool_calls import ToolUse, template_format
from pt2serve.serve.openai_format import (
    FINISH_REASONS,
    SSE_DONE,
    SSE_KEEP_ALIVE,
    ChatFormat,
    CompletionFormat,
    Usage,
    sse,
)
from pt2serve.serve.schemas import MAX_SESSION_ID_CHARS, GenerationRequest, parse_chat, parse_completion
from pt2serve.serve.state import ServerState
from pt2serve.serve.transport import EventStream, read_json, wait_for_disconnect

# A stream with no event for this long gets an SSE comment (a request queued or preempted under load).
KEEP_ALIVE_S = 15.0

SESSION_HEADER = "x-session-id"


async def handle(request: Request, state: ServerState, chat: bool) -> Response:
    arrived = time.perf_counter()
    runner, config = state.ready_runner(), state.config
    data = await read_json(request, config)
    req = parse_chat(data) if chat else parse_completion(data)
    if req.model is not None and req.model != config.model_name:
        raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {config.model_name!r}",
                       "model", "model_not_found")
    session_id = _session_id(req, request)
    if session_id is not None and req.num_choices > 1:
        raise bad_request("a session continues one conversation: send one prompt with n=1", "session_id",
                          "invalid_value")
    _check_token_ids(runner, req.stop_token_ids, "stop_token_ids")
    _check_token_ids(runner, [token for token, _ in req.logit_bias], "logit_bias")
    tool_use = _tool_use(runner, req)
    # Refuse at capacity before the costly part: tokenizing and compiling a grammar wait on the thread pool,
    # where a burst queues them, and a 429 that waits for them took seconds. The check before submitting
    # still decides: other requests may fill the queue while this one is tokenized.
    state.check_admission(runner, req.num_choices)
    # Only work that would hold the loop goes to the pool: a hop there and back costs two thread switches,
    # each a wait for the GIL while the engine thread steps, and a burst of 64 requests took 100 ms more to
    # reach the runner when prompts of token ids and requests without a grammar hopped too.
    prompts = await run_in_threadpool(_prompt_ids, runner, req) if _has_text(req) else _prompt_ids(runner, req)
    max_tokens = [_max_tokens(runner, config, req, len(ids)) for ids in prompts]
    sampling = [_sampling(runner, req, _choice_seed(req.seed, j)) for j in range(req.n)]
    grammar = None
    if req.grammar is not None or tool_use is not None:
        grammar = await run_in_threadpool(_compile_grammar, runner, req, tool_use)
    state.check_admission(runner, req.num_choices)
    generations = _start(runner, state, req, arrived, prompts, max_tokens, sampling, session_id, grammar)
    render = Rendering(
        fmt=ChatFormat(config.model_name) if chat else CompletionFormat(config.model_name),
        texts=TokenTexts(runner.tokenizer, req.tokens_as_ids),
        prompts=prompts,
        echoed=[_echo_text(runner, p, ids) for p, ids in zip(req.prompts, prompts)] if req.echo else None,
        logprobs=req.logprobs is not None,
        token_ids=not chat and any(isinstance(prompt, list) for prompt in req.prompts),
        tool_use=tool_use,
    )
    if req.stream:
        return EventStream(_stream(generations, render, req.include_usage), on_close=lambda: _cancel(generations))
    return await _respond(request, generations, render)


def _start(runner: Runner, state: ServerState, req: GenerationRequest, arrived: float, prompts: list[list[int]],
           max_tokens: list[int], sampling: list[SamplingParams], session_id: str | None,
           grammar: CompiledGrammar | None) -> list[Generation]:
    """Submit every choice: per prompt, its first choice computes (and with echo scores) the prompt; the
    others share its cells."""
    prompt_logprobs = req.logprobs if req.echo else None
    # n > 1: the choices decode plainly (the first computes the prompt the others share), all alike.
    speculate = False if len(sampling) > 1 else None
    generations = []
    try:
        for prompt_index, (ids, limit) in enumerate(zip(prompts, max_tokens)):
            first = None
            for params in sampling:
                generation = Generation(runner, state.metrics, state.event_bridge(), arrived, prompt_index, first)
                generations.append(generation)
                generation.start(ids, limit, params, req.stop, req.stop_token_ids, session_id, req.ignore_eos,
                                 req.logprobs, prompt_logprobs if first is None else None, grammar, speculate)
                first = first or generation
    except Pt2ServeError as err:
        _cancel(generations)
        raise bad_request(str(err)) from None
    return generations


def _tool_use(runner: Runner, req: GenerationRequest) -> ToolUse | None:
    """How the reply may call the request's tools (None: it may not); refuses what the template cannot take."""
    if req.messages is None:
        return None
    family = template_format(runner.tokenizer.files.chat_template) if runner.tokenizer is not None else None
    history = next((i for i, m in enumerate(req.messages) if m["role"] == "tool" or "tool_calls" in m), None)
    if family is None and (req.tools or history is not None):
        param = "tools" if req.tools else f"messages.{history}"
        raise bad_request("this model's chat template takes no tools (or writes tool calls in a format this server "
                          "does not read: Llama 3.x JSON or Hermes/Qwen <tool_call>)", param, "tools_unsupported")
    if not req.tools or req.tool_choice == "none":
        return None
    return ToolUse(family, req.tools, req.tool_choice, req.parallel_tool_calls)


def _compile_grammar(runner: Runner, req: GenerationRequest, tool_use: ToolUse | None) -> CompiledGrammar | None:
    """The grammar the output must follow (response_format, guided_*, or a forced tool call), compiled."""
    spec = req.grammar
    schema = tool_use.grammar_schema() if tool_use is not None else None
    if schema is not None:
        spec = GrammarSpec("json_schema", schema)
    if spec is None:
        return None
    try:
        return runner.grammars.compile(spec)
    except Pt2ServeError as err:
        raise bad_request(str(err), "tools" if schema is not None else req.grammar_param,
                          "invalid_grammar") from None


def _echo_text(runner: Runner, prompt: str | list[int], ids: list[int]) -> str:
    """What `echo` puts before a completion: the prompt as sent, or the text of its token ids."""
    if isinstance(prompt, str):
        return prompt
    return runner.tokenizer.decode(ids) if runner.tokenizer is not None else ""


def _sampling(runner: Runner, req: GenerationRequest, seed: int | None) -> SamplingParams:
    """The request's sampling controls; what it leaves out comes from the model's generation_config.json,
    else OpenAI's defaults."""
    defaults = runner.generation_defaults

    def pick(value, name: str, default):
        return value if value is not None else defaults.get(name, default)

    try:
        return SamplingParams(
            temperature=pick(req.temperature, "temperature", 1.0), top_p=pick(req.top_p, "top_p", 1.0),
            top_k=int(pick(req.top_k, "top_k", 0)), seed=seed, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
            logit_bias=req.logit_bias, min_tokens=req.min_tokens,
        )
    except Pt2ServeError as err:
        raise bad_request(str(err), code="invalid_value") from None


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


def _has_text(req: GenerationRequest) -> bool:
    """Whether the request's prompt must be tokenized (a chat, or a prompt given as text)."""
    return req.messages is not None or any(isinstance(prompt, str) for prompt in req.prompts)


def _prompt_ids(runner: Runner, req: GenerationRequest) -> list[list[int]]:
    """Each prompt's token ids (a chat is one prompt)."""
    tokenizer = runner.tokenizer
    if req.messages is not None:
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so it cannot serve chat; send token ids to "
                              "/v1/completions", "messages", "no_tokenizer")
        try:
            return [tokenizer.encode_chat(req.messages, req.tools)]
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


async def _respond(request: Request, generations: list[Generation], render: Rendering) -> Response:
    """Wait for every choice; a client that disconnects first has its requests cancelled."""
    disconnect = asyncio.ensure_future(wait_for_disconnect(request.receive))
    # A task waiting for the choices, not a gather: a cancelled gather keeps a CancelledError that nobody
    # retrieves (logged when collected), a cancelled task is just cancelled.
    done = asyncio.ensure_future(asyncio.wait([generation.done for generation in generations]))
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
        choices.append(render.choice(index, generation, reason))
    return JSONResponse(render.fmt.body(choices, _usage(generations)))


def _usage(generations: list[Generation]) -> Usage:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice."""
    prompts = {g.prompt_index: g.usage() for g in reversed(generations)}.values()
    usages = [g.usage() for g in generations]
    speculation = None
    if usages[0].speculation is not None:
        speculation = sum((u.speculation for u in usages[1:]), usages[0].speculation)
    return Usage(sum(u.prompt_tokens for u in prompts), sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in prompts), speculation)


async def _merged(generations: list[Generation]) -> AsyncIterator[tuple[int, list[StreamEvent]]]:
    """(choice index, batch of events) as they come from every choice, until all have finished; an empty
    batch when a choice had no event for KEEP_ALIVE_S."""
    if len(generations) == 1:  # the common case needs no pump task and second queue per event
        async for batch in generations[0].event_batches(KEEP_ALIVE_S):
            yield 0, batch
        return
    queue: asyncio.Queue[tuple[int, list[StreamEvent]]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        async for batch in generation.event_batches(KEEP_ALIVE_S):
            queue.put_nowait((index, batch))

    pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(generations)
        while remaining:
            index, batch = await queue.get()
            remaining -= bool(batch) and batch[-1].finish_reason is not None
            yield index, batch
    finally:
        for task in pumps:
            task.cancel()


async def _stream(generations: list[Generation], render: Rendering, include_usage: bool) -> AsyncIterator[bytes]:
    """Per choice, one chunk per generated token (its text may be empty while held back), then one with the
    finish reason; after every choice, usage if asked for, then [DONE]. A choice that fails ends the stream
    with an error event.

    The events waiting together go out in one write: a client that falls behind costs fewer writes, and
    one that left is not written to once per queued event (asyncio warns about each such write). A request
    that waits (queued, or preempted under a full KV pool) gets an SSE comment every KEEP_ALIVE_S, which
    clients skip, so a read timeout shorter than the wait does not end a stream that is still served."""
    fmt = render.fmt
    text_offsets: dict[int, int] = {}  # per choice that has started: where its next text begins
    async for index, batch in _merged(generations):
        if not batch:
            yield SSE_KEEP_ALIVE
            continue
        parts = []
        for event in batch:
            if event.token_id is not None or event.text:  # a cut request's last event may carry held-back text
                first = index not in text_offsets
                chunks, text_offsets[index] = render.stream_chunks(index, generations[index], event, first,
                                                                   include_usage, text_offsets.get(index, 0))
                parts += [sse(chunk) for chunk in chunks]
            if event.finish_reason is None:
                continue
            reason = FINISH_REASONS.get(event.finish_reason)
            if reason is None:
                yield b"".join(parts) + sse(_ended_badly(generations[index]).body()) + SSE_DONE
                _cancel(generations)
                return
            # a clean end always comes with the last token, which carries any held-back text
            parts += [sse(chunk) for chunk in render.finish_chunks(index, reason, include_usage)]
        yield b"".join(parts)
    if include_usage:
        yield sse(fmt.usage_chunk(_usage(generations)))
    yield SSE_DONE


def _ended_badly(generation: Generation) -> ApiError:
    if generation.error is not None:
        return ApiError(500, "the model failed while generating this request; see the server log",
                        code="generation_failed")
    return ApiError(503, "the request was cancelled because the server is shutting down", code="cancelled")

