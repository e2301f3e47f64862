"""The observability hooks the app and the chat flow call: one middleware and two awaitables.

:func:`middleware` wraps every routed request: the in-flight gauge around chat completions, and
the request's server span when tracing is on (the health, readiness and metrics routes are not
traced). :func:`admission` and :func:`settle` give those steps of the chat flow their spans.
What a request did is counted by its :class:`gateway.record.RequestRecord`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from opentelemetry import trace

from gateway import metrics, tracing

if TYPE_CHECKING:
    from gateway.chat import AdmittedRequest
    from gateway.runtime import Gateway
    from providers.base import Usage

T = TypeVar("T")

CHAT_PATH = "/v1/chat/completions"
UNTRACED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def attach(gateway: Gateway) -> None:
    """Point this process's metrics and tracing at ``gateway`` (called when its app is made)."""
    metrics.bind(gateway)
    tracing.use_provider()


def middleware(app: ASGIApp) -> ASGIApp:
    """Counts chat requests in flight and, when tracing, wraps each request in its server span."""

    async def observed(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        chat = path == CHAT_PATH
        if chat:
            metrics.INFLIGHT.inc()
        try:
            if tracing.enabled() and path not in UNTRACED_PATHS:
                await _traced(app, scope, receive, send)
            else:
                await app(scope, receive, send)
        finally:
            if chat:
                metrics.INFLIGHT.dec()

    return observed


async def _traced(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    method = str(scope.get("method", "GET"))
    route = str(scope.get("path_template") or scope["path"])
    span = tracing.start_server_span(method, route, scope["path"], scope["headers"])
    status: int | None = None

    async def send_noting_status(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    try:
        with trace.use_span(span, end_on_exit=False):
            await app(scope, receive, send_noting_status)
    finally:
        tracing.end_server_span(span, status)


async def admission(work: Awaitable[T]) -> T:
    """Admission, in its span."""
    return await tracing.traced("admission", work)


async def settle(
    request: AdmittedRequest, usage: Usage | None, completion_estimate: int, *, succeeded: bool = True
) -> None:
    """Settle ``request`` once, in its span; the attempt still open (if any) has ``succeeded``."""
    if request.ticket.settled:
        return
    if succeeded:
        request.record.attempt_succeeded()
    await tracing.traced("settlement", request.settle(usage, completion_estimate))
