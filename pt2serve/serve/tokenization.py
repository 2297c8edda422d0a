"""vLLM's tokenizer endpoints, so clients tokenize with the server's own tokenizer instead of fetching one
(lm-evaluation-harness's local-completions looks for them and uses them by default):

    POST /tokenize        {model, prompt, add_special_tokens} or {model, messages, add_generation_prompt, tools,
                          add_special_tokens}, and return_token_strs
                          -> {count, max_model_len, tokens, token_strs (the vocabulary's pieces, when asked)}
    POST /detokenize      {model, tokens} -> {prompt}
    GET  /tokenizer_info  the tokenizer's configuration and the chat template the server renders chats with

The ids are exactly those the generating endpoints compute for the same prompt (add_special_tokens left
out: bos before a text prompt, and a chat as its template writes it).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.runner import Runner
from pt2serve.serve.errors import ApiError, bad_request
from pt2serve.serve.schemas import TokenizeRequest, parse_detokenize, parse_tokenize
from pt2serve.serve.state import ServerState
from pt2serve.serve.transport import read_json
from pt2serve.tokenizer import Tokenizer


async def tokenize(request: Request, state: ServerState) -> dict[str, Any]:
    runner = state.ready_runner()
    req = parse_tokenize(await read_json(request, state.config))
    _check_model(state, req.model)
    tokenizer = _tokenizer(runner)
    ids = await run_in_threadpool(_encode, tokenizer, req)
    strings = [tokenizer.token_piece(token) for token in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": runner.max_sequence_tokens, "tokens": ids, "token_strs": strings}


async def detokenize(request: Request, state: ServerState) -> dict[str, Any]:
    runner = state.ready_runner()
    model, tokens = parse_detokenize(await read_json(request, state.config))
    _check_model(state, model)
    tokenizer = _tokenizer(runner)
    bad = [t for t in tokens if not 0 <= t < runner.vocab_size]
    if bad:
        raise bad_request(f"tokens has ids outside the vocabulary [0, {runner.vocab_size}): {bad[:5]}", "tokens",
                          "invalid_token_ids")
    return {"prompt": await run_in_threadpool(tokenizer.decode, tokens)}


def tokenizer_info(state: ServerState) -> dict[str, Any]:
    """As vLLM's: the tokenizer_config.json fields clients read (bos and eos as text), and the chat template."""
    runner = state.ready_runner()
    tokenizer = _tokenizer(runner)
    files = tokenizer.files
    return {"tokenizer_class": "PreTrainedTokenizerFast", **files.special_tokens,
            "bos_token_id": files.bos_token_id, "eos_token_ids": list(files.eos_token_ids),
            "model_max_length": runner.max_sequence_tokens, "chat_template": tokenizer.chat_template}


def _encode(tokenizer: Tokenizer, req: TokenizeRequest) -> list[int]:
    if req.prompt is not None:
        return tokenizer.encode(req.prompt, add_bos=req.add_special_tokens is not False)
    try:
        return tokenizer.encode_chat(req.messages, req.tools, req.add_generation_prompt, req.add_special_tokens)
    except Pt2ServeError as err:
        raise bad_request(str(err), "messages", "chat_template_failed") from None


def _tokenizer(runner: Runner) -> Tokenizer:
    if runner.tokenizer is None:
        raise bad_request("this model has no tokenizer: it takes and gives token ids only", code="no_tokenizer")
    return runner.tokenizer


def _check_model(state: ServerState, model: str | None) -> None:
    name = state.config.model_name
    if model is not None and model != name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {name!r}", "model",
                       "model_not_found")
