"""Load the model on a background thread while uvicorn already answers /health with 503."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import Callable

import uvicorn
from fastapi import FastAPI

from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.runner import Runner
from pt2serve.serve.app import attach_runner

log = logging.getLogger("pt2serve.serve")


class BackgroundLoader:
    def __init__(self, app: FastAPI, server: uvicorn.Server, load: Callable[[], Runner],
                 ready_message: Callable[[str], str], describe: Callable[[Runner], str] | None = None) -> None:
        self._app = app
        self._server = server
        self._load = load
        self._ready_message = ready_message
        self._describe = describe
        self.error: str | None = None  # why loading failed (the server is then stopped)
        self._thread = threading.Thread(target=self._run, name="pt2serve-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            runner = self._load()
        except Pt2ServeError as err:
            self._stop(str(err))
            return
        except Exception as err:  # anything else that stops loading: report it, stop the server
            log.debug("loading failed", exc_info=err)
            self._stop(f"loading the artifact failed: {type(err).__name__}: {err}")
            return
        if self._server.should_exit:  # stopped while loading
            runner.close()
            return
        attach_runner(self._app, runner, owns_runner=True)
        # What is loaded now (torch, the model) lives as long as the process: keep it out of the cyclic
        # collector's full scans, which would otherwise stall requests (and exit) for a noticeable time.
        gc.collect()
        gc.freeze()
        while not self._server.started and not self._server.should_exit:
            time.sleep(0.02)
        if self._server.started:
            if self._describe is not None:
                since_launch = seconds_since_launch()  # imports and the server's start, then the load above
                launch = f"; ready {since_launch:.1f} s after launch" if since_launch is not None else ""
                print(self._describe(runner) + launch, flush=True)
            print(self._ready_message(self._url()), flush=True)

    def _stop(self, message: str) -> None:
        self.error = message
        self._server.should_exit = True

    def _url(self) -> str:
        host, port = self._server.config.host, self._server.config.port
        for listener in getattr(self._server, "servers", []):
            for sock in listener.sockets:
                port = sock.getsockname()[1]  # the real port when asked for port 0
                break
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}"


def seconds_since_launch() -> float | None:
    """How long this process has run (Linux: from /proc), so imports and server start count too; else None."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            # The process's start time, in clock ticks after boot: field 22, counted after the ")" that ends
            # the command name (which may itself hold spaces).
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return float(uptime.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
