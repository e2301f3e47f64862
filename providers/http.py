"""What the HTTP adapters share: the connection pool, the status translation edge, SSE framing.

Upstream failures are translated in two places only, never from message text: transport failures
in :mod:`providers.pool`, error statuses here. Both become :mod:`gateway.errors` classes that say
whether a retry may help and whether the failure counts against the target's circuit breaker.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping

from gateway.config import ProviderConfig
from gateway.errors import (
    UpstreamError,
    UpstreamFailure,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamUnavailable,
)
from providers.base import Usage, each_chunk
from providers.pool import UpstreamPool, UpstreamResponse

MAX_RESPONSE_BYTES = 32 * 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024
MAX_EVENT_BYTES = 4 * 1024 * 1024


def make_pool(config: ProviderConfig, headers: dict[str, str]) -> UpstreamPool:
    """One pool of keep-alive connections per provider, with its timeouts and size."""
    return UpstreamPool(
        config.base_url or "",
        headers,
        connect_timeout_s=config.connect_timeout_s,
        read_timeout_s=config.read_timeout_s,
        max_connections=config.max_connections,
        secret=config.api_key.reveal() if config.api_key is not None else None,
    )


def failure_for_status(status: int, headers: Mapping[str, str], body: bytes) -> UpstreamFailure:
    """The failure an upstream error status stands for; ``body`` is passed back only for client 4xx."""
    retry_after = parse_retry_after(headers)
    if status == 429:
        return UpstreamRateLimited("the upstream is rate limiting", retryable=True, retry_after_s=retry_after)
    if status in (408, 409):
        return UpstreamUnavailable(
            f"the upstream answered {status}",
            retryable=True,
            breaker_failure=status == 408,
            retry_after_s=retry_after,
        )
    if status in (401, 403):
        return UpstreamError(f"the upstream refused the gateway's credentials ({status})")
    if 400 <= status < 500:
        return UpstreamRejected(status, body)
    if status >= 500:
        return UpstreamUnavailable(
            f"the upstream answered {status}", retryable=True, breaker_failure=True, retry_after_s=retry_after
        )
    return UpstreamError(f"the upstream answered an unexpected status {status}")


async def send_ok(
    pool: UpstreamPool,
    path: str,
    body: bytes,
    headers: dict[str, str],
    reshape: Callable[[bytes, int], bytes] | None = None,
) -> UpstreamResponse:
    """POST ``body`` to ``path``; any status but 200 becomes its ``UpstreamFailure``.

    ``reshape`` turns a passed-back 4xx body into OpenAI's error form, for upstreams that speak
    another dialect.
    """
    response = await pool.post(path, body, headers)
    if response.status == 200:
        return response
    try:
        error_body = await response.read(MAX_ERROR_BYTES)
    except UpstreamError:
        error_body = b""
    finally:
        await response.aclose()
    if pool.secret and pool.secret in error_body:
        # An upstream that quotes the credentials it received must not hand them to the tenant.
        error_body = error_body.replace(pool.secret, b"[redacted]")
    failure = failure_for_status(response.status, response.headers, error_body)
    if reshape is not None and isinstance(failure, UpstreamRejected):
        status = failure.upstream_status
        failure = UpstreamRejected(status, reshape(failure.upstream_body, status))
    raise failure


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from ``retry-after-ms`` or ``retry-after`` (delta seconds); None if absent or odd."""
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            continue
        if 0 <= seconds < 3600:
            return seconds
    return None


class SSEParser:
    """The ``data`` payloads of server-sent events, split out of a body fed piece by piece.

    :meth:`feed` returns every event a piece completed, so events that arrive together travel
    together. Comments and other fields are skipped; multi-line data is joined with newlines. An
    event larger than ``MAX_EVENT_BYTES`` is an ``UpstreamError``, raised at the next call, so the
    events completed before it still go out first.
    """

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, piece: bytes) -> list[bytes]:
        """The data of every event ``piece`` completed (often none)."""
        self._check()
        buffer = self._buffer + piece if self._buffer else piece
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        events = buffer.split(b"\n\n")
        self._buffer = events.pop()
        batch: list[bytes] = []
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                batch.append(event[6:])  # the usual event: one data line
            elif (data := _event_data(event)) is not None:
                batch.append(data)
        return batch

    def end(self) -> list[bytes]:
        """The body is over: the data of a last event missing only its closing blank line, if any.

        A bare end marker counts too; an event cut off mid-line is dropped, as the SSE rules say,
        so the reader sees a truncated stream rather than a broken chunk.
        """
        self._check()
        buffer, self._buffer = self._buffer, b""
        data = _event_data(buffer)
        if data is not None and (buffer.endswith(b"\n") or data == b"[DONE]"):
            return [data]
        return []

    def _check(self) -> None:
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise UpstreamError("the upstream sent an oversized stream event")


class SSEChunkStream:
    """An upstream SSE stream relayed as batches of ``chat.completion.chunk`` payloads, as it arrives.

    Adapters say what one event becomes (:meth:`convert`) and set ``ended`` at their end marker;
    the batching is here. Chunks that came before a failing event in the same read still go out
    before the failure is raised. A stream that stops without its end marker is an
    ``UpstreamError`` (``missing_end``).
    """

    missing_end = "the upstream stream ended early"

    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response
        self.usage: Usage | None = None
        self.ended = False

    def convert(self, data: bytes) -> list[bytes]:
        """The chunks one event's data becomes; raises ``UpstreamError`` for an unusable one."""
        raise NotImplementedError

    async def batches(self) -> AsyncGenerator[list[bytes], None]:
        # The body is read with ``receive`` rather than an async generator of its own: a generator
        # left suspended at the end marker would be finalized through the event loop's asyncgen
        # hook (a task and a wake-up of the loop per stream).
        parser, response = SSEParser(), self._response
        while True:
            piece = await response.receive()
            batch = parser.feed(piece) if piece is not None else parser.end()
            chunks: list[bytes] = []
            failure: UpstreamError | None = None
            for data in batch:
                try:
                    chunks += self.convert(data)
                except UpstreamError as exc:
                    failure = exc
                    break
                if self.ended:
                    break
            if chunks:
                yield chunks
            if failure is not None:
                raise failure
            if self.ended:
                return
            if piece is None:
                raise UpstreamError(self.missing_end, retryable=True, breaker_failure=True)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return each_chunk(self)

    async def aclose(self) -> None:
        # After the end marker the body's last bytes may still be on their way: read them in the
        # background so the connection can be kept.
        await self._response.aclose(finish=self.ended)


def _event_data(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the usual event: one data line
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return lines[0] if len(lines) == 1 else b"\n".join(lines)
