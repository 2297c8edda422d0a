"""Graceful shutdown: on SIGTERM or SIGINT stop admitting, let running requests finish, then exit 0.

    1st signal   draining: new requests get 503 with Retry-After and /health says "draining", while
                 running requests go on for up to drain_timeout_s
    all done     (or the timeout, or a 2nd signal) requests still running are cancelled: a stream ends
                 with an error event and [DONE], a waiting client gets a 503; then uvicorn closes the
                 connections and the process exits 0
"""

from __future__ import annotations

import asyncio
import socket
import time
from types import FrameType

import uvicorn

from pt2serve.serve.state import ServerState

POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cut_now: asyncio.Event | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._cut_now = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Begin draining (a 2nd call: end it now). Callable from any thread, and as a signal handler.

        Unlike uvicorn's own, it does not record the signal: uvicorn raises recorded signals again once
        it has stopped, and the process would then die of one instead of exiting 0.
        """
        if self._loop is None:  # not serving yet
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_or_cut)

    def _begin_or_cut(self) -> None:
        # On the event loop: a request handler checks `draining` and submits with no await in between,
        # so every request is either admitted before this line (and drained) or refused after it.
        if self._drain is not None:
            self._cut_now.set()
            return
        self._state.draining = True
        self._drain = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        runner = self._state.runner
        timeout = self._state.config.drain_timeout_s
        if runner is not None and runner.num_active:
            print(f"shutting down: waiting up to {timeout:g} s for the requests still running "
                  f"({runner.num_active})", flush=True)
        deadline = time.monotonic() + timeout
        while runner is not None and runner.num_active and time.monotonic() < deadline and not self._cut_now.is_set():
            try:
                await asyncio.wait_for(self._cut_now.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass
        if runner is not None and runner.num_active:
            # Closing the runner cancels what still runs; each request's handler then answers its client.
            await asyncio.to_thread(runner.close)
        self.should_exit = True
