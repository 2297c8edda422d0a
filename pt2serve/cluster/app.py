"""build_app: the Ray Serve application of a gateway and engine replicas over one artifact.

    from pt2serve.cluster import build_app
    serve.run(build_app("model.pt2", ClusterConfig(replicas=2)), route_prefix="/")

The gateway (gateway.py) is the HTTP ingress; the engine deployment (replica.py) holds the replicas, each a
runner on one GPU (or CPU cores), routed by router.py and, with autoscale, scaled by autoscale.py.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from pt2serve.cluster.autoscale import QueueAndKvPolicy
from pt2serve.cluster.config import ClusterConfig, parse_autoscale
from pt2serve.cluster.gateway import Gateway
from pt2serve.cluster.replica import EngineReplica, ReplicaSettings
from pt2serve.cluster.router import PrefixAwareRouter
from pt2serve.errors import Pt2ServeError
from pt2serve.runtime.artifact import read_metadata
from pt2serve.runtime.executor import ExecutorConfig
from pt2serve.runtime.runner import RunnerConfig
from pt2serve.serve.config import ServerConfig


def build_app(artifact: str | Path, cluster: ClusterConfig = ClusterConfig(), server: ServerConfig | None = None,
              executor: ExecutorConfig = ExecutorConfig(), runner: RunnerConfig = RunnerConfig(),
              device: str | None = None, threads: int | None = None) -> Application:
    """The application serving `artifact` (a path every node of the Ray cluster can read)."""
    artifact = Path(artifact).resolve()
    backend = read_metadata(artifact).raw.get("backend")  # a missing or bad artifact fails here, not in a replica
    server = server or ServerConfig(model_name=artifact.stem)
    if cluster.max_ongoing_requests > server.max_queued:
        raise Pt2ServeError(f"max_ongoing_requests ({cluster.max_ongoing_requests}) must not exceed the server's "
                            f"max_queued ({server.max_queued}): a replica would answer 429 before it is saturated")
    board_name = f"pt2serve-board-{uuid.uuid4().hex[:12]}"
    settings = ReplicaSettings(str(artifact), board_name, server, executor, runner, device, threads)
    engine = serve.deployment(EngineReplica, name="Engine").options(
        max_ongoing_requests=cluster.max_ongoing_requests,
        ray_actor_options=_resources(cluster, device or backend),
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAwareRouter, request_router_kwargs={"routing": cluster.routing.value,
                                                                 "imbalance": cluster.imbalance},
            request_routing_stats_period_s=cluster.report_period_s),
        graceful_shutdown_timeout_s=cluster.drain_timeout_s,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        **_scaling(cluster),
    )
    # The gateway only forwards: no CPU of its own, and room for as many requests as the server takes.
    gateway = serve.deployment(Gateway, name="Gateway").options(
        max_ongoing_requests=server.max_connections, ray_actor_options={"num_cpus": 0})
    return gateway.bind(engine.bind(settings), str(artifact), server, board_name)


def app_builder(args: dict) -> Application:
    """build_app from a Ray Serve config file's `args` (import_path: pt2serve.cluster.app:app_builder):
    `artifact`, any ClusterConfig field (`autoscale` as "MIN:MAX"), and `model_name`."""
    args = dict(args)
    artifact = args.pop("artifact", None)
    if artifact is None:
        raise Pt2ServeError("the application's args need `artifact`: the .pt2 path every node can read")
    server = ServerConfig(model_name=args.pop("model_name")) if "model_name" in args else None
    if isinstance(args.get("autoscale"), str):
        args["autoscale"] = parse_autoscale(args["autoscale"])
    try:
        cluster = ClusterConfig(**args)
    except TypeError as err:
        raise Pt2ServeError(f"unknown application args: {err}") from None
    return build_app(artifact, cluster, server)


def _resources(cluster: ClusterConfig, device: str | None) -> dict:
    on_gpu = device == "cuda"
    num_gpus = cluster.num_gpus if cluster.num_gpus is not None else (1 if on_gpu else 0)
    num_cpus = cluster.num_cpus if cluster.num_cpus is not None else (0 if num_gpus else 1)
    return {"num_cpus": num_cpus, "num_gpus": num_gpus}


def _scaling(cluster: ClusterConfig) -> dict:
    if cluster.autoscale is None:
        return {"num_replicas": cluster.replicas}
    low, high = cluster.autoscale
    policy = AutoscalingPolicy(policy_function=QueueAndKvPolicy, policy_kwargs={
        "target_active": cluster.target_active, "target_kv_use": cluster.target_kv_use})
    return {"autoscaling_config": AutoscalingConfig(
        min_replicas=low, max_replicas=high, initial_replicas=max(low, 1),
        upscale_delay_s=cluster.upscale_delay_s, downscale_delay_s=cluster.downscale_delay_s,
        look_back_period_s=cluster.look_back_s, policy=policy)}
