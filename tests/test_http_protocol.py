"""The gateway's server protocol: the writes of a loop turn coalesced into one, a complete
response written at once, and ``FLUSH``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvicorn

from gateway.http_protocol import FLUSH, GatewayHttpProtocol, GatewayServerConfig, _CoalescedWrites


def _pending(peer: socket.socket) -> bytes:
    """What has arrived at ``peer`` so far, without waiting."""
    try:
        return peer.recv(65536, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def _peek(peer: socket.socket) -> bytes:
    """What has arrived at ``peer`` so far, left there to be read."""
    try:
        return peer.recv(65536, socket.MSG_DONTWAIT | socket.MSG_PEEK)
    except BlockingIOError:
        return b""


async def _received(peer: socket.socket, size: int) -> bytes:
    data = b""
    deadline = asyncio.get_running_loop().time() + 2.0
    while len(data) < size:
        assert asyncio.get_running_loop().time() < deadline, f"only {data!r} arrived"
        data += _pending(peer)
        await asyncio.sleep(0.001)
    return data


@pytest.fixture
async def connection() -> AsyncIterator[tuple[_CoalescedWrites, socket.socket]]:
    """A coalescing writer over one end of a socket pair, and the other end to read from."""
    loop = asyncio.get_running_loop()
    ours, peer = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    yield _CoalescedWrites(transport, loop), peer  # type: ignore[arg-type]
    transport.close()
    peer.close()


async def test_writes_of_one_turn_go_out_together_at_its_end(
    connection: tuple[_CoalescedWrites, socket.socket],
) -> None:
    writes, peer = connection
    writes.write(b"head ")
    writes.write(b"body")
    assert _pending(peer) == b""  # nothing leaves before the end of the turn
    assert await _received(peer, 9) == b"head body"
    writes.write(b"next")  # a later turn's writes are their own
    assert await _received(peer, 4) == b"next"


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@contextlib.asynccontextmanager
async def _server(app: App) -> AsyncIterator[int]:
    """The gateway's server protocol serving ``app`` on a free port, in this event loop."""
    config = GatewayServerConfig(
        app, host="127.0.0.1", port=0, http=GatewayHttpProtocol, lifespan="off", log_config=None
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    deadline = asyncio.get_running_loop().time() + 5.0
    while not server.started:
        assert asyncio.get_running_loop().time() < deadline, "the server did not start"
        await asyncio.sleep(0.005)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


async def _exchange(app: App) -> bytes:
    """Send one GET to ``app`` from a plain socket; returns the whole answer."""
    async with _server(app) as port:
        client = socket.create_connection(("127.0.0.1", port))
        clients.append(client)
        try:
            client.sendall(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")  # keep-alive: no close to flush
            data = b""
            deadline = asyncio.get_running_loop().time() + 5.0
            while not data.endswith(b"0\r\n\r\n") and not data.endswith(b"done"):
                assert asyncio.get_running_loop().time() < deadline, f"only {data!r} arrived"
                data += _pending(client)
                await asyncio.sleep(0.001)
            return data
        finally:
            clients.clear()
            client.close()


clients: list[socket.socket] = []
"""The test's client socket, for the app to look at in the middle of its turn."""


async def test_a_complete_response_leaves_before_its_turn_ends() -> None:
    seen: list[bytes] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        seen.append(_peek(clients[0]))  # a head alone waits for its body
        await send({"type": "http.response.body", "body": b"done"})
        seen.append(_peek(clients[0]))  # the response is complete: it has left, turn or not

    answer = await _exchange(app)
    assert seen[0] == b""
    assert seen[1].startswith(b"HTTP/1.1 200 OK") and seen[1].endswith(b"\r\n\r\ndone")
    assert answer == seen[1]


async def test_flush_sends_what_a_stream_has_written_so_far() -> None:
    seen: list[bytes] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        seen.append(_peek(clients[0]))  # coalesced until the turn's end...
        scope[FLUSH]()
        seen.append(_peek(clients[0]))  # ...unless flushed
        await send({"type": "http.response.body", "body": b"last", "more_body": False})

    answer = await _exchange(app)
    assert seen[0] == b""
    assert seen[1].startswith(b"HTTP/1.1 200 OK") and seen[1].endswith(b"5\r\nfirst\r\n")
    assert answer.endswith(b"4\r\nlast\r\n0\r\n\r\n")
