"""Request bodies: parse and check them, answering a bad one with an ApiError that names the field.

Scalars are checked by pydantic in strict mode (no "12" for 12, no true for 1); prompts, messages and
stop strings, whose accepted shapes are unions, are checked by hand for clearer messages.

No field that changes the output is ignored: a known parameter this server cannot honour is refused with
a 400 that names it (code "unsupported_parameter"). Fields that do not change the output (`user`,
`metadata`, ...) are accepted; any other unknown field is logged at info and ignored, since clients send
their own extensions, except those that are known to change the output elsewhere (see REFUSED_EXTENSIONS).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.grammar import GrammarSpec, schema_text
from pt2serve.runtime.logprobs import MAX_TOP_LOGPROBS
from pt2serve.runtime.sampling import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_TEMPERATURE
from pt2serve.serve.errors import ApiError, bad_request

log = logging.getLogger("pt2serve.serve")

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 16
MAX_SESSION_ID_CHARS = 256
MAX_PROMPTS = 256  # prompts in one completions request
MAX_CHOICES = 128  # n, and prompts x n
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields OpenAI or peers define that leave the output as it is.
NO_EFFECT_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prediction", "stream_options",
                              "guided_decoding_backend"})
# Extensions other servers accept that change the output and that this server does not implement.
REFUSED_EXTENSIONS = frozenset({
    "min_p", "top_a", "typical_p", "use_beam_search", "length_penalty", "early_stopping", "bad_words",
    "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "truncate_prompt_tokens", "prompt_logprobs", "guided_whitespace_pattern", "structured_outputs",
    "continue_final_message", "add_generation_prompt",
    "chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs", "functions", "function_call",
    "audio", "modalities", "web_search_options", "reasoning_effort", "verbosity", "logits_processors",
    "vllm_xargs", "nvext", "priority",
})


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

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
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    session_id: str | None = Field(None, min_length=1, max_length=MAX_SESSION_ID_CHARS)  # extension
    ignore_eos: bool | None = False  # extension
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)  # extension
    min_tokens: int | None = Field(None, ge=0)  # extension
    logit_bias: dict[str, Any] | None = None
    logprobs: Any = None
    response_format: Any = None
    guided_json: Any = None  # extensions, as vLLM's: the output follows a JSON schema, a regex, an EBNF grammar,
    guided_regex: str | None = None  # or is one of the given strings
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    return_tokens_as_token_ids: bool | None = False  # extension, as vLLM's: logprobs name tokens "token_id:N"


class _CompletionBody(_Common):
    prompt: Any = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class _ChatBody(_Common):
    messages: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request, the same for both endpoints (exactly one of prompts and messages is set)."""

    model: str | None
    prompts: list[str | list[int]] | None  # completions: one choice (or n) per prompt
    messages: list[dict[str, Any]] | None
    max_tokens: int | None  # None: the server's default
    temperature: float | None  # None (and top_p, top_k, repetition_penalty): the model's default
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]  # end the request when one is generated (its text is kept)
    stream: bool
    include_usage: bool
    session_id: str | None
    ignore_eos: bool
    n: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # each generated token's log probability, with this many alternatives
    grammar: GrammarSpec | None = None  # what the output must match
    grammar_param: str | None = None  # the field that asked for it
    tools: list[dict[str, Any]] | None = None  # chat: {"type": "function", "function": {name, parameters, ...}}
    tool_choice: str = "none"  # "none", "auto", "required", or the name of the one function to call
    parallel_tool_calls: bool = True
    echo: bool = False  # completions: the prompt's text (and its logprobs, with logprobs) before the completion
    tokens_as_ids: bool = False  # logprobs name every token "token_id:N"

    @property
    def num_choices(self) -> int:
        return self.n * (len(self.prompts) if self.prompts is not None else 1)


def parse_completion(data: Any) -> GenerationRequest:
    body = _validate(_CompletionBody, data)
    if body.best_of not in (None, 1) and body.best_of != body.n:
        raise _unsupported("best_of", "best_of must equal n (every sampled choice is returned)")
    if body.suffix:
        raise _unsupported("suffix")
    logprobs = body.logprobs
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise bad_request(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (the number of alternatives "
                          "to each token)", "logprobs", "invalid_value")
    prompts = _prompts(body.prompt)
    if len(prompts) * (body.n or 1) > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n={body.n} is more than {MAX_CHOICES} choices in one "
                          "request", "n", "too_many_choices")
    grammar, grammar_param = _grammar(body)
    return _request(body, prompts=prompts, max_tokens=body.max_tokens, logprobs=logprobs, echo=bool(body.echo),
                    grammar=grammar, grammar_param=grammar_param)


