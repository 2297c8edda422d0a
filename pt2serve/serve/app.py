"""The FastAPI app: an OpenAI-compatible API over one Runner.

    create_app(config, runner)   ready at once
    create_app(config)           /health answers 503 and the API 503 until attach_runner(app, runner)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pt2serve.runtime.runner import Runner
from pt2serve.serve import completions, tokenization
from pt2serve.serve.config import ServerConfig
from pt2serve.serve.connections import RequestBudget
from pt2serve.serve.errors import ApiError, UnexpectedErrors
from pt2serve.serve.openai_format import model_card, model_list
from pt2serve.serve.state import ServerState

log = logging.getLogger("pt2serve.serve")


def create_app(config: ServerConfig, runner: Runner | None = None, owns_runner: bool = False) -> FastAPI:
    state = ServerState(config, runner, owns_runner)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if state.runner is not None and state.owns_runner:
            await asyncio.to_thread(state.runner.close)

    app = FastAPI(title="pt2serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pt2serve = state
    _add_error_handlers(app, state)

    async def require_api_key(request: Request) -> None:
        key = config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key_matches(token.strip(), key):
            raise ApiError(401, "missing or incorrect API key: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    # HEAD answers as GET does, without a body (load balancers and monitors probe with it).
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        if state.runner is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
        if state.draining:  # load balancers stop sending here while running requests finish
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": str(config.retry_after_seconds)})
        return JSONResponse({"status": "ok"})

    api = APIRouter(dependencies=[Depends(require_api_key)])

    @api.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        runner = state.ready_runner()
        return JSONResponse(model_list(config.model_name, state.created, runner.max_sequence_tokens))

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        runner = state.ready_runner()
        if model_id != config.model_name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves "
                           f"{config.model_name!r}", "model", "model_not_found")
        return JSONResponse(model_card(config.model_name, state.created, runner.max_sequence_tokens))

    @api.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.handle(request, state, chat=False)

    @api.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await completions.handle(request, state, chat=True)

    # vLLM's tokenizer endpoints (tokenization.py), at the root as vLLM serves them.
    @api.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(await tokenization.tokenize(request, state))

    @api.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await tokenization.detokenize(request, state))

    @api.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenization.tokenizer_info(state))

    app.include_router(api)
    return app


def key_matches(given: str, key: str) -> bool:
    """Compare in constant time. Hashing first makes both sides the same length, so not even the key's
    length shows in the timing (compare_digest alone returns at once on a length mismatch)."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(key.encode()).digest())


def attach_runner(app: FastAPI, runner: Runner, owns_runner: bool = True) -> None:
    """Make an app created without a runner ready (called from any thread once the model is loaded)."""
    state: ServerState = app.state.pt2serve
    state.owns_runner = owns_runner
    state.runner = runner


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        state.metrics.request_rejected(err.status)
        return _answer(request, err)

    # Starlette's own answers (no such route, a method the route does not take) count as rejections too.
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return await api_error(request, ApiError(err.status_code, str(err.detail), headers=dict(err.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return await api_error(request, ApiError(400, "the request is malformed"))

    app.add_middleware(UnexpectedErrors)
    app.add_middleware(RequestBudget, limit=state.config.max_connections, on_refused=state.metrics.request_rejected)


def _answer(request: Request, err: ApiError) -> JSONResponse:
    """The error's response; why a request was refused is logged at info, so an operator can see it."""
    if err.status < 500:
        log.info("%s %s answered %d %s (param %s): %s", request.method, request.url.path, err.status, err.code,
                 err.param, err.message)
    return err.response()
