"""The OpenAI-compatible routes: ``POST /v1/chat/completions`` and ``GET /v1/models``."""

from __future__ import annotations

from typing import Any, cast

import msgspec
from litestar import MediaType, Request, Response, get, post
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.response import Stream

from gateway.chat import ChatService
from gateway.chat_input import TRACE_HEADERS
from gateway.errors import GatewayError, RequestTooLarge
from gateway.http import error_response, gateway_of, request_id_for, tenant_of
from gateway.record import RequestRecord
from gateway.relay import StreamReply
from gateway.tenants import Tenant

_CHAT_HEADERS = ("x-task-id", *TRACE_HEADERS)
_encode = msgspec.json.encode


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    record = RequestRecord(request_id_for(request.scope))
    tenant: Tenant | None = None
    try:
        tenant = await tenant_of(request)
        body = await _body(request)
        headers = {name: value for name in _CHAT_HEADERS if (value := request.headers.get(name)) is not None}
        chat = cast(ChatService, request.app.state.chat)
        result = await chat.handle(tenant, body, headers, record)
    except GatewayError as error:
        if (
            tenant is not None
            and not record.rate_headers
            and "x-ratelimit-limit-requests" not in error.headers
        ):
            record.rate_headers = await gateway_of(request).limiter.rate_headers(tenant)
        response = error_response(error, record.headers())
        record.failed(error, response.status_code or 500)
        record.emit()
        return response
    except BaseException:
        # A client gone mid-request (cancelled) or an unexpected error: still counted and logged.
        record.status, record.error_code = 499 if request.is_connected is False else 500, "aborted"
        record.emit()
        raise
    if isinstance(result, StreamReply):
        headers = {**record.headers(), "cache-control": "no-cache", "x-accel-buffering": "no"}
        return Stream(result.events, media_type="text/event-stream", headers=headers)
    record.emit()
    return Response(content=result.body, media_type=MediaType.JSON, headers=record.headers())


async def _body(request: Request[Any, Any, Any]) -> bytes:
    try:
        return await request.body()
    except RequestEntityTooLarge:
        limit = gateway_of(request).config.server.max_body_bytes
        raise RequestTooLarge(f"the request body is over {limit} bytes") from None


@get("/v1/models")
async def list_models(request: Request[Any, Any, Any]) -> Response[bytes]:
    tenant = await tenant_of(request)
    gateway = gateway_of(request)
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "modelgate"}
        for name in gateway.routes
        if tenant.may_use(name)
    ]
    headers = await gateway.limiter.rate_headers(tenant)
    return Response(
        content=_encode({"object": "list", "data": data}), media_type=MediaType.JSON, headers=headers
    )


ROUTES = [chat_completions, list_models]
