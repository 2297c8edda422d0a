#!/usr/bin/env python3
"""What a server saw of a load, from its /metrics read before and after: its own TTFT and TPOT, the engine's steps.

    python3 scripts/device/server_metrics.py snapshot URL FILE     /metrics of the server at URL into FILE
    python3 scripts/device/server_metrics.py delta BEFORE AFTER    one line: the load between the two

The server times a request from its arrival in the handler to its events reaching the event loop; a client's
TTFT and TPOT add the way from there to the client and the client's own reading. Beside `bench --url`'s figures
they tell where a gap to in process is: in the engine (steps), in the server, or past it.
"""

from __future__ import annotations

import sys
import urllib.request


def parse(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def delta(before: dict[str, float], after: dict[str, float]) -> str:
    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    requests = d("pt2serve_time_to_first_token_seconds_count")
    tokens = d("pt2serve_completion_tokens_total")
    steps = d("pt2serve_engine_steps_total")
    ttft = d("pt2serve_time_to_first_token_seconds_sum") / requests * 1000 if requests else float("nan")
    tpot_n = d("pt2serve_time_per_output_token_seconds_count")
    tpot = d("pt2serve_time_per_output_token_seconds_sum") / tpot_n * 1000 if tpot_n else float("nan")
    per_step = f"{tokens / steps:.1f}" if steps else "-"
    return (f"server side: {requests:.0f} requests, mean TTFT {ttft:.0f} ms, mean TPOT {tpot:.2f} ms; "
            f"{steps:.0f} engine steps, {per_step} output tokens a step")


def main() -> None:
    command, first, second = sys.argv[1:4]
    if command == "snapshot":
        with urllib.request.urlopen(f"{first.rstrip('/')}/metrics", timeout=10) as reply:
            open(second, "w").write(reply.read().decode())
    elif command == "delta":
        print(delta(parse(open(first).read()), parse(open(second).read())))
    else:
        sys.exit(f"unknown command {command!r}: snapshot or delta")


if __name__ == "__main__":
    main()
