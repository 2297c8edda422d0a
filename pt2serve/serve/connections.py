"""Connections: silent sockets are closed, and no number of them keeps a request (or /health) out.

uvicorn alone holds a connection that never sends a request for ever (its keep-alive timer starts only after
a response), and its limit_concurrency counts such connections: 512 silent sockets from one client made
every request, /health included, a plain-text 503 for as long as they stayed open. Here instead:

    header timeout   a connection must send a whole request's headers within header_timeout_s of opening,
                     or of its first byte after a response (a slow sender cannot hold it either); else it
                     is closed. An idle keep-alive connection is closed after KEEP_ALIVE_S.
    connections      beyond max_connections open, the connection that has waited longest for a request is
                     closed for the new one (never one whose request is in progress);
    requests         beyond max_connections in progress at once, a request gets a 503 with Retry-After, but
                     /health and /metrics, which cost nothing, are always answered.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

try:  # uvicorn's protocol on httptools (a C parser), as its "auto" picks where httptools is installed: it reads
    # a request and writes each streamed chunk with less of the event loop's time than pure-Python h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as HttpProtocol
except ImportError:
    from uvicorn.protocols.http.h11_impl import H11Protocol as HttpProtocol

from pt2serve.serve.errors import ApiError

# Idle keep-alive connections outlive the 5 s after which httpx (and so the openai client) stops reusing them:
# with equal timeouts a client may send on a connection the server is closing, and lose the request.
KEEP_ALIVE_S = 15
ALWAYS_ANSWERED = frozenset({"/health", "/metrics"})


def uvicorn_config(app: FastAPI, **options: Any) -> uvicorn.Config:
    """uvicorn's config for the app, its connections guarded as above (`options`: uvicorn's own)."""
    config = app.state.pt2serve.config
    guarded = type("GuardedProtocol", (_GuardedProtocol,), {"header_timeout_s": config.header_timeout_s,
                                                            "max_connections": config.max_connections})
    # asyncio's loop, even where uvloop is installed (uvicorn's "auto" takes it; ray[serve] brings it): under
    # uvloop the longest-waiting connection was not closed past max_connections.
    return uvicorn.Config(app, http=guarded, loop="asyncio", timeout_keep_alive=KEEP_ALIVE_S, server_header=False,
                          **options)


class _GuardedProtocol(HttpProtocol):
    """uvicorn's HTTP/1.1 protocol with the header timeout and the connection budget."""

    header_timeout_s: float
    max_connections: int

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._waiting_since = self.loop.time()
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()
        if len(self.connections) > self.max_connections:  # (counts those closing too: look closer)
            self._close_the_longest_waiting()

    def data_received(self, data: bytes) -> None:
        if not self._in_request and self._header_timer is None:
            self._arm_header_timer()  # the first byte of a request after a response
        super().data_received(data)
        if self._in_request:
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (may start a pipelined request)
        if not self._in_request:
            self._waiting_since = self.loop.time()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    @property
    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self._in_request:
            self.transport.close()

    def _close_the_longest_waiting(self) -> None:
        """Close the open connection (not this one) that has waited longest for a request, if there are more
        than max_connections open and one waits (a closed transport leaves `connections` only later)."""
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        waiting = [c for c in open_ if c is not self and isinstance(c, _GuardedProtocol) and not c._in_request]
        if len(open_) > self.max_connections and waiting:
            min(waiting, key=lambda c: c._waiting_since).transport.close()


class RequestBudget:
    """ASGI middleware: past `limit` requests in progress, a request gets a 503 with Retry-After, but the
    paths in ALWAYS_ANSWERED; `on_refused(status)` counts each refusal."""

    def __init__(self, app: ASGIApp, limit: int, on_refused) -> None:
        self.app = app
        self._limit = limit
        self._on_refused = on_refused
        self._in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ALWAYS_ANSWERED:
            await self.app(scope, receive, send)
            return
        if self._in_progress >= self._limit:
            self._on_refused(503)
            refusal = ApiError(503, f"the server is answering as many requests as it takes at once "
                               f"({self._limit}); retry shortly", code="too_many_requests")
            await refusal.response()(scope, receive, send)
            return
        self._in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._in_progress -= 1
