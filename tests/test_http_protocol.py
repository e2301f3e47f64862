"""The gateway's server protocol: the writes of a loop turn coalesced into one."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from gateway.http_protocol import _CoalescedWrites


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
