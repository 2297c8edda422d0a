"""Errors the HTTP API answers with, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("pt2serve.serve")

# OpenAI's error types, by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
# A code for every 4xx that names none of its own (a client can branch on `code` without reading the message).
_DEFAULT_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limited",
}
# Every 503 says when to come back (a load balancer or client retries then, rather than at once or never).
DEFAULT_RETRY_AFTER_S = 1


class ApiError(Exception):
    """A request the server answers with a 4xx/5xx and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _DEFAULT_CODES.get(status, "invalid_request" if status < 500 else None)
        self.headers = dict(headers or {})
        if status == 503:
            self.headers.setdefault("Retry-After", str(DEFAULT_RETRY_AFTER_S))

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


class UnexpectedErrors:
    """ASGI middleware: an exception no handler expected is logged once and answered with a 500 in the
    shape above. (Starlette's handler for Exception re-raises after answering, and uvicorn then drops the
    connection, so the client may see a reset instead of the answer.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except ClientDisconnect:  # the client left before its request was read: nobody to answer, nothing broke
            return
        except Exception as err:
            if started:  # part of a response is out: nothing to answer, let uvicorn close the connection
                raise
            log.error("unexpected error in %s %s", scope["method"], scope["path"], exc_info=err)
            body = error_body("internal server error; see the server log", "server_error")
            await JSONResponse(body, status_code=500)(scope, receive, send)
