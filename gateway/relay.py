"""Relaying a stream: open it and read its first chunk, then pass chunks on as they arrive.

The first chunk is read before the response starts, so a failure before any byte reaches the
client is still a proper error status (and may be retried). After that a failure ends the stream
with ``data: {"error": ...}`` and ``data: [DONE]``; nothing retries it. The request is settled
before the last event goes out, so a client that sees ``[DONE]`` finds its slot already free.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio

from gateway import observe
from gateway.errors import UpstreamFailure, UpstreamTimeout, stream_error_event
from policies.routing import Target
from providers.base import ChatCall, ChunkStream

if TYPE_CHECKING:
    from gateway.chat import AdmittedRequest

log = logging.getLogger("modelgate.request")


@dataclass(slots=True)
class StreamReply:
    """An opened stream: the SSE bytes to relay."""

    events: AsyncIterator[bytes]


@dataclass(slots=True)
class OpenedStream:
    """An upstream stream whose first chunks (None: it had none) have already arrived."""

    stream: ChunkStream
    batches: AsyncIterator[list[bytes]]
    first: list[bytes] | None


def deadline_passed(*, breaker_failure: bool = True) -> UpstreamTimeout:
    """The failure of an upstream call cut by the request's deadline."""
    return UpstreamTimeout("the request deadline passed", breaker_failure=breaker_failure)


async def open_stream(target: Target, call: ChatCall, deadline: float) -> OpenedStream:
    """Open a stream and read its first chunks, all before the deadline."""
    try:
        async with asyncio.timeout_at(deadline):
            stream = await target.provider.stream(call)
    except TimeoutError:
        raise deadline_passed() from None
    batches = stream.batches()
    try:
        async with asyncio.timeout_at(deadline):
            first = await anext(batches, None)
    except TimeoutError:
        await stream.aclose()
        raise deadline_passed() from None
    except BaseException:
        await stream.aclose()
        raise
    return OpenedStream(stream, batches, first)


async def relay(opened: OpenedStream, request: AdmittedRequest) -> AsyncIterator[bytes]:
    """SSE events for the client, sent as soon as their upstream chunks arrive.

    Chunks that arrived together go out in one write.
    """
    record, relayed = request.record, 0
    stream, batches = opened.stream, opened.batches
    try:
        batch = opened.first
        while batch is not None:
            yield b"".join([b"data: %s\n\n" % chunk for chunk in batch])
            relayed += len(batch)
            try:
                async with asyncio.timeout_at(request.deadline):
                    batch = await anext(batches, None)
            except TimeoutError:
                raise deadline_passed(breaker_failure=False) from None
        await _finish(stream, request, relayed)
        yield b"data: [DONE]\n\n"
    except UpstreamFailure as failure:
        record.failed(failure, failure.status)
        log.warning("stream cut", extra={"fields": {"request_id": record.request_id, "error": failure.code}})
        if record.target is not None:
            request.upstream_answered = not failure.breaker_failure
            await request.limiter.failed(request.ticket, record.target, failure)
        await _finish(stream, request, relayed)
        yield stream_error_event(failure)
    finally:
        # A client that left cancels the response task; settling must still happen (the slot,
        # the tokens, the accounting), so it runs shielded from that cancellation.
        with anyio.CancelScope(shield=True):
            await _finish(stream, request, relayed)
        record.emit()


async def _finish(stream: ChunkStream, request: AdmittedRequest, relayed: int) -> None:
    """Close the upstream stream and settle (once) to its usage, or to the chunks relayed."""
    await stream.aclose()
    await observe.settle(request, stream.usage, relayed)
