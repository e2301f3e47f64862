"""The Litestar application: routes, authentication, request ids and the one error renderer.

Handlers stay thin: they authenticate, read the body within its size limit, call the
framework-independent services and turn their results (or a :class:`GatewayError`) into responses.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any, cast

import msgspec
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream
from litestar.types import Message, Scope

from gateway.chat import TRACE_HEADERS, ChatService, RequestRecord, StreamReply
from gateway.config import Config
from gateway.errors import (
    GatewayError,
    InvalidApiKey,
    MethodNotAllowed,
    NotFound,
    RequestTooLarge,
    render,
)
from gateway.runtime import Gateway
from gateway.tenants import Tenant

log = logging.getLogger("modelgate")

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_SCOPE_REQUEST_ID = "modelgate.request_id"
_CHAT_HEADERS = ("x-task-id", *TRACE_HEADERS)
_encode = msgspec.json.encode


def request_id_for(scope: Scope) -> str:
    """The request's id: the caller's ``X-Request-Id`` when sane, else a new one; fixed once chosen."""
    state = cast(dict[str, Any], scope)
    request_id: str | None = state.get(_SCOPE_REQUEST_ID)
    if request_id is None:
        request_id = _caller_request_id(scope) or os.urandom(12).hex()
        state[_SCOPE_REQUEST_ID] = request_id
    return request_id


def _caller_request_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if REQUEST_ID.fullmatch(text) else None
    return None


async def _add_request_id(message: Message, scope: Scope) -> None:
    """Echo the request id on every response, routed or not."""
    if message["type"] == "http.response.start":
        header = (b"x-request-id", request_id_for(scope).encode())
        message["headers"] = [*message.get("headers", ()), header]


def bearer_key(request: Request[Any, Any, Any]) -> str:
    """The API key of a ``Authorization: Bearer`` header, or 401."""
    value = request.headers.get("authorization")
    if not value:
        raise InvalidApiKey("missing API key: send it as 'Authorization: Bearer <key>'")
    scheme, _, key = value.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise InvalidApiKey("malformed Authorization header: expected 'Bearer <key>'")
    return key.strip()


def error_response(error: GatewayError, extra_headers: dict[str, str] | None = None) -> Response[bytes]:
    status, body, headers = render(error)
    if extra_headers:
        headers = {**extra_headers, **headers}
    return Response(content=body, status_code=status, media_type=MediaType.JSON, headers=headers)


def _framework_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Litestar's own errors (unknown route, wrong method, oversized body) in the OpenAI shape."""
    if isinstance(exc, GatewayError):
        return error_response(exc)
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    error: GatewayError
    if status == 404:
        error = NotFound(f"unknown route: {request.method} {request.url.path}")
    elif status == 405:
        error = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
    elif status == 413:
        error = RequestTooLarge("the request body is too large")
    else:
        if status >= 500:
            log.error(
                "unhandled error",
                exc_info=exc,
                extra={"fields": {"request_id": request_id_for(request.scope)}},
            )
        error = GatewayError(
            "internal error" if status >= 500 else str(getattr(exc, "detail", "bad request"))
        )
    return error_response(error)


def create_app(config: Config, gateway: Gateway | None = None) -> Litestar:
    """The ASGI app serving ``config``."""
    gateway = gateway or Gateway.build(config)
    chat = ChatService(gateway)

    def tenant_of(request: Request[Any, Any, Any]) -> Tenant:
        tenant = gateway.tenants.authenticate(bearer_key(request))
        if tenant is None:
            raise InvalidApiKey("invalid API key")
        return tenant

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
        record = RequestRecord(request_id_for(request.scope))
        try:
            tenant = tenant_of(request)
            try:
                body = await request.body()
            except RequestEntityTooLarge:
                raise RequestTooLarge(
                    f"the request body is over {config.server.max_body_bytes} bytes"
                ) from None
            headers = {
                name: value for name in _CHAT_HEADERS if (value := request.headers.get(name)) is not None
            }
            result = await chat.handle(tenant, body, headers, record)
        except GatewayError as error:
            response = error_response(error, record.headers())
            record.failed(error, response.status_code or 500)
            record.emit()
            return response
        if isinstance(result, StreamReply):
            return Stream(result.events, media_type="text/event-stream", headers=_stream_headers(record))
        record.emit()
        return Response(content=result.body, media_type=MediaType.JSON, headers=record.headers())

    @get("/v1/models")
    async def list_models(request: Request[Any, Any, Any]) -> Response[bytes]:
        tenant = tenant_of(request)
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "modelgate"}
            for name in gateway.routes
            if tenant.may_use(name)
        ]
        return Response(content=_encode({"object": "list", "data": data}), media_type=MediaType.JSON)

    @get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    handlers: list[Callable[..., Any]] = [chat_completions, list_models, healthz, readyz]
    return Litestar(
        route_handlers=handlers,
        before_send=[_add_request_id],
        exception_handlers={Exception: _framework_error},
        request_max_body_size=config.server.max_body_bytes,
        on_shutdown=[gateway.aclose],
        openapi_config=OpenAPIConfig(title="modelgate", version="0.1.0", path="/schema"),
        logging_config=None,
    )


def _stream_headers(record: RequestRecord) -> dict[str, str]:
    return {**record.headers(), "cache-control": "no-cache", "x-accel-buffering": "no"}
