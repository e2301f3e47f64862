"""``POST /v1/chat/completions`` as plain ASGI: the gateway's one hot route skips the framework.

Every model call of a fleet comes through this route. Litestar's routing, request object,
signature model, middleware stack and response classes cost about 60 µs of worker CPU per
request (measured: the same small POST handler as a Litestar route and as a bare ASGI app,
both behind the gateway's uvicorn protocol: 90-108 µs against 32-43 µs), a tenth of what the
gateway spends on a whole request. :class:`gateway.app.GatewayApp` hands this method and path
to :class:`ChatRoute` before routing; every other route, and every other method on this path
(a 405 with ``Allow``), stays Litestar's, and so does the route's declaration, which the OpenAPI
document is made from.

What the framework did for this route is done here, the same way: the body limit (413, from
``Content-Length`` before reading, else while reading), the request id on every response, the
observe middleware (in-flight gauge, server span) around it, and for an unexpected exception a
logged 500 in the OpenAI shape.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from litestar.types import ASGIApp, Receive, Scope, Send

from gateway import observe
from gateway.chat import ChatService
from gateway.chat_input import TRACE_HEADERS
from gateway.errors import GatewayError, RequestTooLarge, render
from gateway.http import authenticate, client_address, request_id_for
from gateway.record import RequestRecord
from gateway.relay import StreamReply, send_events
from gateway.runtime import Gateway
from gateway.tenants import Tenant

log = logging.getLogger("modelgate")

_WANTED = frozenset([b"authorization", b"content-length", b"x-task-id", *(h.encode() for h in TRACE_HEADERS)])
_PASSED_ON = ("x-task-id", *TRACE_HEADERS)
_JSON = (b"content-type", b"application/json")
_EVENT_STREAM = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _ClientGone(Exception):
    """The client disconnected before its request body had arrived."""


class ChatRoute:
    """The chat completions handler as an ASGI app (wrapped in the observe middleware)."""

    def __init__(self, gateway: Gateway, chat: ChatService) -> None:
        self._gateway = gateway
        self._chat = chat
        self._max_body = gateway.config.server.max_body_bytes
        self.app: ASGIApp = observe.middleware(cast(ASGIApp, self._serve))

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = request_id_for(scope)
        record = RequestRecord(request_id)
        headers = _headers(scope)
        tenant: Tenant | None = None
        try:
            tenant = await authenticate(self._gateway, client_address(scope), headers.get("authorization"))
            body = await self._body(receive, headers.get("content-length"))
            passed = {name: headers[name] for name in _PASSED_ON if name in headers}
            result = await self._chat.handle(tenant, body, passed, record)
        except GatewayError as error:
            if (
                tenant is not None
                and not record.rate_headers
                and "x-ratelimit-limit-requests" not in error.headers
            ):
                record.rate_headers = await self._gateway.limiter.rate_headers(tenant)
            status, error_body, error_headers = render(error)
            record.failed(error, status)
            record.emit()
            await _send_whole(send, status, error_body, {**record.headers(), **error_headers}, request_id)
            return
        except _ClientGone:
            record.status, record.error_code = 499, "aborted"
            record.emit()
            return
        except Exception as exc:
            record.status, record.error_code = 500, "aborted"
            record.emit()
            log.error("unhandled error", exc_info=exc, extra={"fields": {"request_id": request_id}})
            status, error_body, error_headers = render(GatewayError("internal error"))
            await _send_whole(send, status, error_body, error_headers, request_id)
            return
        except BaseException:
            # Cancelled (the server stopping past its grace): still counted and logged.
            record.status, record.error_code = 500, "aborted"
            record.emit()
            raise
        if isinstance(result, StreamReply):
            head = [*_EVENT_STREAM, *_encoded(record.headers()), (b"x-request-id", request_id.encode())]
            await send_events(result.events, head, scope, receive, send)
            return
        try:
            await _send_whole(send, 200, result.body, record.headers(), request_id)
        finally:
            # Counted and logged in the step that wrote the reply (no other request is served in
            # between), so the metrics never lag it, and not ahead of it, in the client's time.
            record.emit()
            await result.settling

    async def _body(self, receive: Receive, declared: str | None) -> bytes:
        limit = self._max_body
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestTooLarge(f"the request body is over {limit} bytes")
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            piece = cast(bytes, message.get("body", b""))
            size += len(piece)
            if size > limit:
                raise RequestTooLarge(f"the request body is over {limit} bytes")
            parts.append(piece)
            if not message.get("more_body", False):
                return parts[0] if len(parts) == 1 else b"".join(parts)


def _headers(scope: Scope) -> dict[str, str]:
    """The request headers this route reads (the first of each, as Litestar's ``get`` gives)."""
    found: dict[str, str] = {}
    for name, value in scope["headers"]:
        if name in _WANTED:
            found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]


async def _send_whole(send: Send, status: int, body: bytes, headers: dict[str, str], request_id: str) -> None:
    head: list[tuple[bytes, bytes]] = [_JSON, (b"content-length", str(len(body)).encode())]
    head += _encoded(headers)
    head.append((b"x-request-id", request_id.encode()))
    await send(cast(Any, {"type": "http.response.start", "status": status, "headers": head}))
    await send(cast(Any, {"type": "http.response.body", "body": body, "more_body": False}))
