"""What the HTTP adapters share: the connection pool, the status translation edge, SSE framing.

Upstream failures are translated in two places only, never from message text: transport failures
in :mod:`providers.pool`, error statuses here. Both become :mod:`gateway.errors` classes that say
whether a retry may help and whether the failure counts against the target's circuit breaker.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, Callable, Mapping

from gateway.config import ProviderConfig
from gateway.errors import (
    UpstreamError,
    UpstreamFailure,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamUnavailable,
)
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


async def sse_batches(body: AsyncIterable[bytes]) -> AsyncGenerator[list[bytes], None]:
    """The ``data`` payloads of the server-sent events in ``body``: after each piece of it, every
    event it completed (never an empty list), so events that arrive together travel together.

    Comments and other fields are skipped; multi-line data is joined with newlines. An event
    larger than ``MAX_EVENT_BYTES`` is an ``UpstreamError``.
    """
    buffer = b""
    async for piece in body:
        buffer += piece
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        batch: list[bytes] = []
        while (end := buffer.find(b"\n\n")) >= 0:
            data = _event_data(buffer[:end])
            buffer = buffer[end + 2 :]
            if data is not None:
                batch.append(data)
        if batch:
            yield batch
        if len(buffer) > MAX_EVENT_BYTES:
            raise UpstreamError("the upstream sent an oversized stream event")
    # An event missing only its closing blank line still counts, and so does a bare end marker;
    # one cut off mid-line is dropped, as the SSE rules say, so the reader sees a truncated
    # stream rather than a broken chunk.
    data = _event_data(buffer)
    if data is not None and (buffer.endswith(b"\n") or data == b"[DONE]"):
        yield [data]


async def sse_data(body: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    """The ``data`` payload of each server-sent event, one by one (see :func:`sse_batches`)."""
    async for batch in sse_batches(body):
        for data in batch:
            yield data


def _event_data(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the usual event: one data line
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return lines[0] if len(lines) == 1 else b"\n".join(lines)
