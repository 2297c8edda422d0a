#!/usr/bin/env python3
"""Where a serving process spends its CPU: the event loop's thread against the rest, per streamed token.

    python scripts/server_cpu.py ARTIFACT [--requests 32 --prompt-tokens 64 --max-new-tokens 64] [--profile F]

Starts `serve-artifact ARTIFACT` on 127.0.0.1, runs `bench --url` against it (a warm-up load, then the measured
one), and reads each of the server's threads' CPU time from /proc before and after the measured load; then the
loop's CPU per request for as many requests of one token each (taking a request in and answering it). uvicorn
runs the event loop on the main thread (its id is the process id); the engine thread and torch's compute
threads are the rest. Both hold the GIL for their Python work, so the loop's CPU per token, times the tokens a
second the engine makes, is the share of one core the engine loses to serving over HTTP (once the two add up
to a core, the interpreter is the ceiling). --profile F writes the loop thread's cProfile there (the profiler
slows what it sees: read it for where the time goes, not how much).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
READY_LIMIT_S = 600


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """user + system CPU seconds of each thread of `pid`, by thread id."""
    seconds = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended between the listing and the read
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15)
    return seconds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen) -> None:
    for _ in range(READY_LIMIT_S * 10):
        if server.poll() is not None:
            sys.exit(f"the server exited while loading (code {server.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    sys.exit(f"the server was not ready after {READY_LIMIT_S} s")


def bench(url: str, args: argparse.Namespace, json_path: str, seed: int, max_new_tokens: int | None = None) -> dict:
    command = [sys.executable, "-m", "pt2serve.cli", "bench", "--mode", "requests", "--url", url,
               "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
               "--max-new-tokens", str(max_new_tokens or args.max_new_tokens), "--seed", str(seed),
               "--json", json_path]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(json_path).read_text())["summary"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--profile", help="write the event loop thread's cProfile to this file")
    parser.add_argument("--engine-process", action="store_true",
                        help="serve with --engine-process (the engine's own CPU is then not in the table)")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ["-m", "pt2serve.cli", "serve-artifact", args.artifact, "--host", "127.0.0.1", "--port", str(port)]
    if args.engine_process:
        serve.append("--engine-process")
    if args.profile:
        serve = ["-m", "cProfile", "-o", args.profile, *serve]
    server = subprocess.Popen([sys.executable, *serve], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, server)
        with tempfile.TemporaryDirectory() as tmp:
            # The first requests warm the pools, caches and connections; on other prompts, so that the measured
            # load finds none of its own in the prefix cache.
            bench(url, args, f"{tmp}/warm.json", seed=1)
            before = thread_cpu_seconds(server.pid)
            summary = bench(url, args, f"{tmp}/load.json", seed=0)
            after = thread_cpu_seconds(server.pid)
            # Then the same number of requests for one token each: the loop's cost of taking a request in
            # (reading, parsing, checking, submitting) and answering it, with next to no streaming.
            bench(url, args, f"{tmp}/intake.json", seed=3, max_new_tokens=1)
            after_intake = thread_cpu_seconds(server.pid)
    finally:
        server.send_signal(signal.SIGINT)  # a clean exit, so cProfile writes its file
        server.wait(timeout=120)

    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    loop = spent.pop(server.pid, 0.0)
    busiest = max(spent.values(), default=0.0)
    tokens = summary["output_tokens"]
    rate = summary["output_tokens_per_second"]
    print(f"{args.requests} x {args.prompt_tokens} -> {args.max_new_tokens} through HTTP: {tokens} tokens, "
          f"{rate:,.0f} output tok/s, {summary['prompt_tokens_reused']:,} of {summary['prompt_tokens']:,} prompt "
          "tokens from the prefix cache")
    print("| thread | CPU s | CPU us per output token |")
    print("| --- | --- | --- |")
    print(f"| event loop (main) | {loop:.2f} | {1e6 * loop / tokens:.0f} |")
    busiest_is = "the event reader" if args.engine_process else "the engine"
    print(f"| busiest other ({busiest_is}) | {busiest:.2f} | {1e6 * busiest / tokens:.0f} |")
    print(f"| all others ({len(spent)}) | {sum(spent.values()):.2f} | {1e6 * sum(spent.values()) / tokens:.0f} |")
    intake = after_intake.get(server.pid, 0.0) - after.get(server.pid, 0.0)
    print(f"{args.requests} requests of one token each: the event loop's CPU {1e6 * intake / args.requests:.0f} us "
          "per request")


if __name__ == "__main__":
    main()
