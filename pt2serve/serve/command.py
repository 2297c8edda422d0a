"""`pt2serve serve-artifact`: serve an artifact over an OpenAI-compatible HTTP API with uvicorn.

The server listens at once and loads the model on a background thread: /health answers 503 until the
model is loaded (and its graphs captured), then 200; the ready line is printed at that moment. SIGTERM or
SIGINT drains it (see shutdown.py) and it exits 0.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Optional

import typer

from pt2serve.cli_errors import fail
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime_flags import (
    deterministic_option,
    kv_memory_fraction_option,
    kv_pool,
    max_decode_sequences_option,
    min_prefill_chunk_option,
    num_cells_option,
    num_draft_tokens_option,
    prefix_cache_option,
    prefix_reuse,
    speculate_option,
    speculation,
    step_budget,
    token_budget_option,
)

DEVICES = ("cuda", "cpu")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def default_threads() -> int:
    """The CPU threads torch computes with unless told: one fewer than the cores this process may run on, at
    least one. The event loop, the engine thread and tokenizing need a core of their own: on a 2-core host,
    torch's default of every core stalled each in-flight request for 3-41 s at a time under load, and one
    thread finished the same load in 0.5 s."""
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may use (a cpuset, taskset)
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def log_config(level: str) -> dict:
    """uvicorn's logging setup plus the project's loggers at `level`, printed the way uvicorn prints its own
    (without this, pt2serve's info lines, such as why a request was refused, go nowhere)."""
    from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["pt2serve"] = {"handlers": ["default"], "level": LOG_LEVELS[level], "propagate": False}
    return config


def serve_artifact_command(
    artifact: Path = typer.Argument(..., help="A .pt2 written by pt2serve export."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (0.0.0.0 to listen on every interface)."),
    port: int = typer.Option(8000, help="Port to bind."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: what the artifact was built for)."),
    max_sessions: int = typer.Option(
        64, help="Sessions (X-Session-ID) whose cached KV cells are pinned: evicted only after every unpinned one."
    ),
    session_pin_seconds: Optional[float] = typer.Option(
        None, help="How long a session's cells stay pinned after its last request (default: the runner's, 10 minutes)."
    ),
    max_queued: int = typer.Option(256, help="Requests running or queued before new ones are answered with 429."),
    max_connections: int = typer.Option(512, help="Bounds open connections (past it, the one that has waited "
                                        "longest for a request is closed) and requests in progress (past it, a "
                                        "request gets 503; /health and /metrics are always answered). Must exceed "
                                        "--max-queued."),
    header_timeout: float = typer.Option(10.0, help="Seconds a connection has to send a request's headers, from "
                                         "opening or from its first byte after a response, before it is closed "
                                         "(an idle keep-alive connection is closed after 15 s)."),
    body_timeout: float = typer.Option(30.0, help="Seconds a request's body has to arrive after its headers; then "
                                       "it is answered 408 and its connection closed."),
    drain_timeout: float = typer.Option(30.0, help="On SIGTERM/SIGINT: seconds running requests may take to finish "
                                        "before they are cut; new requests get 503 meanwhile."),
    prefix_cache_enabled: Optional[bool] = prefix_cache_option(),
    token_budget: Optional[int] = token_budget_option(),
    max_decode_sequences: Optional[int] = max_decode_sequences_option(),
    min_prefill_chunk: Optional[int] = min_prefill_chunk_option(),
    num_cells: Optional[int] = num_cells_option(),
    kv_memory_fraction: Optional[float] = kv_memory_fraction_option(),
    speculate: Optional[str] = speculate_option(),
    num_draft_tokens: Optional[int] = num_draft_tokens_option(),
    no_cuda_graphs: bool = typer.Option(False, "--no-cuda-graphs", help="No CUDA graphs (then every step runs forward_others)."),
    deterministic: bool = deterministic_option(),
    api_key: Optional[str] = typer.Option(None, envvar="PT2SERVE_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every endpoint but /health."),
    model_name: Optional[str] = typer.Option(None, help="The model id clients send (default: the file's stem)."),
    default_max_tokens: Optional[int] = typer.Option(None, help="Tokens a request without max_tokens may generate "
                                                     "(default: up to the end of the context, as OpenAI does)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads torch computes with (default: one fewer than the "
                                          "cores this process may use, at least 1, so the event loop and the engine "
                                          "thread keep a core; all of them made requests stall for seconds on a "
                                          "2-core host). The load line says how many."),
    engine_process: bool = typer.Option(False, "--engine-process", help="Run the engine (the artifact, the "
                                        "device, the scheduler) in a process of its own, so the server's Python "
                                        "does not share one interpreter lock with it; --threads then applies to "
                                        "that process."),
    log_level: str = typer.Option("warning", help="The server's log level, uvicorn's and pt2serve's (info shows each "
                                  "request, why a request was refused and the request fields it ignored)."),
) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)."""
    if device is not None and device not in DEVICES:
        fail(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if log_level not in LOG_LEVELS:
        fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    if not 0 <= port <= 65535:
        fail(f"--port must be in [0, 65535], got {port}")
    if max_sessions < 0:
        fail(f"--max-sessions must not be negative, got {max_sessions}")
    if threads is not None and threads < 1:
        fail(f"--threads must be at least 1, got {threads}")
    if not artifact.is_file():
        fail(f"{artifact} does not exist or is not a file")
    from pt2serve.prefetch import prefetch

    prefetch(artifact)  # the file comes off the disk while torch and the server are imported

    import torch

    threads = threads or default_threads()
    torch.set_num_threads(threads)

    from pt2serve.runtime.engine import describe_load, open_runner
    from pt2serve.runtime.engine_process import EngineProcess
    from pt2serve.runtime.executor import ExecutorConfig
    from pt2serve.runtime.runner import RunnerConfig
    from pt2serve.serve.app import create_app
    from pt2serve.serve.config import ServerConfig
    from pt2serve.serve.connections import uvicorn_config
    from pt2serve.serve.loader import BackgroundLoader
    from pt2serve.serve.shutdown import DrainingServer

    try:
        config = ServerConfig(model_name=model_name or artifact.stem, api_key=api_key, max_queued=max_queued,
                              max_connections=max_connections, header_timeout_s=header_timeout,
                              body_timeout_s=body_timeout,
                              drain_timeout_s=drain_timeout,
                              default_max_tokens=default_max_tokens)
        executor_config = ExecutorConfig(**kv_pool(num_cells, kv_memory_fraction), use_cuda_graphs=not no_cuda_graphs,
                                         deterministic=deterministic)
        runner_config = RunnerConfig(**step_budget(token_budget, max_decode_sequences, min_prefill_chunk),
                                     **prefix_reuse(prefix_cache_enabled, session_pin_seconds),
                                     **speculation(speculate, num_draft_tokens), max_sessions=max_sessions)
    except Pt2ServeError as err:
        fail(str(err))

    app = create_app(config)
    # After draining, connections get timeout_graceful_shutdown to send their last bytes (a stalled reader).
    server = DrainingServer(uvicorn_config(app, host=host, port=port, log_config=log_config(log_level),
                                           log_level=log_level, timeout_graceful_shutdown=5), app.state.pt2serve)
    def describe(runner) -> str:
        if engine_process:
            return f"{runner.describe()}; engine in process {runner.pid}, CPU threads: {runner.info.torch_threads}"
        return f"{describe_load(runner)}; CPU threads: {torch.get_num_threads()}"

    def load():
        if engine_process:
            return EngineProcess(artifact, device, executor_config, runner_config, threads)
        return open_runner(artifact, device, executor_config, runner_config)

    loader = BackgroundLoader(app, server, load,
                              ready_message=lambda url: f"serving {config.model_name} at {url}/v1 (ready)",
                              describe=describe)
    loader.start()
    server.run()
    if loader.error is not None:
        fail(loader.error)
    if not server.started:
        raise typer.Exit(code=1)  # uvicorn could not bind; it has said why