def parse_chat(data: Any) -> GenerationRequest:
    body = _validate(_ChatBody, data)
    if body.logprobs is not None and not isinstance(body.logprobs, bool):
        raise bad_request("logprobs must be true or false", "logprobs", "invalid_value")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs", "invalid_value")
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    tools = _tools(body.tools)
    tool_choice = _tool_choice(body.tool_choice, tools)
    grammar, grammar_param = _grammar(body)
    if grammar is not None and tool_choice in ("required",) + tuple(t["function"]["name"] for t in tools or ()):
        raise bad_request("a tool_choice that forces a call already fixes the output's format: drop "
                          "response_format (or the guided_* field)", "tool_choice", "invalid_value")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _request(body, messages=_messages(body.messages), max_tokens=max_tokens, logprobs=logprobs,
                    grammar=grammar, grammar_param=grammar_param, tools=tools, tool_choice=tool_choice,
                    parallel_tool_calls=body.parallel_tool_calls is not False)


@dataclass(frozen=True)
class TokenizeRequest:
    """/tokenize (vLLM's): a text prompt, or a chat rendered through the template, to ids."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    add_special_tokens: bool | None  # None: as the generating endpoints do (bos for a text prompt)
    add_generation_prompt: bool
    return_token_strs: bool


class _TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    tools: Any = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False


class _DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[int]


def parse_tokenize(data: Any) -> TokenizeRequest:
    body = _validate(_TokenizeBody, data)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give either prompt (a text) or messages (a chat)", "prompt", "invalid_value")
    if body.prompt is not None:
        _text(body.prompt, "prompt")
    return TokenizeRequest(body.model, body.prompt, _messages(body.messages) if body.messages is not None else None,
                           _tools(body.tools), body.add_special_tokens, body.add_generation_prompt is not False,
                           bool(body.return_token_strs))


def parse_detokenize(data: Any) -> tuple[str | None, list[int]]:
    """/detokenize (vLLM's): the model and the token ids to turn into text."""
    body = _validate(_DetokenizeBody, data)
    return body.model, body.tokens


# Fields of the other endpoint: a client that sends one here expects its effect.
CHAT_ONLY = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs",
                       "max_completion_tokens"})
COMPLETIONS_ONLY = frozenset({"prompt", "echo", "suffix", "best_of"})


def _validate(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    try:
        body = model.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param, "invalid_value") from None
    extra = sorted(body.model_extra or ())
    elsewhere = {_CompletionBody: CHAT_ONLY, _ChatBody: COMPLETIONS_ONLY}.get(model, frozenset())
    refused = [name for name in extra if name in REFUSED_EXTENSIONS or name in elsewhere]
    if refused:
        raise _unsupported(refused[0])
    unknown = [name for name in extra if name not in NO_EFFECT_FIELDS]
    if unknown:
        log.info("ignoring unknown request fields: %s", ", ".join(unknown))
    return body


def _unsupported(param: str, message: str | None = None) -> ApiError:
    if message is None:
        where = ("on /v1/completions" if param in CHAT_ONLY else "on /v1/chat/completions"
                 if param in COMPLETIONS_ONLY else "by this server")
        message = f"{param} is not supported {where}"
    return bad_request(message, param, "unsupported_parameter")


