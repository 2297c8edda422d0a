#!/usr/bin/env python3
"""The table of `bench --mode requests` runs against one in-process run: output tok/s, the ratio, TTFT and TPOT.

    python3 scripts/device/http_table.py IN_PROCESS.json LABEL=RUN.json ...

A run with --request-rates is compared rate by rate with an in-process run of the same rates (IN_PROCESS may
be one; its rates are matched by their offered rate).
"""

from __future__ import annotations

import json
import sys


def runs(path: str) -> dict[float | None, dict]:
    """The summaries of a bench JSON by offered rate (None: all requests at once)."""
    doc = json.load(open(path))
    if "rates" in doc:
        return {entry["offered_rate"]: entry["summary"] for entry in doc["rates"]}
    return {None: doc["summary"]}


def main() -> None:
    base_path, *labelled = sys.argv[1:]
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


if __name__ == "__main__":
    main()
