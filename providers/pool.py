"""A lean HTTP/1.1 keep-alive client for upstream calls: the one socket edge of the adapters.

Why not httpx: every gateway request makes one upstream call, and measured on the 2-core
benchmark machine one POST to a local upstream cost 1.33 ms of CPU through ``httpx`` and 0.80 ms
through ``httpcore`` alone (its pool re-checks every pooled connection on each request), against
0.09 ms over plain asyncio streams. That client was most of the gateway's own overhead. This module
does only what the adapters need, over asyncio streams with ``httptools`` (llhttp) parsing:

- ``POST`` a body to one origin (``http`` or ``https``), keep-alive connections reused last-in
  first-out, at most ``max_connections`` open, idle ones dropped after ``keepalive_s``;
- a connect timeout (also bounding the wait for a free connection) and a read timeout that bounds
  the wait for the response head and then for each piece of the body, so a stalled stream is cut;
- the status, the headers and the body as it arrives (chunked, sized or delimited by close);
- a reused connection that turns out to have been closed by the server before it answered is
  replaced once by a new one, as keep-alive clients do; any other failure is the caller's.

Not supported, on purpose: redirects, proxies, cookies, compression (it asks for ``identity``
and refuses an encoded body), ``Expect: 100-continue``, HTTP/2. Transport failures are raised as
:mod:`gateway.errors` upstream failures here, so the adapters translate only status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from gateway.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable

READ_SIZE = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
FINISH_S = 1.0
FINISH_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a pool connects, from a provider's ``base_url``."""

    scheme: str
    host: str
    port: int
    path: str  # the base path, without a trailing slash

    @classmethod
    def parse(cls, base_url: str) -> Origin:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


class _ServerClosed(Exception):
    """The server closed the connection before sending any part of a response."""


def _timeout() -> UpstreamTimeout:
    return UpstreamTimeout("timed out waiting for the upstream", retryable=True, breaker_failure=True)


class _PastTheEnd(Exception):
    """Raised in a parser callback to stop parsing: the head is too large, or the response is over."""


def _tls_context() -> ssl.SSLContext:
    try:
        import certifi  # installed with httpx; the same CA bundle the SDKs use
    except ImportError:  # pragma: no cover - then the system's store
        return ssl.create_default_context()
    return ssl.create_default_context(cafile=certifi.where())


