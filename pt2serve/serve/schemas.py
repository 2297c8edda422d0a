"""Request bodies: parse and check them, answering a bad one with an ApiError that names the field.

Scalars are checked by pydantic in strict mode (no "12" for 12, no true for 1); prompts, messages and
stop strings, whose accepted shapes are unions, are checked by hand for clearer messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pt2serve.runtime.sampling import MAX_TEMPERATURE
from pt2serve.serve.errors import ApiError, bad_request

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 16
MAX_SESSION_ID_CHARS = 256
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share; unknown fields are ignored, unsupported features refused."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # extension: 0 means no limit
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Any = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)  # extension, as vLLM's
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    session_id: str | None = Field(None, min_length=1, max_length=MAX_SESSION_ID_CHARS)  # extension
    ignore_eos: bool | None = False  # extension
    # Accepted only at their "off" values.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None


class _CompletionBody(_Common):
    prompt: Any = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class _ChatBody(_Common):
    messages: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: list[Any] | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request, the same for both endpoints (exactly one of prompt and messages is set)."""

    model: str | None
    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    max_tokens: int | None  # None: the server's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]  # end the request when one is generated (its text is kept)
    stream: bool
    include_usage: bool
    session_id: str | None
    ignore_eos: bool


def parse_completion(data: Any) -> GenerationRequest:
    body = _validate(_CompletionBody, data)
    _refuse_unsupported(body)
    if body.echo:
        raise _unsupported("echo")
    if body.best_of not in (None, 1):
        raise _unsupported("best_of", "only best_of=1 is supported")
    if body.suffix:
        raise _unsupported("suffix")
    if body.logprobs is not None:
        raise _unsupported("logprobs")
    return _request(body, prompt=_prompt(body.prompt), max_tokens=body.max_tokens)


def parse_chat(data: Any) -> GenerationRequest:
    body = _validate(_ChatBody, data)
    _refuse_unsupported(body)
    if body.logprobs not in (None, False) or body.top_logprobs:
        raise _unsupported("logprobs")
    if body.tools:
        raise _unsupported("tools")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _request(body, messages=_messages(body.messages), max_tokens=max_tokens)


def _validate(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from None


def _refuse_unsupported(body: _Common) -> None:
    if body.n not in (None, 1):
        raise _unsupported("n", f"only n=1 is supported, got n={body.n}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise _unsupported(name)
    if body.logit_bias:
        raise _unsupported("logit_bias")


def _unsupported(param: str, message: str | None = None) -> ApiError:
    return bad_request(message or f"{param} is not supported by this server", param, "unsupported_parameter")


def _request(body: _Common, *, max_tokens: int | None, prompt=None, messages=None) -> GenerationRequest:
    options = body.stream_options
    if options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    return GenerationRequest(
        model=body.model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        seed=body.seed,
        stop=_stop(body.stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        stream=bool(body.stream),
        include_usage=bool(options and options.include_usage),
        session_id=body.session_id,
        ignore_eos=bool(body.ignore_eos),
    )


def _prompt(value: Any) -> str | list[int]:
    """A text or a list of token ids; a batch of exactly one is unwrapped, larger batches refused."""
    if value is None:
        raise bad_request("prompt: Field required", "prompt")
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) != 1:
            raise bad_request(f"only one prompt per request is supported, got {len(value)}", "prompt")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad_request("prompt must not be empty", "prompt")
        return _text(value, "prompt")
    if isinstance(value, list):
        if not value:
            raise bad_request("prompt must not be empty", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise bad_request("prompt must be a string or a list of integer token ids", "prompt")
        return list(value)
    raise bad_request("prompt must be a string or a list of integer token ids", "prompt")


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise bad_request("messages: Field required", "messages")
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        messages.append({"role": role, "content": _content(message.get("content"), f"{where}.content")})
    return messages


def _content(value: Any, where: str) -> str:
    """A message's text: a string, or a list of {"type": "text", "text": ...} parts joined."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{where}: only text content parts are supported", where)
            texts.append(part["text"])
        return _text("".join(texts), where)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def _text(value: str, where: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer takes: refuse them here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{where} is not valid Unicode (it has a lone surrogate)", where) from None
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return tuple(stops)