def _request(body: _Common, *, max_tokens: int | None, prompts=None, messages=None, logprobs: int | None = None,
             echo: bool = False, **chat: Any) -> GenerationRequest:
    options = body.stream_options
    if options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options", "invalid_value")
    return GenerationRequest(
        model=body.model,
        prompts=prompts,
        messages=messages,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=_stop(body.stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        stream=bool(body.stream),
        include_usage=bool(options and options.include_usage),
        session_id=body.session_id,
        ignore_eos=bool(body.ignore_eos),
        n=body.n or 1,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        min_tokens=body.min_tokens or 0,
        logprobs=logprobs,
        echo=echo,
        tokens_as_ids=bool(body.return_tokens_as_token_ids),
        **chat,
    )


def _grammar(body: _Common) -> tuple[GrammarSpec | None, str | None]:
    """The output's required form and the field that gave it: response_format or one guided_* extension."""
    given = [name for name in ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
             if getattr(body, name) is not None and getattr(body, name) != {"type": "text"}]
    if len(given) > 1:
        raise bad_request(f"give at most one of {', '.join(given)}", given[1], "invalid_value")
    if not given:
        return None, None
    name, value = given[0], getattr(body, given[0])
    try:
        if name == "guided_json":
            return GrammarSpec("json_schema", schema_text(value, name)), name
        if name == "guided_regex":
            return GrammarSpec("regex", value), name
        if name == "guided_grammar":
            return GrammarSpec("ebnf", value), name
        if name == "guided_choice":
            if not value or not all(value):
                raise Pt2ServeError("guided_choice must be a non-empty list of non-empty strings")
            return GrammarSpec("ebnf", "root ::= " + " | ".join(json.dumps(choice) for choice in value)), name
        return _response_format(value), name
    except Pt2ServeError as err:
        raise bad_request(str(err), name, "invalid_value") from None


def _response_format(value: Any) -> GrammarSpec:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return GrammarSpec("json")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise Pt2ServeError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
        return GrammarSpec("json_schema", schema_text(spec["schema"], "response_format.json_schema.schema"))
    raise Pt2ServeError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of at most {MAX_TOOLS} functions", "tools", "invalid_value")
    tools = []
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad_request(f"tools.{i} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with a "
                              "name of letters, digits, _ and - (at most 64)", f"tools.{i}", "invalid_value")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"tools.{i}.function.parameters must be a JSON schema object",
                              f"tools.{i}.function.parameters", "invalid_value")
        entry = {"name": name, "parameters": parameters}
        if isinstance(function.get("description"), str):
            entry["description"] = function["description"]
        tools.append({"type": "function", "function": entry})
    if len({t["function"]["name"] for t in tools}) != len(tools):
        raise bad_request("tools must have distinct names", "tools", "invalid_value")
    return tools or None


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str:
    """"none", "auto", "required" or a function's name (OpenAI's default: auto with tools, else none)."""
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        name = value
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
    else:
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                          '{"name": ...}}', "tool_choice", "invalid_value")
    if name != "none" and not tools:
        raise bad_request("tool_choice needs tools", "tool_choice", "invalid_value")
    if name not in ("none", "auto", "required") and name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice",
                          "invalid_value")
    return name


def _logit_bias(value: dict[str, Any] | None) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} as (id, bias) pairs; ids are checked against the vocabulary later."""
    if not value:
        return ()
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}",
                          "logit_bias", "invalid_value")
    pairs = []
    for key, bias in value.items():
        if not key.lstrip("-").isdigit():
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias", "invalid_value")
        is_number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not is_number or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got "
                              f"{bias!r} for token {key}", "logit_bias", "invalid_value")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _prompts(value: Any) -> list[str | list[int]]:
    """One prompt (a text or a list of token ids) or a list of them."""
    if value is None:
        raise bad_request("prompt: Field required", "prompt", "missing_parameter")
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request are supported, got {len(value)}",
                              "prompt", "too_many_prompts")
        return [_prompt(v, f"prompt.{i}") for i, v in enumerate(value)]
    return [_prompt(value, "prompt")]


def _prompt(value: Any, where: str) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise bad_request(f"{where} must not be empty", where, "empty_prompt")
        return _text(value, where)
    if isinstance(value, list):
        if not value:
            raise bad_request(f"{where} must not be empty", where, "empty_prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise bad_request(f"{where} must be a string or a list of integer token ids", where, "invalid_value")
        return list(value)
    raise bad_request(f"{where} must be a string or a list of integer token ids", where, "invalid_value")


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise bad_request("messages: Field required", "messages", "missing_parameter")
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages",
                          "invalid_value")
    messages = []
    for i, message in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with role and content", where, "invalid_value")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                              f"{where}.role", "invalid_value")
        out = {"role": role, "content": _content(message.get("content"), f"{where}.content")}
        if role == "assistant" and message.get("tool_calls") is not None:
            out["tool_calls"] = _history_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.tool_call_id must be the id of the call this answers", 
                                  f"{where}.tool_call_id", "invalid_value")
            out["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        messages.append(out)
    return messages


def _history_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, arguments as objects (chat templates write them as JSON)."""
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a list of tool calls", where, "invalid_value")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise bad_request(f"{where}.{i} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\": a JSON object}}}}", f"{where}.{i}", "invalid_value")
        calls.append({"id": str(call.get("id", "")), "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return calls


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
                raise bad_request(f"{where}: only text content parts are supported", where, "unsupported_content")
            texts.append(part["text"])
        return _text("".join(texts), where)
    raise bad_request(f"{where} must be a string or a list of text parts", where, "invalid_value")


def _text(value: str, where: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer takes: refuse them here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{where} is not valid Unicode (it has a lone surrogate)", where, "invalid_unicode") from None
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop", "invalid_value")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stops)}", "stop",
                          "invalid_value")
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", "stop", "invalid_value")
    return tuple(stops)
