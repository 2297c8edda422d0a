"""What crosses between the gateway and a replica: the HTTP request as it came (HttpCall, with its route
key) and, back, the response's start with its first bytes (ResponseStart), then the rest of its bytes.

The replica answers with its own app, unchanged, so a call is the request's method, path, query, headers and
body; the gateway only adds the route key, read from the same body with the same parsers the server uses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pt2serve.errors import Pt2ServeError
from pt2serve.cluster.routing import RouteKey
from pt2serve.serve.completions import SESSION_HEADER
from pt2serve.serve.errors import ApiError
from pt2serve.serve.schemas import parse_chat, parse_completion
from pt2serve.tokenizer import Tokenizer

GENERATING_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> is chat


@dataclass(frozen=True)
class HttpCall:
    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # as the ASGI scope lists them (lower-case names)
    body: bytes
    client: tuple[str, int] | None = None
    route: RouteKey | None = None


@dataclass(frozen=True)
class ResponseStart:
    """The response's status and headers, sent with its first body bytes: until a replica has written a byte
    the call may still be retried on another, and nothing reached the client yet."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    @property
    def is_event_stream(self) -> bool:
        return any(name == b"content-type" and value.startswith(b"text/event-stream") for name, value in self.headers)


def route_key(path: str, headers: dict[str, str], body: bytes, tokenizer: Tokenizer | None) -> RouteKey | None:
    """The route key of a generating request (its prompt's token ids, as the server will encode them, and its
    session); None for other paths. A body the server will refuse gets a key without a prompt."""
    chat = GENERATING_PATHS.get(path)
    if chat is None:
        return None
    session_id = headers.get(SESSION_HEADER) or None
    try:
        data = json.loads(body)
        req = parse_chat(data) if chat else parse_completion(data)
    except (ValueError, RecursionError, ApiError):
        return RouteKey(session_id=session_id)
    session_id = req.session_id or session_id
    try:
        return RouteKey.of(_prompt_ids(req, tokenizer), session_id)
    except Pt2ServeError:
        return RouteKey(session_id=session_id)


def _prompt_ids(req, tokenizer: Tokenizer | None) -> list[int] | None:
    """The first prompt's token ids (what the replica's prefix cache will hold), or None if it cannot tell."""
    if req.messages is not None:
        return tokenizer.encode_chat(req.messages, req.tools) if tokenizer is not None else None
    prompt = req.prompts[0] if req.prompts else None
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if tokenizer is not None else None
    return prompt
