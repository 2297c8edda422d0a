"""HTTP plumbing: bounded JSON bodies, server-sent-event responses, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pt2serve.serve.config import ServerConfig
from pt2serve.serve.errors import ApiError, bad_request


async def read_json(request: Request, config: ServerConfig) -> Any:
    """The body parsed as JSON; 413 past max_body_bytes (checked before and while reading), 400 if not JSON,
    408 if it has not all arrived within body_timeout_s: a client that sends headers and never its body would
    hold a request slot (counted against --max-connections) for ever."""
    try:
        raw = await asyncio.wait_for(_read_body(request, config.max_body_bytes), config.body_timeout_s)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {config.body_timeout_s:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {err}", code="invalid_json") from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("the Content-Length header is not a number") from None
        if size > limit:
            raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the server's limit of {limit} bytes",
                    code="request_too_large")


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected (call after the request body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStream(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends: done, failed or disconnected.

    Starlette stops the body when the client disconnects; `on_close` then cancels the request, so its
    cells are freed without waiting for it to run to its end.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

