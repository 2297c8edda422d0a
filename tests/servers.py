"""Servers for tests, on 127.0.0.1 only: uvicorn in a thread of the test process (ServerThread), or the
`pt2serve serve-artifact` command in a child process (ServeProcess)."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pt2serve.serve.connections import uvicorn_config
from pt2serve.serve.shutdown import DrainingServer

TOY_MODEL = "toy"  # the name the toy_server fixture serves toy-greedy under


class ServerThread:
    """uvicorn serving `app` from a background thread, on a free port of 127.0.0.1."""

    def __init__(self, app) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=2)
        self._server = DrainingServer(config, app.state.pt2serve)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def drain(self) -> None:
        """What SIGTERM does to the served command (signals reach only the main thread)."""
        self._server.handle_exit(signal.SIGTERM, None)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self._socket.close()
        assert not self._thread.is_alive(), "uvicorn did not stop"


class ServeProcess:
    """`pt2serve serve-artifact ARTIFACT --port 0 ARGS...`, started and read until its ready line."""

    def __init__(self, artifact: Path, *args: str, load_timeout_s: float = 120) -> None:
        command = [sys.executable, "-m", "pt2serve.cli", "serve-artifact", str(artifact), "--port", "0", *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.load_line = self.next_line(load_timeout_s)  # once loaded: what it cost, then where it listens
        self.ready_line = self.next_line(30)
        # "serving NAME at http://127.0.0.1:PORT/v1 (ready)"
        self.url = self.ready_line.split(" at ")[1].split()[0].removesuffix("/v1")

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self.stdout.append(line)
            self._lines.put(line)

    def next_line(self, timeout_s: float) -> str:
        try:
            return self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.process.kill()
            raise AssertionError(f"no output from the server within {timeout_s} s; stderr: "
                                 f"{self.process.communicate()[1][-2000:]}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> tuple[int, str]:
        """Send `sig`, wait for the exit; returns (exit code, stderr)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            _, stderr = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, stderr = self.process.communicate()
            raise AssertionError(f"the server did not exit within {timeout_s} s of signal {sig}; stderr: "
                                 f"{stderr[-2000:]}") from None
        return self.process.returncode, stderr