class _Connection:
    """One keep-alive connection and the parser of the response currently on it."""

    __slots__ = (
        "chunks",
        "complete",
        "deadline",
        "ends_at_close",
        "head_bytes",
        "head_too_large",
        "headers",
        "headers_done",
        "idle_since",
        "informational",
        "keep_alive",
        "parser",
        "reader",
        "received",
        "timed_out",
        "writer",
    )

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0
        self.deadline = 0.0  # when the current wait for the upstream times out (0: not waiting)
        self.timed_out = False
        self.reset()

    def reset(self) -> None:
        """Ready for the next response on this connection."""
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.informational = False
        self.ends_at_close = True
        self.keep_alive = False
        self.received = False
        self.head_bytes = 0
        self.head_too_large = False

    # httptools callbacks. One raising stops the parser (feed_data raises HttpParserError).
    def on_message_begin(self) -> None:
        if self.complete:  # bytes past the end of the response: not part of it
            raise _PastTheEnd

    def on_status(self, status: bytes) -> None:
        self._count(len(status) + 16)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        if key in ("content-length", "transfer-encoding"):
            self.ends_at_close = False
        previous = self.headers.get(key)
        self.headers[key] = text if previous is None else f"{previous}, {text}"

    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() < 200:  # 1xx (RFC 9110 15.2): skipped, the real head follows
            self.informational = True
            self.headers = {}
            self.ends_at_close = True
            return
        self.headers_done = True
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.complete = True

    def _count(self, size: int) -> None:
        self.head_bytes += size
        if self.head_bytes > MAX_HEAD_BYTES:
            self.head_too_large = True
            raise _PastTheEnd

    def expire(self) -> None:
        """The pool's watchdog found this connection's wait over its deadline: abort it."""
        self.timed_out = True
        self.writer.transport.abort()

    async def feed(self) -> None:
        """Read once from the socket into the parser (the pool's watchdog bounds the wait)."""
        try:
            data = await self.reader.read(READ_SIZE)
        except (ConnectionError, OSError) as exc:
            if self.timed_out:
                raise _timeout() from None
            if not self.received:
                raise _ServerClosed from exc
            raise UpstreamError(
                "the upstream connection failed mid-response", retryable=True, breaker_failure=True
            ) from exc
        self.deadline = math.inf  # not waiting any more: a slow reader of the body is no timeout
        if not data:
            if self.timed_out:
                raise _timeout()
            self._eof()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.head_too_large:
                raise UpstreamError(
                    "the upstream sent an oversized response head", breaker_failure=True
                ) from None
            if self.complete:  # a whole response, then junk: keep the response, not the connection
                self.keep_alive = False
                return
            raise UpstreamError(
                "the upstream sent a malformed HTTP response", retryable=True, breaker_failure=True
            ) from exc

    def _eof(self) -> None:
        if not self.received:
            raise _ServerClosed
        if self.headers_done and self.ends_at_close and not self.complete:
            self.complete = True  # a body delimited by the end of the connection
            return
        raise UpstreamError(
            "the upstream closed the connection mid-response", retryable=True, breaker_failure=True
        )

    def idle_and_quiet(self) -> bool:
        """Whether an idle connection can carry a request: not closed by the server, and nothing
        unasked-for waiting on it (a server may say "408" as it closes an idle connection)."""
        # StreamReader has no public way to see buffered bytes; ``_buffer`` has been there since 3.4.
        return not self.reader.at_eof() and not getattr(self.reader, "_buffer", b"")

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.ends_at_close

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """A response whose head has arrived; the body is read with :meth:`aiter_bytes` or :meth:`read`.

    Always :meth:`aclose` it: that returns a fully read connection to the pool and closes any other.
    """

    __slots__ = ("_conn", "_pool", "headers", "status")

    def __init__(self, pool: UpstreamPool, conn: _Connection) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status = conn.parser.get_status_code()
        self.headers = conn.headers

    async def receive(self) -> bytes | None:
        """The body's next bytes, all that arrived since the last call, or None at its end; each
        wait is bounded by the read timeout."""
        conn = self._conn
        if conn is None:
            return None
        try:
            while not conn.chunks:
                if conn.complete:
                    self._release()
                    return None
                self._pool.wait_on(conn, self._pool.read_timeout_s)
                try:
                    await conn.feed()
                except _ServerClosed:  # cannot happen after the head; kept for type completeness
                    raise UpstreamError("the upstream connection failed", breaker_failure=True) from None
        except BaseException:
            self._release()
            raise
        chunks, conn.chunks = conn.chunks, []
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as it arrives (see :meth:`receive`); closing it part-way
        gives the connection up, as the rest of the body will not be read."""
        try:
            while (piece := await self.receive()) is not None:
                yield piece
        except BaseException:
            self._release()
            raise

    async def read(self, limit: int) -> bytes:
        """The whole body, or an ``UpstreamError`` when it is larger than ``limit`` bytes."""
        parts: list[bytes] = []
        size = 0
        while (piece := await self.receive()) is not None:
            size += len(piece)
            if size > limit:
                self._release()  # the rest is not read: the connection cannot be reused
                raise UpstreamError(f"the upstream response exceeded {limit} bytes")
            parts.append(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self, *, finish: bool = False) -> None:
        """Give the connection back. ``finish``: the caller has all it wanted (a stream's end
        marker) but the body may not be over yet; its last bytes (the chunked terminator, which
        servers often send in a write of its own) are read in the background, bounded, so the
        connection can be reused instead of closed."""
        conn = self._conn
        if finish and conn is not None and not conn.complete:
            self._conn = None
            self._pool.finish_later(conn)
            return
        self._release()

    def __del__(self) -> None:
        # A response dropped unclosed (a bug, or a task torn down at exit) must not keep its
        # connection slot forever: the pool would shrink by one each time. With no event loop left
        # (interpreter exit) there is nothing to give back to.
        with contextlib.suppress(RuntimeError):
            self._release()

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.release(conn)


class UpstreamPool:
    """Keep-alive connections to one origin; :meth:`post` sends a request and returns its head."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections: int,
        keepalive_s: float = 30.0,
        secret: str | None = None,
    ) -> None:
        self.origin = Origin.parse(base_url)
        self.secret = secret.encode() if secret else None
        """The credential this pool sends, to be scrubbed from anything passed back to clients."""
        self.read_timeout_s = read_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._finishing: set[asyncio.Task[None]] = set()
        self._busy: set[_Connection] = set()
        self._watchdog: asyncio.TimerHandle | None = None
        self._tick_s = max(0.005, min(1.0, read_timeout_s / 8))
        self._closed = False
        self._tls = _tls_context() if self.origin.scheme == "https" else None
        self._fixed_head = "".join(
            f"{name}: {_checked(value)}\r\n"
            for name, value in {"host": self.origin.host_header, **headers}.items()
        ).encode("latin-1")

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """Send ``POST {base path}{path}``; returns once the response head has arrived."""
        extra = "".join(f"{name}: {_checked(value)}\r\n" for name, value in headers.items())
        request = b"".join(
            (
                f"POST {self.origin.path}{path} HTTP/1.1\r\n".encode("latin-1"),
                self._fixed_head,
                f"{extra}content-length: {len(body)}\r\n\r\n".encode("latin-1"),
                body,
            )
        )
        await self._acquire_slot()
        try:
            conn = self._take_idle()
            if conn is not None:
                try:
                    return await self._exchange(conn, request)
                except _ServerClosed:
                    pass  # a stale keep-alive connection: the server never saw the request
            try:
                return await self._exchange(await self._connect(), request)
            except _ServerClosed:
                raise UpstreamError(
                    "the upstream closed the connection without answering",
                    retryable=True,
                    breaker_failure=True,
                ) from None
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(self, conn: _Connection, request: bytes) -> UpstreamResponse:
        self.wait_on(conn, self.read_timeout_s)  # for the write and the whole response head
        head_deadline = conn.deadline
        try:
            conn.writer.write(request)
            await conn.writer.drain()
            while not conn.headers_done:
                conn.deadline = head_deadline
                await conn.feed()
        except (ConnectionError, OSError) as exc:  # from the write: nothing was answered yet
            self._busy.discard(conn)
            conn.close()
            if conn.timed_out:
                raise _timeout() from None
            raise _ServerClosed from exc
        except BaseException:
            self._busy.discard(conn)
            conn.close()
            raise
        encoding = conn.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            self._busy.discard(conn)
            conn.close()
            raise UpstreamError(f"the upstream sent an encoded body ({encoding})", breaker_failure=True)
        return UpstreamResponse(self, conn)

    async def _acquire_slot(self) -> None:
        if not self._slots.locked():
            await self._slots.acquire()
            return
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise UpstreamTimeout(
                "timed out waiting for a free upstream connection", retryable=True, breaker_failure=False
            ) from None

    def _take_idle(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self._keepalive_s and conn.idle_and_quiet():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        origin = self.origin
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    origin.host,
                    origin.port,
                    ssl=self._tls,
                    server_hostname=origin.host if self._tls else None,
                    limit=READ_SIZE,
                )
        except TimeoutError:
            raise UpstreamTimeout(
                "timed out connecting to the upstream", retryable=True, breaker_failure=True
            ) from None
        except OSError as exc:  # refused, unreachable, name resolution, TLS handshake
            raise UpstreamUnavailable(
                "could not connect to the upstream", retryable=True, breaker_failure=True
            ) from exc
        return _Connection(reader, writer)

    def finish_later(self, conn: _Connection) -> None:
        """Read what is left of a response (at most ``FINISH_BYTES``, within ``FINISH_S``), then
        release its connection: reused if the response ended, closed if not."""
        task = asyncio.get_running_loop().create_task(self._finish(conn))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _finish(self, conn: _Connection) -> None:
        try:
            size = 0
            async with asyncio.timeout(FINISH_S):
                while not conn.complete and size <= FINISH_BYTES:
                    await conn.feed()
                    size += sum(map(len, conn.chunks))
                    conn.chunks.clear()
        except (TimeoutError, UpstreamError, _ServerClosed):
            pass  # not reusable: release closes it
        finally:
            self.release(conn)

    def wait_on(self, conn: _Connection, seconds: float) -> None:
        """Bound the coming wait on ``conn``: past ``seconds`` the watchdog aborts it, and the
        wait raises ``UpstreamTimeout``. One timer per pool, ticking every eighth of the read
        timeout (at most 1 s) while connections are busy, stands in for a timer per read: those
        (``asyncio.timeout``) measured several percent of the gateway's CPU."""
        conn.deadline = asyncio.get_running_loop().time() + seconds
        self._busy.add(conn)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(self._tick_s, self._watch)

    def _watch(self) -> None:
        self._watchdog = None
        if not self._busy:
            return
        now = asyncio.get_running_loop().time()
        for conn in [c for c in self._busy if c.deadline <= now]:
            self._busy.discard(conn)
            conn.expire()
        if self._busy:
            self._watchdog = asyncio.get_running_loop().call_later(self._tick_s, self._watch)

    def release(self, conn: _Connection) -> None:
        """Take a connection back after its response: kept if fully read and reusable, else closed."""
        self._busy.discard(conn)
        if conn.reusable() and not self._closed:
            conn.reset()
            conn.idle_since = asyncio.get_running_loop().time()
            self._idle.append(conn)
        else:
            conn.close()
        self._slots.release()

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._finishing):
            task.cancel()
        while self._idle:
            self._idle.pop().close()


def _checked(value: str) -> str:
    if "\r" in value or "\n" in value:
        raise UpstreamError("a header value for the upstream contains a line break")
    return value
