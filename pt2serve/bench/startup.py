"""--mode startup: how long `pt2serve serve-artifact` takes from launch to its first 200 from /health, and where
the time goes.

Each of --runs launches starts the server on 127.0.0.1 at a free port (the flags given to bench that the server
shares pass on to it), polls /health every 0.1 s until it answers 200, then stops it with SIGINT. The first
launch may read the file from disk, later ones from the page cache. Per launch: the seconds from launch to
the 200 as seen from outside, and the server's own load line (runtime/engine.py's describe_load, printed by
serve/loader.py): its launch-to-ready time and the load's parts (weights, methods beside them, binding,
KV pool, graph capture).
"""

from __future__ import annotations

import dataclasses
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pt2serve.bench.progress import Progress
from pt2serve.errors import Pt2ServeError

DEFAULT_RUNS = 2
POLL_SECONDS = 0.1
STOP_TIMEOUT_S = 60.0

# The server's load line, e.g. "loaded in 9.1 s on cuda:0 (weights 3.30 s at 4.9 GB/s, methods 4.10 s beside
# them, binding 0.40 s, KV pool 0.20 s, graph capture 1.20 s): weights ...; ready 21.0 s after launch".
LOAD_LINE = re.compile(
    r"loaded in (?P<total>\S+) s on \S+ \(weights (?P<weights>\S+) s at (?P<rate>\S+ [GM]B/s), methods "
    r"(?P<methods>\S+) s beside them, binding (?P<binding>\S+) s, KV pool (?P<pool>\S+) s, graph capture "
    r"(?P<capture>\S+) s\).*?(?:; ready (?P<ready>\S+) s after launch)?$"
)


@dataclass
class StartupRun:
    run: int
    ready_seconds: float | None = None  # launch to the first 200 from /health, seen from outside
    server_ready_seconds: float | None = None  # the server's own "ready N s after launch"
    load_seconds: float | None = None  # the load line's total
    parts: dict[str, float] = field(default_factory=dict)  # weights, methods, binding, KV pool, graph capture
    weights_rate: str | None = None  # e.g. "4.9 GB/s"
    load_line: str | None = None
    exit_code: int | None = None  # after SIGINT
    flags: list[str] = field(default_factory=list)


@dataclass
class StartupResult:
    runs: list[StartupRun]
    command: list[str]  # the server's command line, its port left out


def parse_load_line(text: str) -> dict[str, Any] | None:
    """The load line's numbers, from a server's output; None when it printed none."""
    for line in text.splitlines():
        found = LOAD_LINE.search(line)
        if found:
            numbers = found.groupdict()
            return {"line": line.strip(), "total": float(numbers["total"]), "rate": numbers["rate"],
                    "ready": float(numbers["ready"]) if numbers["ready"] else None,
                    "parts": {"weights": float(numbers["weights"]), "methods": float(numbers["methods"]),
                              "binding": float(numbers["binding"]), "KV pool": float(numbers["pool"]),
                              "graph capture": float(numbers["capture"])}}
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_startup(path: str | Path, server_args: list[str], runs: int = DEFAULT_RUNS, timeout: float = 600.0,
                progress: Progress | None = None) -> StartupResult:
    """Launch the server on `path` `runs` times, each until ready or `timeout` seconds (see the docstring)."""
    if runs < 1:
        raise Pt2ServeError(f"--runs must be at least 1, got {runs}")
    command = [sys.executable, "-m", "pt2serve.cli", "serve-artifact", str(path), "--host", "127.0.0.1", *server_args]
    results = []
    for number in range(1, runs + 1):
        _say(progress, f"launch {number}/{runs}")
        results.append(_launch(command, number, timeout, progress))
    return StartupResult(results, command)


def _launch(command: list[str], number: int, timeout: float, progress: Progress | None) -> StartupRun:
    run = StartupRun(number)
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    with tempfile.TemporaryFile("w+") as log:
        launched = time.perf_counter()
        server = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        exited = False  # before it was ready
        try:
            while time.perf_counter() - launched < timeout:
                if _healthy(url):
                    run.ready_seconds = time.perf_counter() - launched
                    break
                if server.poll() is not None:
                    exited = True
                    break
                _say(progress, f"launch {number}: {time.perf_counter() - launched:.0f} s, not ready yet")
                time.sleep(POLL_SECONDS)
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGINT)
                try:
                    server.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
                    run.flags.append(f"still running {STOP_TIMEOUT_S:.0f} s after SIGINT: killed")
        run.exit_code = server.returncode
        log.seek(0)
        output = log.read()
    if run.ready_seconds is None:
        tail = " | ".join(output.strip().splitlines()[-3:])
        if exited:
            raise Pt2ServeError(f"the server exited with code {server.returncode} before it was ready: {tail}")
        run.flags.append(f"not ready within {timeout:.0f} s")
    load = parse_load_line(output)
    if load is None:
        run.flags.append("the server printed no load line")
    else:
        run.load_line, run.load_seconds, run.parts = load["line"], load["total"], load["parts"]
        run.weights_rate, run.server_ready_seconds = load["rate"], load["ready"]
    return run


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return answer.status == 200
    except OSError:  # not listening yet, or 503 while loading (HTTPError is an OSError)
        return False


def startup_table(result: StartupResult, title: str):
    from rich.table import Table

    table = Table(title=title, caption="launch to 200: from starting the process to the first 200 from /health; "
                  "the rest from the server's load line (methods load beside the weights)")
    columns = ("run", "launch to 200 s", "server: ready after launch s", "load s", "weights s", "weights rate",
               "methods s", "binding s", "KV pool s", "graph capture s", "flags")
    for name in columns:
        table.add_column(name, justify="left" if name in ("weights rate", "flags") else "right")
    for run in result.runs:
        parts = [_s(run.parts.get(name)) for name in ("weights", "methods", "binding", "KV pool", "graph capture")]
        table.add_row(str(run.run), _s(run.ready_seconds), _s(run.server_ready_seconds), _s(run.load_seconds),
                      parts[0], run.weights_rate or "-", *parts[1:], "; ".join(run.flags) or "ok",
                      style="red" if run.flags else None)
    return table


def startup_document(result: StartupResult, artifact: str, raw: dict[str, Any], flags: dict[str, Any]) -> dict:
    from pt2serve.bench.report import document_header

    return {**document_header("startup", artifact, raw, None, flags), "command": result.command,
            "runs": [dataclasses.asdict(run) for run in result.runs]}


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def _say(progress: Progress | None, text: str) -> None:
    if progress is not None:
        progress(text)
