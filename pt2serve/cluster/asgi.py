"""Answer an HttpCall with an ASGI app in this process, as uvicorn would have: the server's own app, its
routes, errors, streaming and metrics unchanged.

    call_app(app, call)  ->  ResponseStart (status, headers, first body bytes), then each later body chunk

The body is handed over in one message; after it, receive() waits for the end of the call and then says
the client disconnected, so a caller that stops reading (the client went away) cancels the request in the
engine exactly as a dropped connection does.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from starlette.types import ASGIApp, Message

from pt2serve.cluster.calls import HttpCall, ResponseStart

CLOSE_WAIT_S = 5.0  # how long the app may take to wind down once its caller has gone


async def call_app(app: ASGIApp, call: HttpCall) -> AsyncIterator[ResponseStart | bytes]:
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
        "query_string": call.query, "root_path": "", "headers": list(call.headers), "client": call.client,
        "server": ("127.0.0.1", 80), "state": {},
    }
    sent: asyncio.Queue[Message | None] = asyncio.Queue()  # None: the app returned
    ended = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await ended.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.put_nowait(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    start: Message | None = None
    first_sent = False
    try:
        while True:
            message = await sent.get()
            if message is None:
                task.result()  # the app failed before finishing its response: raise what it raised
                raise RuntimeError(f"the app returned without completing its response to {call.method} {call.path}")
            if message["type"] == "http.response.start":
                start = message
                continue
            if message["type"] != "http.response.body" or start is None:
                continue
            chunk, more = message.get("body", b""), message.get("more_body", False)
            if not first_sent:
                first_sent = True
                yield ResponseStart(start["status"], tuple(start.get("headers", ())), chunk)
            elif chunk:
                yield chunk
            if not more:
                return
    finally:
        ended.set()  # done, or the caller left: either way the app sees a disconnect and winds down
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), CLOSE_WAIT_S)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception:
                pass  # it failed while winding down: nobody is listening any more
