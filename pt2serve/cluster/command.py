"""`pt2serve serve-ray`: serve an artifact from several replicas on Ray Serve (needs the `ray` extra).

It joins the Ray cluster at --address (or starts one on this machine), deploys build_app's application,
prints the ready line once every replica has loaded, and serves until SIGTERM or SIGINT, then shuts the
application down (each replica's running requests get --drain-timeout seconds).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from pt2serve.cli_errors import fail
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime_flags import (
    kv_memory_fraction_option,
    kv_pool,
    max_decode_sequences_option,
    min_prefill_chunk_option,
    num_cells_option,
    prefix_cache_option,
    prefix_reuse,
    step_budget,
    token_budget_option,
)

APP_NAME = "pt2serve"


def serve_ray_command(
    artifact: Path = typer.Argument(..., help="A .pt2 written by pt2serve export, at a path every Ray node can read."),
    replicas: int = typer.Option(1, help="Replicas, each a runner on one GPU (or CPU cores)."),
    autoscale: Optional[str] = typer.Option(None, help="MIN:MAX replicas, scaled on requests per replica "
                                            "(--target-active) and KV use (--target-kv-use); instead of --replicas."),
    routing: str = typer.Option("prefix", help="prefix: to the replica that took the longest prefix of the prompt "
                                "(or the session); first-tokens: consistent hashing of the first 256 tokens."),
    address: Optional[str] = typer.Option(None, help="A Ray cluster to join (e.g. auto, or ray://HOST:10001); "
                                          "default: start one on this machine."),
    host: str = typer.Option("127.0.0.1", help="Address Ray Serve's HTTP ingress binds (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, help="Port of the HTTP ingress."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: what the artifact was built for)."),
    max_ongoing_requests: int = typer.Option(64, help="Requests one replica takes at once; past it, requests that "
                                             "would go there go to the least loaded replica."),
    imbalance: int = typer.Option(8, help="A request's home replica is passed over for the least loaded one when it "
                                  "has more than this many requests in flight beyond it."),
    target_active: float = typer.Option(8.0, help="--autoscale: requests running or queued per replica."),
    target_kv_use: float = typer.Option(0.8, help="--autoscale: share of a replica's KV pool held by requests."),
    upscale_delay: float = typer.Option(5.0, help="--autoscale: seconds the load must call for more replicas."),
    downscale_delay: float = typer.Option(60.0, help="--autoscale: seconds the load must call for fewer replicas."),
    cpus_per_replica: Optional[float] = typer.Option(None, help="Ray CPUs per replica (default: 1 on the CPU, 0 "
                                                     "with a GPU)."),
    gpus_per_replica: Optional[float] = typer.Option(None, help="Ray GPUs per replica (default: 1 for cuda)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads torch computes with in each replica (default: "
                                          "as serve-artifact)."),
    max_queued: int = typer.Option(256, help="Requests running or queued in one replica before it answers 429."),
    max_sessions: int = typer.Option(64, help="Sessions per replica whose cached KV cells are pinned."),
    drain_timeout: float = typer.Option(30.0, help="Seconds a stopping replica's running requests may take."),
    prefix_cache_enabled: Optional[bool] = prefix_cache_option(),
    token_budget: Optional[int] = token_budget_option(),
    max_decode_sequences: Optional[int] = max_decode_sequences_option(),
    min_prefill_chunk: Optional[int] = min_prefill_chunk_option(),
    num_cells: Optional[int] = num_cells_option(),
    kv_memory_fraction: Optional[float] = kv_memory_fraction_option(),
    api_key: Optional[str] = typer.Option(None, envvar="PT2SERVE_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every endpoint but /health."),
    model_name: Optional[str] = typer.Option(None, help="The model id clients send (default: the file's stem)."),
    default_max_tokens: Optional[int] = typer.Option(None, help="Tokens a request without max_tokens may generate."),
) -> None:
    """Serve an artifact from replicas on Ray Serve, routed by session and prompt prefix."""
    if device is not None and device not in ("cuda", "cpu"):
        fail(f"--device must be cuda or cpu, got {device!r}")
    if not artifact.is_file():
        fail(f"{artifact} does not exist or is not a file")
    from pt2serve.cluster.config import ClusterConfig, parse_autoscale
    from pt2serve.runtime.executor import ExecutorConfig
    from pt2serve.runtime.runner import RunnerConfig
    from pt2serve.serve.config import ServerConfig

    try:
        cluster = ClusterConfig(
            replicas=replicas, autoscale=parse_autoscale(autoscale) if autoscale is not None else None,
            routing=_routing(routing), max_ongoing_requests=max_ongoing_requests, imbalance=imbalance,
            target_active=target_active,            target_kv_use=target_kv_use, upscale_delay_s=upscale_delay, downscale_delay_s=downscale_delay,
            num_cpus=cpus_per_replica, num_gpus=gpus_per_replica, drain_timeout_s=drain_timeout)
        server = ServerConfig(model_name=model_name or artifact.stem, api_key=api_key, max_queued=max_queued,
                              max_connections=max(512, 2 * max_queued), drain_timeout_s=drain_timeout,
                              default_max_tokens=default_max_tokens)
        executor = ExecutorConfig(**kv_pool(num_cells, kv_memory_fraction))
        runner = RunnerConfig(**step_budget(token_budget, max_decode_sequences, min_prefill_chunk),
                              **prefix_reuse(prefix_cache_enabled, None), max_sessions=max_sessions)
    except Pt2ServeError as err:
        fail(str(err))
    try:
        import ray
        from ray import serve
    except ImportError:
        fail("serve-ray needs Ray Serve: pip install 'pt2serve[ray]'")
    from pt2serve.cluster.app import build_app

    try:
        application = build_app(artifact, cluster, server, executor, runner, device, threads)
    except Pt2ServeError as err:
        fail(str(err))

    # A cluster of this machine alone talks over the loopback interface only.
    local = {"_node_ip_address": "127.0.0.1"} if address is None else {}
    ray.init(address=address, namespace=APP_NAME, log_to_driver=False, **local)
    serve.start(http_options={"host": host, "port": port})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.run(application, name=APP_NAME, route_prefix="/")
        if cluster.autoscale is not None:
            replicas_text = f"{cluster.autoscale[0]} to {cluster.autoscale[1]} replicas"
        else:
            replicas_text = f"{cluster.replicas} replica{'s' if cluster.replicas > 1 else ''}"
        shown = f"[{host}]" if ":" in host else host
        print(f"serving {server.model_name} at http://{shown}:{port}/v1 with {replicas_text} (ready)", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def _routing(text: str):
    from pt2serve.cluster.routing import Routing

    try:
        return Routing(text)
    except ValueError:
        raise Pt2ServeError(f"--routing must be {' or '.join(r.value for r in Routing)}, got {text!r}") from None
