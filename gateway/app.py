"""The Litestar application: routes, the runtime state they share, and the one error renderer.

Handlers stay thin: they authenticate, read the body within its size limit, call the
framework-independent services and turn their results (or a :class:`GatewayError`) into responses.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Litestar, Request, Response
from litestar.datastructures import State
from litestar.exceptions import HTTPException

from gateway import heap, observe, openapi, routes_admin, routes_ops, routes_v1, tracing
from gateway.chat import ChatService
from gateway.chat_route import ChatRoute
from gateway.config import Config
from gateway.errors import GatewayError, InvalidRequest, MethodNotAllowed, NotFound, RequestTooLarge
from gateway.http import add_request_id, error_response, request_id_for
from gateway.runtime import Gateway

log = logging.getLogger("modelgate")


def _framework_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Errors raised outside the handlers' own handling, in the OpenAI shape."""
    if isinstance(exc, GatewayError):
        return error_response(exc)
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    # Litestar's own headers are kept: a 405 must say what is allowed (``Allow``, RFC 9110 15.5.6).
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else {}
    error: GatewayError
    if status == 404:
        error = NotFound(f"unknown route: {request.method} {request.url.path}")
    elif status == 405:
        error = MethodNotAllowed(
            f"method {request.method} is not allowed on {request.url.path}", headers=headers
        )
    elif status == 413:
        error = RequestTooLarge("the request body is too large")
    elif 400 <= status < 500:
        # A client error Litestar finds before any handler runs (an invalid Host header, say):
        # the client's fault, so a 400 ``invalid_request``. It used to fall through to the base
        # GatewayError below and be answered 500 ``internal_error``.
        error = InvalidRequest(str(getattr(exc, "detail", "") or "bad request"), headers=headers)
    else:
        log.error(
            "unhandled error",
            exc_info=exc,
            extra={"fields": {"request_id": request_id_for(request.scope)}},
        )
        error = GatewayError("internal error")
    return error_response(error)


class GatewayApp(Litestar):
    """The Litestar app, except that ``POST /v1/chat/completions`` goes to :mod:`gateway.chat_route`
    before routing (the framework's share of a request's CPU was about a tenth of it)."""

    chat_route: ChatRoute

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == observe.CHAT_PATH and scope["method"] == "POST":
            await self.chat_route.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(config: Config, gateway: Gateway | None = None, workers: int = 1) -> Litestar:
    """The ASGI app serving ``config``; ``workers`` is how many processes serve it together."""
    gateway = gateway or Gateway.build(config, workers)
    observe.attach(gateway)
    chat = ChatService(gateway)
    app = GatewayApp(
        route_handlers=[
            *routes_v1.ROUTES,
            *routes_ops.routes(metrics_public=config.server.metrics_public),
            routes_admin.ADMIN,
        ],
        state=State({"gateway": gateway, "chat": chat}),
        before_send=[add_request_id],
        middleware=[observe.middleware],
        exception_handlers={Exception: _framework_error},
        request_max_body_size=config.server.max_body_bytes,
        on_startup=[gateway.start, heap.freeze_startup_objects],
        on_shutdown=[gateway.aclose, tracing.flush],
        openapi_config=openapi.config(),
        logging_config=None,
    )
    app.chat_route = ChatRoute(gateway, chat)
    openapi.finish(app)
    return app
