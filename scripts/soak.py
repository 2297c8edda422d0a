#!/usr/bin/env python3
"""Soak a running pt2serve server: a seeded mix of traffic for --duration seconds, then checks from the
server itself (see pt2serve/soak/). Prints the tables last; exits 1 when a check fails.

    pt2serve serve-artifact toy.pt2 --num-cells 384 --max-queued 24 &
    python scripts/soak.py --url http://127.0.0.1:8000 --duration 60 --max-queued 24 --designed toy-recall
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from pt2serve.errors import Pt2ServeError


def main(
    url: str = typer.Option(..., help="The server's root URL, e.g. http://127.0.0.1:8000."),
    duration: float = typer.Option(60.0, help="Seconds of traffic."),
    seed: int = typer.Option(0, help="Seed of the mix (each client draws from its own seeded stream)."),
    concurrency: int = typer.Option(16, help="Clients running scenarios at once."),
    max_queued: Optional[int] = typer.Option(None, help="The server's --max-queued: bursts go past it and must "
                                             "get 429s."),
    api_key: Optional[str] = typer.Option(None, envvar="PT2SERVE_API_KEY", help="Sent as a bearer token."),
    designed: Optional[str] = typer.Option(None, help="The designed preset the server serves (toy-greedy, toy-recall "
                                           "or their -8b twins): greedy requests must return exactly its designed "
                                           "tokens and text."),
    warmup: float = typer.Option(5.0, help="Seconds of traffic before the memory baselines are read."),
    max_rss_growth_mb: float = typer.Option(256.0, help="Bound on host RSS growth over its post-warm-up level."),
    max_device_growth_mb: float = typer.Option(64.0, help="Bound on device memory growth over its post-warm-up "
                                               "level."),
    min_requests: int = typer.Option(0, help="Fail unless at least this many requests were sent."),
    expect_preemption: bool = typer.Option(False, "--expect-preemption", help="Fail unless some request was "
                                           "preempted (a pool small enough for it: serve with --num-cells)."),
    sampled_replays: int = typer.Option(32, help="Seeded sampled answers asked again alone after the traffic: "
                                        "each must come back the same."),
    min_sampled_agreement: float = typer.Option(1.0, help="The share of those replays that must be identical (1 for "
                                                "a --deterministic or fp32 artifact; a bf16 one's near-ties can "
                                                "flip a draw when its step is cut differently)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the whole report here."),
) -> None:
    from pt2serve.soak.driver import run_soak
    from pt2serve.soak.options import SoakOptions

    console = Console() if sys.stdout.isatty() else Console(width=160)  # a log keeps whole columns
    try:
        options = SoakOptions(url=url, duration_s=duration, seed=seed, concurrency=concurrency, max_queued=max_queued,
                              api_key=api_key, designed=designed, warmup_s=warmup,
                              max_rss_growth_mb=max_rss_growth_mb, max_device_growth_mb=max_device_growth_mb,
                              min_requests=min_requests, expect_preemption=expect_preemption,
                              sampled_replays=sampled_replays, min_sampled_agreement=min_sampled_agreement)
        report = run_soak(options)
    except Pt2ServeError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
        raise typer.Exit(code=2)
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    for table in report.tables():
        console.print(table)
    raise typer.Exit(code=0 if report.passed else 1)


if __name__ == "__main__":
    typer.run(main)
