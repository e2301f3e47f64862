"""How the mock upstream answers a chat request in each fault mode, for either wire dialect.

End-to-end tests point the gateway at the mock and switch ``mode`` to make the upstream misbehave
the ways real ones do: error statuses, hanging before the first byte, non-JSON answers, streams
that stall or connections that drop mid-body, and slow streams (``chunk_delay_ms``). Every wait
goes through a :class:`~loadtest.mock_asgi.Watch`, so it ends when the client gives up or the
server shuts down instead of leaking a task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from loadtest.mock_asgi import (
    JSON,
    SSE_HEADERS,
    Receive,
    Send,
    Watch,
    Watchers,
    abort_connection,
    send_bytes,
    send_chunk,
    start,
)
from loadtest.mock_settings import MockSettings
from loadtest.mock_wire import Dialect, Reply

GARBAGE_BODY = b"<html>this is not json</html>"
GARBAGE_EVENT = b"data: not json\n\n"


@dataclass(slots=True)
class Exchange:
    """One chat request being answered."""

    send: Send
    receive: Receive
    watchers: Watchers
    dialect: Dialect
    reply: Reply
    settings: MockSettings

    def watch(self) -> Watch:
        return self.watchers.watch(self.receive)


async def send_error(send: Send, dialect: Dialect, status: int, message: str) -> None:
    """An error in the dialect's shape; a 429 carries ``retry-after: 1``."""
    extra = [(b"retry-after", b"1")] if status == 429 else None
    await send_bytes(send, status, dialect.error_body(status, message), extra=extra)


async def answer(exchange: Exchange) -> None:
    """Answer as the current mode says."""
    await _MODES[exchange.settings.mode](exchange)


async def _ok(ex: Exchange) -> None:
    reply = ex.reply
    if not reply.stream:
        await send_bytes(ex.send, 200, reply.body)
        return
    await start(ex.send, 200, SSE_HEADERS)
    if ex.settings.chunk_delay_ms <= 0:
        await send_chunk(ex.send, b"".join(reply.events), more=False)
        return
    async with ex.watch() as watch:
        if await _send_events(ex, watch, reply.events):
            await send_chunk(ex.send, b"", more=False)


async def _send_events(ex: Exchange, watch: Watch, events: tuple[bytes, ...]) -> bool:
    """Send ``events`` ``chunk_delay_ms`` apart; ``False`` if the client left meanwhile.

    Once the server is shutting down the pauses are skipped, so the stream still finishes.
    """
    delay = ex.settings.chunk_delay_ms / 1000
    for i, event in enumerate(events):
        if i and delay > 0 and not await watch.sleep(delay) and watch.ending == "disconnect":
            return False
        await send_chunk(ex.send, event)
    return True


async def _status(ex: Exchange) -> None:
    status = ex.settings.status
    await send_error(ex.send, ex.dialect, status, f"mock upstream fault: status {status}")


async def _hang(ex: Exchange) -> None:
    async with ex.watch() as watch:
        if await watch.hold() == "shutdown":
            await send_error(ex.send, ex.dialect, 503, "mock upstream shutting down")


async def _garbage(ex: Exchange) -> None:
    if not ex.reply.stream:
        await send_bytes(ex.send, 200, GARBAGE_BODY)
        return
    await start(ex.send, 200, SSE_HEADERS)
    await send_chunk(ex.send, GARBAGE_EVENT * ex.settings.chunks, more=False)


async def _send_part(ex: Exchange, watch: Watch) -> None:
    """Headers and the first part of the reply: ``stall_after`` events, or half the body."""
    reply = ex.reply
    if reply.stream:
        await start(ex.send, 200, SSE_HEADERS)
        await _send_events(ex, watch, reply.events[: ex.settings.stall_after])
        return
    body = reply.body
    await start(ex.send, 200, [(b"content-type", JSON), (b"content-length", b"%d" % len(body))])
    await send_chunk(ex.send, body[: len(body) // 2])


async def _stall(ex: Exchange) -> None:
    async with ex.watch() as watch:
        await _send_part(ex, watch)
        if await watch.hold() == "shutdown":
            abort_connection()


async def _close_mid_body(ex: Exchange) -> None:
    async with ex.watch() as watch:
        await _send_part(ex, watch)
    abort_connection()


_MODES: dict[str, Callable[[Exchange], Awaitable[None]]] = {
    "ok": _ok,
    "status": _status,
    "hang": _hang,
    "garbage": _garbage,
    "stall": _stall,
    "close_mid_body": _close_mid_body,
}
