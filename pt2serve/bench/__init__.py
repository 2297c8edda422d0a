"""`pt2serve bench`: measure an artifact where requests really enter, the runner.

- sweep.py: throughput at each step width T, beside the machine's physical limit (roofline.py);
- requests_mode.py: N requests over time (workload.py, conversations.py), in-process (in_process.py) or
  against a running server (http_client.py), each request timed and the run summarised (request_timing.py);
- report.py: the table, the JSON document and the plot; command.py: the CLI.

The Python API (imported lazily, so the CLI starts fast):
    from pt2serve.bench import SweepOptions, run_sweep, RequestsOptions, run_requests
"""

from __future__ import annotations

_EXPORTS = {
    "SweepOptions": "pt2serve.bench.options",
    "RequestsOptions": "pt2serve.bench.options",
    "run_sweep": "pt2serve.bench.sweep",
    "sweep_executor": "pt2serve.bench.sweep",
    "SweepResult": "pt2serve.bench.sweep",
    "run_requests": "pt2serve.bench.requests_mode",
    "drive_runner": "pt2serve.bench.in_process",
    "RequestsResult": "pt2serve.bench.request_timing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pt2serve.bench' has no attribute {name!r}")
