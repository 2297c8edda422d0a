"""`pt2serve bench` (being written)."""


def bench_command() -> None:
    """Benchmark an artifact."""
    raise SystemExit("bench is not available yet")
