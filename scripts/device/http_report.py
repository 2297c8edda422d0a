#!/usr/bin/env python3
"""HTTP against in process: the table of `bench --mode requests` runs, and what the server saw of a load.

    python3 scripts/device/http_report.py table IN_PROCESS.json LABEL=RUN.json ...
    python3 scripts/device/http_report.py snapshot URL FILE     /metrics of the server at URL into FILE
    python3 scripts/device/http_report.py delta BEFORE AFTER    one line: the load between two snapshots

table: output tok/s, the ratio to IN_PROCESS, TTFT, TPOT and the client's CPU of each run. A run with
--request-rates is compared rate by rate with an in-process run of the same rates (labelled "in process"; its
rates are matched by their offered rate).

delta: the server times a request from its arrival in the handler to its events reaching the event loop; a
client's TTFT and TPOT add the way from there to the client and the client's own reading. Beside `bench --url`'s
figures they tell where a gap to in process is: in the engine (its steps), in the server, or before or past it.
"""

from __future__ import annotations

import json
import sys
import urllib.request


def runs(path: str) -> dict[float | None, dict]:
    """The summaries of a bench JSON by offered rate (None: all requests at once)."""
    doc = json.load(open(path))
    if "rates" in doc:
        return {entry["offered_rate"]: entry["summary"] for entry in doc["rates"]}
    return {None: doc["summary"]}


def table(base_path: str, labelled: list[str]) -> None:
    bases = [runs(base_path)] + [runs(p.split("=", 1)[1]) for p in labelled if p.startswith("in process=")]
    rows = [("in process", base_path)] + [tuple(p.split("=", 1)) for p in labelled]
    doc = json.load(open(base_path))
    if doc.get("num_steps"):
        print(f"in process: {doc['num_steps']} engine steps, {doc['summary']['output_tokens'] / doc['num_steps']:.1f} "
              f"output tokens a step (mean width {doc['mean_step_width']:.1f} tokens)")
    print("| run | offered req/s | output tok/s | / in process | TTFT p50 ms | vs in process | TPOT p50 ms "
          "| client CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for label, path in rows:
        for rate, summary in runs(path).items():
            base = next((b[rate] for b in bases if rate in b), None)
            tok_s = summary["output_tokens_per_second"]
            ttft = summary["ttft_seconds"]["p50"] * 1000
            ratio = f"{tok_s / base['output_tokens_per_second']:.3f}" if base else "-"
            ttft_delta = f"{ttft - base['ttft_seconds']['p50'] * 1000:+.0f} ms" if base else "-"
            cpu = summary.get("client_cpu_seconds")
            client = f"{cpu / summary['duration_seconds']:.0%} of a core" if cpu is not None else "-"
            print(f"| {label} | {rate if rate is not None else 'all at once'} | {tok_s:,.0f} | {ratio} | "
                  f"{ttft:.0f} | {ttft_delta} | {summary['tpot_seconds']['p50'] * 1000:.2f} | {client} |")


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
    command, *args = sys.argv[1:]
    if command == "table":
        table(args[0], args[1:])
    elif command == "snapshot":
        first, second = args
        with urllib.request.urlopen(f"{first.rstrip('/')}/metrics", timeout=10) as reply:
            open(second, "w").write(reply.read().decode())
    elif command == "delta":
        first, second = args
        print(delta(parse(open(first).read()), parse(open(second).read())))
    else:
        sys.exit(f"unknown command {command!r}: table, snapshot or delta")


if __name__ == "__main__":
    main()
