"""How the relay cuts a stream into writes: chunks that arrive after the upstream's end marker has
been seen go out with ``[DONE]``, in the response's last write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

from gateway.record import RequestRecord
from gateway.relay import LastEvents, OpenedStream, relay
from providers.base import Usage


class _Stream:
    """A chunk stream whose batches are given; ``ended`` is set as the batch at ``end`` is read."""

    def __init__(self, batches: list[list[bytes]], end: int) -> None:
        self._batches = batches
        self._end = end
        self.ended = False
        self.usage: Usage | None = Usage(3, 2)
        self.closed = False

    async def batches(self) -> AsyncIterator[list[bytes]]:
        for i, batch in enumerate(self._batches):
            if i == self._end:
                self.ended = True
            yield batch

    async def aclose(self) -> None:
        self.closed = True


async def _relayed(stream: _Stream) -> list[bytes]:
    batches = stream.batches()
    first = await anext(batches)
    # Settled already: the relay's own settlement has nothing left to do (covered end to end).
    request = SimpleNamespace(
        record=RequestRecord("req-1"),
        ticket=SimpleNamespace(settled=True),
        deadline=asyncio.get_running_loop().time() + 5,
    )
    opened = OpenedStream(cast(Any, stream), batches, first)
    return [chunk async for chunk in relay(opened, cast(Any, request))]


async def test_a_stream_that_arrived_whole_leaves_in_one_write_with_done() -> None:
    stream = _Stream([[b'{"a":1}', b'{"a":2}']], end=0)
    writes = await _relayed(stream)
    assert writes == [b'data: {"a":1}\n\ndata: {"a":2}\n\ndata: [DONE]\n\n']
    assert isinstance(writes[0], LastEvents)
    assert stream.closed


async def test_chunks_before_the_end_marker_leave_as_they_come() -> None:
    stream = _Stream([[b'{"a":1}'], [b'{"a":2}'], [b'{"a":3}']], end=2)
    writes = await _relayed(stream)
    assert writes == [b'data: {"a":1}\n\n', b'data: {"a":2}\n\n', b'data: {"a":3}\n\ndata: [DONE]\n\n']
    assert [isinstance(w, LastEvents) for w in writes] == [False, False, True]
