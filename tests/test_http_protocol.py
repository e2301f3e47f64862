"""The gateway's server protocol: writes of a loop turn coalesced, with ``flush_first`` ahead of them."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from gateway import http_protocol
from gateway.config import parse_config
from gateway.http_protocol import _CoalescedWrites, flush_first
from gateway.runtime import Gateway
from tests.harness import RedisServer


def _pending(peer: socket.socket) -> bytes:
    """What has arrived at ``peer`` so far, without waiting."""
    try:
        return peer.recv(65536, socket.MSG_DONTWAIT)
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


async def test_writes_of_one_turn_go_out_together_after_the_flush_first_hooks(
    connection: tuple[_CoalescedWrites, socket.socket],
) -> None:
    writes, peer = connection
    hook_saw: list[bytes] = []
    undo = flush_first(lambda: hook_saw.append(_pending(peer)))
    try:
        writes.write(b"head ")
        writes.write(b"body")
        assert _pending(peer) == b""  # nothing leaves before the end of the turn
        assert await _received(peer, 9) == b"head body"
        assert hook_saw == [b""]  # the hook ran once, before the client's bytes were written
        await asyncio.sleep(0)
        assert hook_saw == [b""]  # and not again with nothing to write
    finally:
        undo()


async def test_an_undone_hook_is_not_called(connection: tuple[_CoalescedWrites, socket.socket]) -> None:
    writes, peer = connection
    calls: list[str] = []
    undo = flush_first(lambda: calls.append("called"))
    undo()
    undo()  # twice is harmless
    writes.write(b"x")
    assert await _received(peer, 1) == b"x"
    assert calls == []


async def test_a_gateway_with_redis_flushes_its_queued_commands_first_while_it_runs(
    redis_server: RedisServer,
) -> None:
    config = parse_config(
        f"""
[redis]
url = "{redis_server.url}"
prefix = "flush-first"

[[providers]]
name = "local"
type = "mock"

[[models]]
name = "mock"
targets = [{{ provider = "local", model = "mock" }}]

[[tenants]]
name = "acme"
keys = ["sk-flush-first-0123456789"]
""",
        {},
    )
    gateway = Gateway.build(config)
    await gateway.start()
    try:
        assert gateway.limiter.flush in http_protocol._FLUSH_FIRST
    finally:
        await gateway.aclose()
    assert gateway.limiter.flush not in http_protocol._FLUSH_FIRST
