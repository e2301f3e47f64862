"""The OpenAI-compatible routes: ``POST /v1/chat/completions`` and ``GET /v1/models``."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import MediaType, Request, Response, get, post

from gateway import openapi
from gateway.http import gateway_of, tenant_of
from providers.base import ChatHead

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
async def chat_completions() -> Response[bytes]:
    """OpenAI Chat Completions, whole or streamed, through the model's targets.

    Declared for the OpenAPI document and for Litestar's answer to other methods on this path
    (405 with ``Allow``); a POST is served by :mod:`gateway.chat_route` before routing.
    """
    raise AssertionError("POST /v1/chat/completions is served by gateway.chat_route")


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
