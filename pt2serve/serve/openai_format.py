"""Response bodies and stream chunks in OpenAI's formats, for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pt2serve.runtime.request import FinishReason

# Only clean endings reach a client as a finish_reason; cancelled and failed requests answer with an error.
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


@dataclass(frozen=True)
class SpeculationUsage:
    """Extension: what speculative decoding did for a response (when the server speculates)."""

    draft_tokens: int  # tokens drafted and verified
    accepted_tokens: int  # of those, accepted
    steps: int  # steps that verified drafts

    def __add__(self, other: SpeculationUsage) -> SpeculationUsage:
        return SpeculationUsage(self.draft_tokens + other.draft_tokens, self.accepted_tokens + other.accepted_tokens,
                                self.steps + other.steps)

    def body(self) -> dict[str, Any]:
        return {
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "steps": self.steps,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            # tokens each verifying step emitted on average: its accepted drafts plus one
            "mean_accepted_length": self.accepted_tokens / self.steps + 1 if self.steps else None,
        }


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV another request computed (not its own, after a preemption)
    speculation: SpeculationUsage | None = None

    def body(self) -> dict[str, Any]:
        body = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.speculation is not None:
            body["speculation"] = self.speculation.body()
        return body


@dataclass
class _Format:
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, object_: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model,
                "choices": choices, **extra}


@dataclass(frozen=True)
class Choice:
    """One finished choice of a non-streamed response."""

    index: int
    text: str | None
    finish_reason: str
    token_ids: list[int] | None = None  # extension: sent when a prompt was token ids
    logprobs: dict[str, Any] | None = None  # in the endpoint's shape (logprob_format.py)
    tool_calls: list[dict[str, Any]] | None = None  # chat: the calls the reply made (then text may be None)


@dataclass
class CompletionFormat(_Format):
    """Legacy completions: `text` in each choice, the same object name for bodies and chunks."""

    def __post_init__(self) -> None:
        self.id = self.id or f"cmpl-{uuid.uuid4().hex}"

    def body(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        bodies = []
        for choice in choices:
            body: dict[str, Any] = {"index": choice.index, "text": choice.text, "logprobs": choice.logprobs,
                                    "finish_reason": choice.finish_reason}
            if choice.token_ids is not None:
                body["token_ids"] = choice.token_ids
            bodies.append(body)
        return self._envelope("text_completion", bodies, usage=usage.body())

    def chunk(self, index: int, text: str, first: bool, with_usage: bool,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        return self._envelope("text_completion", [choice], **_null_usage(with_usage))

    def finish_chunk(self, index: int, finish_reason: str, with_usage: bool) -> dict[str, Any]:
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], **_null_usage(with_usage))

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._envelope("text_completion", [], usage=usage.body())


@dataclass
class ChatFormat(_Format):
    """Chat completions: a `message` in the body, `delta`s in chunks (each choice's first carries the role)."""

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-{uuid.uuid4().hex}"

    def body(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        bodies = []
        for choice in choices:
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            if choice.tool_calls:
                message["tool_calls"] = choice.tool_calls
            bodies.append({"index": choice.index, "message": message, "logprobs": choice.logprobs,
                           "finish_reason": choice.finish_reason})
        return self._envelope("chat.completion", bodies, usage=usage.body())

    def chunk(self, index: int, text: str, first: bool, with_usage: bool,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice], **_null_usage(with_usage))

    def tool_calls_chunk(self, index: int, calls: list[dict[str, Any]], with_usage: bool) -> dict[str, Any]:
        choice = {"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice], **_null_usage(with_usage))

    def finish_chunk(self, index: int, finish_reason: str, with_usage: bool) -> dict[str, Any]:
        choice = {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk", [choice], **_null_usage(with_usage))

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk", [], usage=usage.body())


def _null_usage(with_usage: bool) -> dict[str, Any]:
    # With stream_options.include_usage every chunk carries "usage": null but the last, as OpenAI does.
    return {"usage": None} if with_usage else {}


def model_list(model: str, created: int, max_context: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, max_context)]}


def model_card(model: str, created: int, max_context: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "pt2serve", "max_model_len": max_context}


# Characters JSON leaves raw in strings that line splitters following Python's str.splitlines (httpx's
# aiter_lines, requests' iter_lines) break lines at, cutting an event in two; other line breaks JSON escapes.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event, on one line however its text is split into lines."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text.translate(_LINE_BREAKS_JSON_KEEPS)}\n\n".encode()


SSE_DONE = sse("[DONE]")
SSE_KEEP_ALIVE = b": keep-alive\n\n"  # a comment line: SSE clients skip it
