"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol plus the limits it lacks.

uvicorn bounds a request's body only through the app, and with httptools it bounds neither the
size of a request head nor the time a client may take to send a request, nor the number of open
connections (its ``limit_concurrency`` answers a plain-text 503 once the limit is reached, and
only after the head has been read). A client that trickles bytes, or opens thousands of idle
connections, could hold a worker's memory and sockets. This subclass adds, per worker:

- ``max_header_bytes``: the request line and headers together; over it, 431 and the connection
  closes;
- ``client_timeout_s``: a connection must begin a request within it, and each request's head and
  body must arrive within it of the request's first byte; past it, 408 (if no response has
  started) and the connection closes;
- ``max_connections``: open connections; one more is closed as soon as it is accepted;
- malformed HTTP is answered 400, like the rest, in the OpenAI error shape.

It also coalesces a response's writes: uvicorn writes the status line and headers on
``http.response.start`` and the body on ``http.response.body``, two ``send()`` calls (and two TCP
segments) for every whole reply. Writes made in one event-loop turn now go out as one: at the
turn's end, or at once when the response is complete.

A request's scope carries ``ON_DISCONNECT``: a function that registers a callback (or None to
drop it) for the connection's loss, so a streaming response learns that its client left without
a task of its own waiting in ``receive()`` for every stream; and ``FLUSH``, which writes what the
response has coalesced so far at once (a stream's head and first events).

Keep-alive connections idle between requests close after uvicorn's ``timeout_keep_alive``
(``server.idle_timeout_s``). The limits travel in :class:`GatewayServerConfig`, which uvicorn
hands to every protocol instance (and, pickled, to every worker process).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.errors import GatewayError, HeadersTooLarge, InvalidRequest, RequestTimedOut, render

ON_DISCONNECT = "modelgate.on_disconnect"
"""Scope key of the connection's disconnect-callback registration (absent under other servers)."""
FLUSH = "modelgate.flush"
"""Scope key of a function that writes the response's coalesced bytes now (absent under other
servers): a stream's head and first events leave at once, not at the end of the loop turn."""


class GatewayServerConfig(uvicorn.Config):
    """uvicorn's config with the client limits of :class:`GatewayHttpProtocol`."""

    def __init__(
        self,
        app: Any,
        *,
        max_header_bytes: int = 32 * 1024,
        client_timeout_s: float = 30.0,
        max_connections: int = 4096,
        **options: Any,
    ) -> None:
        super().__init__(app, **options)
        self.max_header_bytes = max_header_bytes
        self.client_timeout_s = client_timeout_s
        self.max_connections = max_connections


class _Rejected(Exception):
    """Raised from a parser callback to stop reading a request that breaks a limit."""


def error_bytes(error: GatewayError) -> bytes:
    """A whole HTTP/1.1 response reporting ``error`` (rendered in the one place errors are),
    closing the connection."""
    status, body, headers = render(error)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return b"%s%scontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        STATUS_LINE[status],
        head.encode("latin-1"),
        len(body),
        body,
    )


class _CoalescedWrites:
    """Stands in for the transport of a request's response cycle: writes made in one loop turn are
    joined and sent at the end of it; everything else is the real transport's."""

    __slots__ = ("_loop", "_parts", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._parts:
            self._loop.call_soon(self.flush)
        self._parts.append(data)

    def flush(self) -> None:
        if self._parts:
            data = b"".join(self._parts)
            self._parts = []
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head-size, request-time and connection-count limits."""

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._max_head = int(getattr(config, "max_header_bytes", 32 * 1024))
        self._timeout_s = float(getattr(config, "client_timeout_s", 30.0))
        self._max_connections = int(getattr(config, "max_connections", 4096))
        self._head_bytes = 0
        self._rejection: bytes | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._writes: _CoalescedWrites | None = None
        self._on_disconnect: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._max_connections:
            self.transport.abort()
            return
        self._writes = _CoalescedWrites(self.transport, self.loop)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        callback, self._on_disconnect = self._on_disconnect, None
        if callback is not None:
            callback()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.scope[ON_DISCONNECT] = self._notify_on_disconnect  # type: ignore[literal-required]
        self.scope[FLUSH] = self._flush  # type: ignore[literal-required]
        # The response cycle made here takes ``self.transport`` as its own: give it the coalescer.
        transport = self.transport
        if self._writes is not None:
            self.transport = self._writes  # type: ignore[assignment]
        try:
            super().on_headers_complete()
        finally:
            self.transport = transport

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        # A complete response leaves now, not at the end of the loop turn: by then the loop may
        # first read and handle what else arrived (the settlement's reply from Redis, say).
        self._flush()
        super().on_response_complete()

    def _notify_on_disconnect(self, callback: Callable[[], None] | None) -> None:
        self._on_disconnect = callback

    def shutdown(self) -> None:
        self._flush()
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this for any parser error, including the _Rejected raised in a callback.
        rejection, self._rejection = self._rejection, None
        self._close_with(rejection or error_bytes(InvalidRequest("the request is not valid HTTP")))

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self._max_head:
            message = f"the request line and headers are over {self._max_head} bytes"
            self._rejection = error_bytes(HeadersTooLarge(message))
            raise _Rejected

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self._timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self._flush()
            self.transport.close()
            return
        message = f"the request did not arrive within {self._timeout_s:g} s"
        self._close_with(error_bytes(RequestTimedOut(message)))

    def _flush(self) -> None:
        if self._writes is not None:
            self._writes.flush()

    def _close_with(self, response: bytes) -> None:
        self._disarm()
        self._flush()
        self.transport.write(response)
        self.transport.close()
