"""Tool calls: which format a chat template asks the model to call tools in, and reading calls back out of
the model's text, whole or as it streams.

Two families cover the supported models:
    hermes       (Qwen 2.5 / Qwen 3, Hermes):  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
                 any number of them, after optional text
    llama3_json  (Llama 3.1 / 3.2 / 3.3):      {"name": ..., "parameters": {...}}  as the whole reply
                 (several separated by ';'), after an optional <|python_tag|>

Text that does not parse as calls of the request's tools is the reply's content, as it is.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), re.DOTALL)


def template_format(chat_template: str | None) -> str | None:
    """The tool-call family a chat template writes tools for, or None when it takes no tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if HERMES_OPEN in chat_template:
        return HERMES
    if '"parameters"' in chat_template or PYTHON_TAG in chat_template:
        return LLAMA3_JSON
    return None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def body(self, index: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


def new_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


def parse(family: str, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply; without calls, the content is the whole text."""
    if family == HERMES:
        start = text.find(HERMES_OPEN)
        calls = [_call(match, "arguments", names) for match in _HERMES_CALL.findall(text)]
        if start < 0 or not calls or None in calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = [_call(part, "parameters", names) for part in _split_objects(body)]
    if not calls or None in calls:
        return text, []
    return None, calls


def _call(text: str, arguments_key: str, names: set[str]) -> ToolCall | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get(arguments_key, data.get("arguments", data.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return new_call(data["name"], arguments)


def _split_objects(body: str) -> list[str]:
    """Top-level JSON objects separated by ';' (a ';' inside a string does not split)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except ValueError:
            return [body]  # not a sequence of objects: let the caller see it fail as one
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    return parts


class ToolCallStream:
    """A streamed reply: its text flows out until a tool call may begin, then is held for parsing at the end.
    With family None (a forced call) all of it is held."""

    def __init__(self, family: str | None) -> None:
        self._family = family
        self._text = ""  # everything so far
        self._sent = 0  # characters already let out
        self._holding = family is None

    def feed(self, delta: str) -> str:
        """The part of the text so far that is surely content."""
        self._text += delta
        if self._holding:
            return ""
        if self._family == HERMES:
            start = self._text.find(HERMES_OPEN, self._sent)
            if start >= 0:
                self._holding = True
                return self._release(start)
            return self._release(len(self._text) - _partial_suffix(self._text, HERMES_OPEN))
        stripped = self._text.lstrip()
        if not stripped:
            return ""
        if stripped.startswith("{") or PYTHON_TAG.startswith(stripped[: len(PYTHON_TAG)]):
            self._holding = True  # a Llama reply that starts as JSON is a call (decided at the end)
            return ""
        return self._release(len(self._text))

    def finish(self, use: "ToolUse") -> tuple[str, list[ToolCall]]:
        """What is left to send as content, and the calls, once the reply is complete."""
        content, calls = use.parse(self._text)
        if not calls:
            return self._text[self._sent:], []
        end = self._text.find(HERMES_OPEN) if self._family == HERMES else 0  # where the calls begin
        return self._text[self._sent:max(end, self._sent)].rstrip(), calls

    def _release(self, end: int) -> str:
        text = self._text[self._sent:end]
        self._sent = max(self._sent, end)
        return text


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and how the reply may use them (tool_choice auto, required, or one function)."""

    family: str
    tools: list[dict[str, Any]]
    choice: str  # "auto", "required" or a function's name
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools}

    def grammar_schema(self) -> str | None:
        """The JSON schema a forced call must follow: the named function's arguments, or for "required" an
        array of {"name", "parameters"} (at most one without parallel calls); None for "auto"."""
        if self.choice == "auto":
            return None
        by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in self.tools}
        if self.choice != "required":
            return json.dumps(by_name[self.choice])
        one = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                          "required": ["name", "parameters"], "additionalProperties": False}
                         for name, parameters in by_name.items()]}
        array = {"type": "array", "items": one, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return json.dumps(array)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished reply."""
        if self.choice == "auto":
            content, calls = parse(self.family, text, self.names)
        elif self.choice == "required":
            try:
                items = json.loads(text)
                calls = [new_call(item["name"], item["parameters"]) for item in items]
                content = None
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens: no complete call
                content, calls = text, []
        else:
            try:
                json.loads(text)
                content, calls = None, [new_call(self.choice, text)]
            except ValueError:
                content, calls = text, []
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self.family if self.choice == "auto" else None)
