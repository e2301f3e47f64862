"""What the HTTP adapters share: the pooled client, the error translation edge, SSE framing.

Upstream failures are translated here, in one place, from exception types and status codes
(never from message text), into :mod:`gateway.errors` classes that say whether a retry may help
and whether the failure counts against the target's circuit breaker.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import contextmanager

import httpx

from gateway.config import ProviderConfig
from gateway.errors import (
    UpstreamError,
    UpstreamFailure,
    UpstreamRateLimited,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)

MAX_RESPONSE_BYTES = 32 * 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024
MAX_EVENT_BYTES = 4 * 1024 * 1024


def make_client(config: ProviderConfig, headers: dict[str, str]) -> httpx.AsyncClient:
    """One pooled keep-alive client per provider, with explicit timeouts."""
    timeout = httpx.Timeout(
        connect=config.connect_timeout_s,
        read=config.read_timeout_s,
        write=config.read_timeout_s,
        pool=config.connect_timeout_s,
    )
    limits = httpx.Limits(
        max_connections=config.max_connections,
        max_keepalive_connections=config.max_connections,
        keepalive_expiry=30.0,
    )
    return httpx.AsyncClient(
        base_url=(config.base_url or "").rstrip("/"),
        headers=headers,
        timeout=timeout,
        limits=limits,
        follow_redirects=False,
        trust_env=False,
    )


@contextmanager
def transport_errors() -> Iterator[None]:
    """Translate httpx transport exceptions into upstream failures."""
    try:
        yield
    except httpx.TimeoutException as exc:
        connect = isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout)
        what = "connecting to" if connect else "waiting for"
        raise UpstreamTimeout(f"timed out {what} the upstream", retryable=True, breaker_failure=True) from exc
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
        raise UpstreamUnavailable(
            "could not connect to the upstream", retryable=True, breaker_failure=True
        ) from exc
    except httpx.TransportError as exc:
        raise UpstreamError(
            "the upstream connection failed mid-response", retryable=True, breaker_failure=True
        ) from exc


def failure_for_status(status: int, headers: httpx.Headers, body: bytes) -> UpstreamFailure:
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
    client: httpx.AsyncClient, request: httpx.Request, reshape: Callable[[bytes, int], bytes] | None = None
) -> httpx.Response:
    """Send ``request`` (streaming); any status but 200 becomes its ``UpstreamFailure``.

    ``reshape`` turns a passed-back 4xx body into OpenAI's error form, for upstreams that speak
    another dialect.
    """
    with transport_errors():
        response = await client.send(request, stream=True)
    if response.status_code == 200:
        return response
    try:
        body = await read_bounded(response, MAX_ERROR_BYTES)
    except UpstreamError:
        body = b""
    finally:
        await response.aclose()
    failure = failure_for_status(response.status_code, response.headers, body)
    if reshape is not None and isinstance(failure, UpstreamRejected):
        status = failure.upstream_status
        failure = UpstreamRejected(status, reshape(failure.upstream_body, status))
    raise failure


def parse_retry_after(headers: httpx.Headers) -> float | None:
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


async def read_bounded(response: httpx.Response, limit: int) -> bytes:
    """The response body, or an ``UpstreamError`` when it is larger than ``limit``."""
    parts: list[bytes] = []
    size = 0
    with transport_errors():
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise UpstreamError(f"the upstream response exceeded {limit} bytes")
            parts.append(chunk)
    return b"".join(parts)


async def sse_data(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """The ``data`` payload of each server-sent event, as soon as its event is complete.

    Comments and other fields are skipped; multi-line data is joined with newlines. An event
    larger than ``MAX_EVENT_BYTES`` is an ``UpstreamError``.
    """
    buffer = b""
    with transport_errors():
        async for chunk in response.aiter_bytes():
            buffer += chunk
            if b"\r" in buffer:
                buffer = buffer.replace(b"\r\n", b"\n")
            while True:
                end = buffer.find(b"\n\n")
                if end < 0:
                    break
                event, buffer = buffer[:end], buffer[end + 2 :]
                data = _event_data(event)
                if data is not None:
                    yield data
            if len(buffer) > MAX_EVENT_BYTES:
                raise UpstreamError("the upstream sent an oversized stream event")
    # An event missing only its closing blank line still counts, and so does a bare end marker;
    # one cut off mid-line is dropped, as the SSE rules say, so the reader sees a truncated
    # stream rather than a broken chunk.
    data = _event_data(buffer)
    if data is not None and (buffer.endswith(b"\n") or data == b"[DONE]"):
        yield data


def _event_data(event: bytes) -> bytes | None:
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return lines[0] if len(lines) == 1 else b"\n".join(lines)
