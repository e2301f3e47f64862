"""Bare ASGI 3 plumbing for the mock upstream, so it needs no web framework and stays fast.

The mock server answers load tests, so its hot path is a handful of ``send`` calls. This module
holds the few pieces a framework would otherwise provide: the ASGI types, reading a request body,
sending whole responses, and two things a fault injector needs that ASGI has no word for:

* :class:`Watch` -- waiting (a hang, a stall, a pause between chunks) that ends cleanly when the
  client disconnects or the server shuts down, so no task outlives its request;
* :func:`abort_connection` -- closing the connection in the middle of a response on purpose,
  without uvicorn logging it as an application bug.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from types import TracebackType
from typing import Any, Literal

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

Ending = Literal["disconnect", "shutdown"]

JSON = b"application/json"
SSE_HEADERS: Headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


async def read_body(receive: Receive) -> bytes:
    """The whole request body."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    parts = [body]
    while message.get("more_body"):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        parts.append(message.get("body", b""))
    return b"".join(parts)


async def start(send: Send, status: int, headers: Headers) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})


async def send_chunk(send: Send, body: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more})


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: bytes = JSON, extra: Headers | None = None
) -> None:
    """A whole response with a ``content-length``."""
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    if extra:
        headers.extend(extra)
    await start(send, status, headers)
    await send_chunk(send, body, more=False)


def header_dict(headers: Headers) -> dict[str, str]:
    """ASGI headers as a dict (names are already lower-case; a repeated name keeps its last value)."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}


async def lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge startup and shutdown; the mock has nothing to set up."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class Watchers:
    """Every request currently waiting on its client, so a server shutdown can release them all."""

    def __init__(self) -> None:
        self._active: set[Watch] = set()
        self.closing = False

    def watch(self, receive: Receive) -> Watch:
        return Watch(receive, self)

    def add(self, watch: Watch) -> None:
        self._active.add(watch)
        if self.closing:
            watch.release("shutdown")

    def discard(self, watch: Watch) -> None:
        self._active.discard(watch)

    def close(self) -> None:
        """Release every waiting request now, and any that starts waiting later."""
        self.closing = True
        for watch in list(self._active):
            watch.release("shutdown")

    def __len__(self) -> int:
        return len(self._active)


class Watch:
    """Watches one request, while it waits, for its client's disconnect or the server's shutdown.

    Used as ``async with watchers.watch(receive) as watch:``; inside, :meth:`sleep` and :meth:`hold`
    return early once the request has ended, and leaving the block stops the watching task.
    """

    def __init__(self, receive: Receive, registry: Watchers) -> None:
        self._receive = receive
        self._registry = registry
        self._ended: asyncio.Future[Ending] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task[None] | None = None

    @property
    def ending(self) -> Ending | None:
        """Why the request ended, or ``None`` while it is live."""
        return self._ended.result() if self._ended.done() else None

    def release(self, why: Ending) -> None:
        if not self._ended.done():
            self._ended.set_result(why)

    async def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; whether the request is still live afterwards."""
        await asyncio.wait({self._ended}, timeout=seconds)
        return not self._ended.done()

    async def hold(self) -> Ending:
        """Wait until the client disconnects or the server shuts down."""
        await asyncio.wait({self._ended})
        return self._ended.result()

    async def _until_disconnect(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.release("disconnect")

    async def __aenter__(self) -> Watch:
        self._task = asyncio.create_task(self._until_disconnect())
        self._registry.add(self)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._registry.discard(self)
        task = self._task
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled():
            task.result()


_ABORTING: contextvars.ContextVar[bool] = contextvars.ContextVar("mock_aborting", default=False)
_INCOMPLETE = "ASGI callable returned without completing response."


class _AbortFilter(logging.Filter):
    """Drops uvicorn's complaint about an unfinished response when the mock broke it on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_ABORTING.get() and record.msg == _INCOMPLETE)


_ABORT_FILTER = _AbortFilter()


def install_abort_filter() -> None:
    """Make :func:`abort_connection` quiet (idempotent)."""
    logging.getLogger("uvicorn.error").addFilter(_ABORT_FILTER)


def abort_connection() -> None:
    """Mark this response as deliberately unfinished: return from the app right after calling it.

    uvicorn closes the connection when an app returns mid-response, which is exactly the fault to
    inject. The mark lives in the request task's context, where uvicorn logs its complaint.
    """
    _ABORTING.set(True)
