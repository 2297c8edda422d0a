#!/usr/bin/env python3
"""Where a serving process spends its CPU: the event loop's thread against the rest, per streamed token.

    python scripts/server_cpu.py ARTIFACT [--requests 32 --prompt-tokens 64 --max-new-tokens 64] [--profile F]

Starts `serve-artifact ARTIFACT` on 127.0.0.1, runs `bench --url` against it (a warm-up load, then the measured
one), and reads each of the server's threads' CPU time from /proc before and after the measured load; then the
loop's CPU per request over bursts of as many requests for one token each (taking a request in and answering it). uvicorn
runs the event loop on the main thread (its id is the process id); the engine thread and torch's compute
threads are the rest. Both hold the GIL for their Python work, so the loop's CPU per token, times the tokens a
second the engine makes, is the share of one core the engine loses to serving over HTTP (once the two add up
to a core, the interpreter is the ceiling). --profile F writes the loop thread's cProfile there (the profiler
slows what it sees: read it for where the time goes, not how much).
"""

from __future__ import annotations

import argparse
import asyncio
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
INTAKE_BURSTS = 8


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


def bench(url: str, args: argparse.Namespace, json_path: str, seed: int) -> dict:
    command = [sys.executable, "-m", "pt2serve.cli", "bench", "--mode", "requests", "--url", url,
               "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
               "--max-new-tokens", str(args.max_new_tokens), "--seed", str(seed), "--json", json_path]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(json_path).read_text())["summary"]


async def intake_cpu(url: str, pid: int, burst: int, prompt_tokens: int) -> float:
    """The event loop's CPU seconds per request of INTAKE_BURSTS bursts of `burst` requests sent at once, each
    for one token and not streamed: what taking a request in (reading, parsing, checking, submitting) and
    answering it costs the loop, with next to nothing streamed. Each prompt is new to the prefix cache."""
    import httpx  # the server's dependency; imported here so that the rest of the script runs without it

    shared = [10 + i % 200 for i in range(prompt_tokens - 2)]  # token ids every vocabulary has

    limits = httpx.Limits(max_connections=burst, max_keepalive_connections=burst)
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]

        def body(n: int) -> dict:  # the first two tokens make each prompt its own (n < 40,000)
            return {"model": model, "prompt": [10 + n % 200, 10 + n // 200, *shared], "max_tokens": 1,
                    "temperature": 0}

        async def send(n: int) -> None:
            (await client.post(f"{url}/v1/completions", json=body(n))).raise_for_status()

        await asyncio.gather(*(send(n) for n in range(burst)))  # opens the connections
        before = thread_cpu_seconds(pid)[pid]
        for b in range(1, INTAKE_BURSTS + 1):
            await asyncio.gather(*(send(b * burst + n) for n in range(burst)))
        return (thread_cpu_seconds(pid)[pid] - before) / (INTAKE_BURSTS * burst)


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
        loop_per_request = asyncio.run(intake_cpu(url, server.pid, args.requests, args.prompt_tokens))
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
    print(f"{INTAKE_BURSTS} bursts of {args.requests} requests for one token each, not streamed: the event loop's "
          f"CPU {1e6 * loop_per_request:.0f} us per request")


if __name__ == "__main__":
    main()
