"""The OpenAI-compatible routes: ``POST /v1/chat/completions`` and ``GET /v1/models``."""

from __future__ import annotations

from typing import Any, cast

import msgspec
from litestar import MediaType, Request, Response, get, post
from litestar.exceptions.http_exceptions import RequestEntityTooLarge

from gateway import openapi
from gateway.chat import ChatService
from gateway.chat_input import TRACE_HEADERS
from gateway.errors import GatewayError, RequestTooLarge
from gateway.http import error_response, gateway_of, request_id_for, tenant_of
from gateway.record import RequestRecord
from gateway.relay import SSEResponse, StreamReply
from gateway.tenants import Tenant
from providers.base import ChatHead

_CHAT_HEADERS = ("x-task-id", *TRACE_HEADERS)
_encode = msgspec.json.encode


@post(
    "/v1/chat/completions",
    status_code=200,
    security=openapi.TENANT,
    responses={
        200: openapi.ok(
            openapi.ChatCompletion,
            "The completion (`application/json`), or with `stream: true` its chunks as server-sent "
            "events (`text/event-stream`).",
        ),
        400: openapi.error(
            "`invalid_request`: bad JSON, a field the gateway reads with the wrong type, missing "
            "`model` or `messages`, too many messages (`server.max_messages`), a bad `X-Task-Id`."
        ),
        401: openapi.INVALID_API_KEY,
        403: openapi.error("`model_not_allowed`: this tenant may not use the model."),
        404: openapi.error("`model_not_found`: no such model."),
        413: openapi.REQUEST_TOO_LARGE,
        429: openapi.error(
            "`rate_limit_exceeded`: the tenant's `rpm`, `tpm` or `max_concurrency`, or every provider "
            "of the model, is at its limit (or this address sent too many unknown keys); `retry-after` "
            "and `retry-after-ms` say when a retry can pass. `insufficient_quota`: the tenant's budget "
            "or the task's `task_max_tokens` is used up; `retry-after` when the period's end will help."
        ),
        502: openapi.error(
            "`upstream_error`: the upstream answered with something unusable, refused the gateway's "
            "credentials, or failed in a way no retry helps."
        ),
        503: openapi.error(
            "`upstream_unavailable`: every target failed or has an open breaker (`retry-after`: the "
            "earliest breaker retry). `state_unavailable`: the shared state (Redis) is unreachable "
            'and `redis.on_failure` is `"closed"`.'
        ),
        504: openapi.error("`upstream_timeout`: the request's deadline (`server.request_timeout_s`) passed."),
    },
    operation_class=openapi.operation(
        body=openapi.json_body(
            ChatHead,
            "An OpenAI Chat Completions request. The gateway reads the fields below (a wrong type is a "
            "400); every other field passes through untouched to OpenAI-type upstreams.",
        ),
        media={200: {"text/event-stream": openapi.SSE}},
        parameters=[openapi.X_TASK_ID],
        headers=openapi.CHAT_HEADERS,
        rate_limit_headers=True,
        upstream_errors=(400, 404, 413),
    ),
)
async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
    """OpenAI Chat Completions, whole or streamed, through the model's targets."""
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
        return SSEResponse(result.events, headers)
    record.emit()
    return Response(content=result.body, media_type=MediaType.JSON, headers=record.headers())


async def _body(request: Request[Any, Any, Any]) -> bytes:
    try:
        return await request.body()
    except RequestEntityTooLarge:
        limit = gateway_of(request).config.server.max_body_bytes
        raise RequestTooLarge(f"the request body is over {limit} bytes") from None


@get(
    "/v1/models",
    security=openapi.TENANT,
    responses={
        200: openapi.ok(openapi.ModelList, "The models this tenant may use."),
        401: openapi.INVALID_API_KEY,
        429: openapi.KEY_GUESSING,
    },
    operation_class=openapi.operation(rate_limit_headers=True),
)
async def list_models(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The models this tenant may use, in OpenAI's list format."""
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
