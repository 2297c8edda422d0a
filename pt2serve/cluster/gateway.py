"""The gateway: Ray Serve's HTTP ingress for the engine replicas.

Every request is forwarded whole to one replica (router.py picks it from the route key read here, calls.py)
and its response comes back byte for byte; /metrics is the one answered here, all replicas' merged.

A replica that dies (or is taken away) before its response's first bytes has the request sent again, to
another replica, up to MAX_ATTEMPTS times: nothing reached the client yet, so no request is lost. Once a
stream has begun it cannot be replayed: it ends with an error event and [DONE], as a request the server cut
does.
"""

# No `from __future__ import annotations` here: serve.ingress hands FastAPI the routes with their annotations
# as strings it cannot resolve, and FastAPI then takes `request: Request` for a query parameter.
import asyncio
import logging
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.concurrency import run_in_threadpool

from pt2serve.cluster import board
from pt2serve.cluster.calls import HttpCall, ResponseStart, route_key
from pt2serve.cluster.metrics_merge import merge_metrics
from pt2serve.runtime.engine import read_tokenizer
from pt2serve.serve.app import key_matches
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.errors import ApiError
from pt2serve.serve.openai_format import SSE_DONE, sse

log = logging.getLogger("pt2serve.cluster")

MAX_ATTEMPTS = 4
RETRY_PAUSE_S = 0.05
RETRYABLE = (RayActorError, ReplicaUnavailableError)
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

api = FastAPI(title="pt2serve", docs_url=None, redoc_url=None, openapi_url=None)


def _lost() -> ApiError:
    return ApiError(503, "the replica serving this request stopped; retry", code="replica_lost")


class GatewayMetrics:
    """What only the gateway sees, appended to the replicas' merged /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.retries = Counter("pt2serve_gateway_retries", "Requests sent again to another replica because the "
                               "one they were on stopped before answering.", registry=self.registry)
        self.lost = Counter("pt2serve_gateway_requests_lost", "Requests answered with replica_lost: a stream whose "
                            "replica stopped after it began, or a request whose every attempt's replica stopped.",
                            registry=self.registry)


async def _rest(responses: DeploymentResponseGenerator, start: ResponseStart,
                metrics: GatewayMetrics) -> AsyncIterator[bytes]:
    """The response's bytes from its first on; a replica lost mid-stream ends an event stream with an error."""
    finished = False
    try:
        yield start.body
        async for chunk in responses:
            yield chunk
        finished = True
    except RETRYABLE as err:
        finished = True
        log.warning("a replica stopped while streaming a response: %s", type(err).__name__)
        metrics.lost.inc()
        if start.is_event_stream:
            yield sse(_lost().body()) + SSE_DONE
    finally:
        if not finished:  # the client went away: stop the request on its replica
            responses.cancel()


async def _read_bounded(request: Request, limit: int) -> bytes:
    """The body, or its first limit + 1 bytes: the replica answers an oversized body with its own 413."""
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            break
    return b"".join(chunks)


# Below the helpers it calls: serve.ingress pickles the class when it is defined, with the module's names so far.
@serve.ingress(api)
class Gateway:
    def __init__(self, engine: DeploymentHandle, artifact: str, config: ServerConfig, board_name: str) -> None:
        self._engine = engine.options(method_name="forward", stream=True)
        self._tokenizer = read_tokenizer(artifact)
        self._config = config
        self._board_name = board_name
        self._metrics = GatewayMetrics()

    @api.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(self, request: Request) -> Response:
        if not self._authorized(request):
            return Response(status_code=401, headers={"WWW-Authenticate": "Bearer"})
        texts = await board.board(self._board_name).texts.remote()
        own = generate_latest(self._metrics.registry)
        return Response(merge_metrics(texts) + own, media_type=CONTENT_TYPE_LATEST)

    @api.api_route("/{path:path}", methods=METHODS)
    async def forward(self, request: Request, path: str) -> Response:
        body = await _read_bounded(request, self._config.max_body_bytes)
        headers = {name: value for name, value in request.headers.items()}
        path = "/" + path  # below the application's route prefix, as the server's routes expect it
        route = await run_in_threadpool(route_key, path, headers, body, self._tokenizer)
        client = (request.client.host, request.client.port) if request.client is not None else None
        call = HttpCall(request.method, path, request.url.query.encode(), tuple(request.headers.raw), body, client,
                        route)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            responses = self._engine.remote(call)
            try:
                start = await responses.__anext__()
            except RETRYABLE as err:
                log.warning("%s %s: its replica stopped before answering (attempt %d of %d): %s", request.method,
                            path, attempt, MAX_ATTEMPTS, type(err).__name__)
                self._metrics.retries.inc()
                await asyncio.sleep(RETRY_PAUSE_S * attempt)  # while Ray's router learns the replica is gone
                continue
            except asyncio.CancelledError:  # the client went away
                responses.cancel()
                raise
            response = StreamingResponse(_rest(responses, start, self._metrics), status_code=start.status)
            response.raw_headers = list(start.headers)
            return response
        self._metrics.lost.inc()
        return _lost().response()

    def _authorized(self, request: Request) -> bool:
        key = self._config.api_key
        if key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and key_matches(token.strip(), key)
