"""The one small interface every upstream adapter implements, and the values that cross it.

The gateway hands an adapter a :class:`ChatCall` (the client's body, untouched, plus the few
fields the gateway decoded) and gets back OpenAI Chat Completions bytes: a whole
:class:`Completion`, or a :class:`ChunkStream` of ``chat.completion.chunk`` payloads. Adapters
raise only :class:`gateway.errors.UpstreamFailure` subclasses, translated at their edge.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Protocol

import msgspec


class Usage(msgspec.Struct, frozen=True):
    """Token usage as the upstream reported it (or the gateway estimated it)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class Message(msgspec.Struct, frozen=True):
    """The parts of a chat message the gateway reads; everything else passes through."""

    role: str
    content: str | list[msgspec.Raw] | None = None


class ChatHead(msgspec.Struct, frozen=True):
    """The fields of a Chat Completions request the gateway reads; the rest is passed through."""

    model: str
    messages: list[Message]
    stream: bool | None = False
    # At least 1: a zero or negative limit would make the request's reservation (prompt estimate
    # plus this) negative, crediting the tpm bucket and the budget instead of charging them.
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    stream_options: StreamOptions | msgspec.UnsetType | None = msgspec.UNSET

    @property
    def include_usage(self) -> bool:
        """Whether the client asked for the usage chunk of a stream."""
        return isinstance(self.stream_options, StreamOptions) and self.stream_options.include_usage

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


@dataclass(slots=True)
class ChatCall:
    """One upstream attempt: what to send and to which upstream model."""

    body: bytes
    head: ChatHead
    upstream_model: str
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def renames_model(self) -> bool:
        return self.upstream_model != self.head.model


async def each_chunk(stream: ChunkStream) -> AsyncIterator[bytes]:
    """The chunks of ``stream`` one by one: ``__aiter__`` for adapters that produce batches."""
    async for batch in stream.batches():
        for chunk in batch:
            yield chunk


@dataclass(slots=True)
class Completion:
    """A whole ``chat.completion`` body, ready to send to the client."""

    body: bytes
    usage: Usage | None


class ChunkStream(Protocol):
    """An opened upstream stream of ``chat.completion.chunk`` JSON payloads.

    :meth:`batches` yields, each time the upstream has sent something, every chunk that has
    arrived complete (never an empty list), so a relay writes them in one go rather than one
    write per chunk; iterating the stream itself yields the chunks one by one.

    ``usage`` is set once the upstream has reported it (normally with the last chunk). A usage-only
    chunk is yielded only when the client asked for it. Iteration ends after the upstream's
    end-of-stream marker; a stream that breaks off raises an ``UpstreamFailure``.
    """

    usage: Usage | None
    ended: bool
    """The upstream's end marker has arrived: the batches yielded so far are all there is."""

    def batches(self) -> AsyncIterator[list[bytes]]: ...

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


class Provider(Protocol):
    """An upstream model provider."""

    async def complete(self, call: ChatCall) -> Completion:
        """Make one non-streaming call."""
        ...

    async def stream(self, call: ChatCall) -> ChunkStream:
        """Open a streaming call; failures before the stream begins are raised here."""
        ...

    async def aclose(self) -> None:
        """Release pooled connections."""
        ...
