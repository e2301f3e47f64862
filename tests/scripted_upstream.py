"""A real HTTP/1.1 server on 127.0.0.1 whose every answer a test scripts, and which records requests.

Why it exists: the adapters reach their upstreams through :mod:`providers.pool`, our own HTTP/1.1
client over asyncio streams, so a client-side mock (``respx`` patches ``httpx``) no longer sees
anything. The faithful stand-in is a server on a real socket. In the spirit of respx routes, a test
scripts what the server does with each request it receives:

- :class:`Reply`: a status, headers and a JSON or bytes body, framed by ``content-length``,
  ``chunked`` or the end of the connection; optionally stalled or cut after some body bytes;
- :class:`Stream`: a chunked body (server-sent events) sent piece by piece, with pauses, gates the
  test opens, and an end that finishes the body, closes the connection or stalls;
- :class:`Hang`: read the request and never answer;
- :class:`Close`: close the connection without answering (with a FIN, or a reset);
- :class:`Raw` and :class:`Garbage`: any bytes at all, HTTP or not.

Every request is recorded (method, path, headers, body bytes and which connection carried it), and
the server counts the connections it accepted and holds open, so tests can assert on what was sent
upstream and on how the client used its connections. Connections are kept alive between requests.

The server runs in the running event loop (``async with ScriptedUpstream() as upstream``), or on
its own loop in a thread (``with ScriptedUpstream() as upstream``) for code under test that blocks
the test's loop, such as Litestar's test client, which runs the app through a blocking portal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from types import TracebackType
from typing import Any, Literal, Protocol, Self, runtime_checkable

import httptools

from tests.harness import free_port

READ_SIZE = 64 * 1024
GATE_TIMEOUT_S = 10.0
POLL_S = 0.005

HeaderItems = Mapping[str, str] | Sequence[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Recorded:
    """One request the server received, whole."""

    method: str
    path: str  # the request target, as sent
    headers: dict[str, str]  # names lowercased; repeated fields joined with ", "
    header_list: list[tuple[str, str]]  # as sent: order, case and repeats kept
    body: bytes
    connection: int  # 1 for the first connection the server accepted, 2 for the next...
    http_version: str

    def json(self) -> Any:
        return jsonlib.loads(self.body)


class Flag(Protocol):
    """What a :class:`Stream` can wait on: an ``asyncio.Event`` or a ``threading.Event``."""

    def is_set(self) -> bool: ...


class Exchange:
    """One request and the connection it came on, as a behaviour sees them."""

    def __init__(self, request: Recorded, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.request = request
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def hold(self) -> None:
        """Answer nothing more; return once the client has closed the connection."""
        while await self.reader.read(READ_SIZE):
            pass

    async def wait_for(self, flag: Flag) -> None:
        """Wait until the test sets ``flag`` (polled, so it may belong to another loop or thread)."""
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not flag.is_set():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test never opened the gate of the stream to {self.request.path}")
            await asyncio.sleep(POLL_S)

    def reset(self) -> None:
        """Close with a TCP reset instead of a FIN."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


@runtime_checkable
class Behaviour(Protocol):
    """What the server does with one request."""

    async def run(self, exchange: Exchange) -> bool:
        """Act on the request; True keeps the connection open for the next one."""
        ...


Entry = Behaviour | Callable[[Recorded], Behaviour]


def _head(status: int, reason: str | None, version: str, fields: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/{version} {status} {reason if reason is not None else _reason(status)}"]
    lines += [f"{name}: {value}" for name, value in fields]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Whatever"


def _fields(headers: HeaderItems) -> list[tuple[str, str]]:
    return list(headers.items()) if isinstance(headers, Mapping) else list(headers)


def _has(fields: list[tuple[str, str]], name: str) -> bool:
    return any(key.lower() == name for key, _ in fields)


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a ``chunked`` body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


@dataclass(frozen=True)
class Reply:
    """A whole response. ``json`` (encoded compactly) or ``body`` is the payload.

    ``framing``: ``length`` adds ``content-length``, ``chunked`` sends the payload as one chunk,
    ``close`` sends neither and ends the body by closing the connection. Framing headers given in
    ``headers`` are not added twice. ``stall_after`` / ``cut_after``: send only that many bytes of
    the framed body, then hang / close the connection.
    """

    status: int = 200
    json: Any = None
    body: bytes = b""
    headers: HeaderItems = ()
    framing: Literal["length", "chunked", "close"] = "length"
    reason: str | None = None
    version: str = "1.1"
    stall_after: int | None = None
    cut_after: int | None = None

    def payload(self) -> bytes:
        if self.json is not None:
            return jsonlib.dumps(self.json, separators=(",", ":")).encode()
        return self.body

    def wire(self) -> tuple[bytes, bytes]:
        """The head and the framed body."""
        payload = self.payload()
        fields = _fields(self.headers)
        if self.json is not None and not _has(fields, "content-type"):
            fields.append(("content-type", "application/json"))
        if self.framing == "length" and not _has(fields, "content-length"):
            fields.append(("content-length", str(len(payload))))
        elif self.framing == "chunked" and not _has(fields, "transfer-encoding"):
            fields.append(("transfer-encoding", "chunked"))
        elif self.framing == "close" and not _has(fields, "connection"):
            fields.append(("connection", "close"))
        if self.framing == "chunked":
            payload = (chunk(payload) if payload else b"") + b"0\r\n\r\n"
        return _head(self.status, self.reason, self.version, fields), payload

    async def run(self, exchange: Exchange) -> bool:
        head, body = self.wire()
        if self.stall_after is not None:
            await exchange.send(head + body[: self.stall_after])
            await exchange.hold()
            return False
        if self.cut_after is not None:
            await exchange.send(head + body[: self.cut_after])
            return False
        await exchange.send(head + body)
        closes = any(k.lower() == "connection" and v.lower() == "close" for k, v in _fields(self.headers))
        return self.framing != "close" and not closes and self.version == "1.1"


@dataclass(frozen=True)
class Stream:
    """A ``chunked`` response sent piece by piece, each piece flushed on its own.

    ``parts``: bytes are sent as one chunk each; a number pauses that many seconds; a :class:`Flag`
    (``asyncio.Event``/``threading.Event``) is waited for, up to ``GATE_TIMEOUT_S``. ``end``:
    ``done`` sends the last chunk, ``close`` closes the connection mid-body, ``stall`` hangs.
    """

    parts: Sequence[bytes | float | Flag]
    status: int = 200
    headers: HeaderItems = (("content-type", "text/event-stream"),)
    end: Literal["done", "close", "stall"] = "done"

    async def run(self, exchange: Exchange) -> bool:
        fields = [*_fields(self.headers), ("transfer-encoding", "chunked")]
        await exchange.send(_head(self.status, None, "1.1", fields))
        for part in self.parts:
            if isinstance(part, bytes):
                if part:
                    await exchange.send(chunk(part))
                await asyncio.sleep(0)  # let the client read each piece on its own, as far as it can
            elif isinstance(part, int | float):
                await asyncio.sleep(part)
            else:
                await exchange.wait_for(part)
        if self.end == "done":
            await exchange.send(b"0\r\n\r\n")
            return True
        if self.end == "stall":
            await exchange.hold()
        return False


@dataclass(frozen=True)
class Hang:
    """Read the request and never answer; the connection ends when the client closes it."""

    async def run(self, exchange: Exchange) -> bool:
        await exchange.hold()
        return False


@dataclass(frozen=True)
class Close:
    """Close the connection without answering: a FIN, or a TCP reset with ``reset=True``."""

    reset: bool = False

    async def run(self, exchange: Exchange) -> bool:
        if self.reset:
            exchange.reset()
        return False


@dataclass(frozen=True)
class Raw:
    """Send ``data`` as it is (``write_size`` bytes at a time, each flushed), then ``then``."""

    data: bytes
    write_size: int | None = None
    then: Literal["close", "keep", "stall"] = "close"

    async def run(self, exchange: Exchange) -> bool:
        step = self.write_size or max(len(self.data), 1)
        for start in range(0, len(self.data), step):
            await exchange.send(self.data[start : start + step])
            if self.write_size:
                await asyncio.sleep(0)
        if self.then == "stall":
            await exchange.hold()
        return self.then == "keep"


@dataclass(frozen=True)
class Garbage(Raw):
    """Something that is not HTTP at all, then a close."""

    data: bytes = b"SSH-2.0-OpenSSH_9.6\r\nnot an HTTP response\r\n\r\n"


class _RequestParser:
    """httptools callbacks: whole requests, in order, from one connection's bytes."""

    def __init__(self, connection: int) -> None:
        self.connection = connection
        self.done: deque[Recorded] = deque()
        self.in_message = False
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._parser = httptools.HttpRequestParser(self)

    def feed(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.in_message = True
        self._url = b""
        self._headers = []
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.in_message = False
        headers: dict[str, str] = {}
        for name, value in self._headers:
            key = name.lower()
            headers[key] = value if key not in headers else f"{headers[key]}, {value}"
        self.done.append(
            Recorded(
                method=self._parser.get_method().decode("latin-1"),
                path=self._url.decode("latin-1"),
                headers=headers,
                header_list=list(self._headers),
                body=b"".join(self._body),
                connection=self.connection,
                http_version=self._parser.get_http_version(),
            )
        )


class ScriptedUpstream:
    """The server. Script it with :meth:`script` (or :meth:`respond`, :meth:`stream`) and read
    :attr:`requests`, :attr:`accepted`, :attr:`open_connections` and :attr:`peak_connections`.

    The i-th request gets the i-th scripted entry; once they run out the last one repeats. An
    entry is a behaviour or a function of the request returning one. A request with no script gets
    a 500 and is noted in :attr:`errors`, as is any exception of a behaviour (check it is empty
    after the test: the fixtures do).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._script: list[Entry] = []
        self._answered = 0
        self.requests: list[Recorded] = []
        self.errors: list[str] = []
        self.accepted = 0
        self.open_connections = 0
        self.peak_connections = 0
        self.port = 0
        self._idle: dict[int, asyncio.StreamWriter] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- scripting and reading what happened ---------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, *entries: Entry) -> None:
        """Replace the script; the next request gets ``entries[0]``."""
        with self._lock:
            self._script = list(entries)
            self._answered = 0

    def respond(self, status: int = 200, **reply: Any) -> None:
        """Answer every request alike: ``respond(200, json={...})``; see :class:`Reply`."""
        self.script(Reply(status, **reply))

    def stream(self, parts: Sequence[bytes | float | Flag], **stream: Any) -> None:
        """Answer every request with the same :class:`Stream`."""
        self.script(Stream(parts, **stream))

    @property
    def last(self) -> Recorded:
        with self._lock:
            assert self.requests, "the upstream received no request"
            return self.requests[-1]

    def close_idle(self, farewell: bytes = b"") -> None:
        """Close every connection waiting for its next request, as a keep-alive expiry does;
        ``farewell`` is sent first (some servers say ``408 Request Timeout`` as they hang up)."""
        self._in_loop(lambda: self._close_idle_now(farewell))

    async def wait_until(
        self, check: Callable[[], bool], what: str = "condition", timeout: float = 5.0
    ) -> None:
        """Poll ``check`` until it holds, or fail the test after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(POLL_S)

    async def wait_closed(self, timeout: float = 5.0) -> None:
        """Until no connection is open (every client connection has been closed)."""
        await self.wait_until(lambda: self.open_connections == 0, "all connections to close", timeout)

    # --- running it ----------------------------------------------------------------------------

    async def start(self) -> Self:
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=READ_SIZE)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    def start_in_thread(self) -> Self:
        """Run on a new event loop in a daemon thread (for code that blocks the caller's loop)."""
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_forever()
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="scripted-upstream", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.start(), loop).result(timeout=10)
        return self

    def stop_thread(self) -> None:
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        asyncio.run_coroutine_threadsafe(self.stop(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._thread = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def __enter__(self) -> Self:
        return self.start_in_thread()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_thread()

    # --- the server side -----------------------------------------------------------------------

    def _in_loop(self, action: Callable[[], None]) -> None:
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(action)
        else:
            action()

    def _close_idle_now(self, farewell: bytes) -> None:
        for writer in list(self._idle.values()):
            if farewell:
                writer.write(farewell)
            writer.close()

    def _choose(self, request: Recorded) -> Behaviour:
        with self._lock:
            self.requests.append(request)
            if not self._script:
                self.errors.append(f"unscripted request: {request.method} {request.path}")
                return Reply(500, body=b"unscripted request")
            entry = self._script[min(self._answered, len(self._script) - 1)]
            self._answered += 1
        return entry if isinstance(entry, Behaviour) else entry(request)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self.accepted += 1
            number = self.accepted
            self.open_connections += 1
            self.peak_connections = max(self.peak_connections, self.open_connections)
        parser = _RequestParser(number)
        try:
            while (request := await self._next_request(reader, writer, parser)) is not None:
                if not await self._choose(request).run(Exchange(request, reader, writer)):
                    break
        except (ConnectionError, OSError):
            pass  # the client went away: tests of aborts do that on purpose
        except httptools.HttpParserError as exc:
            self.errors.append(f"unparseable request on connection {number}: {exc!r}")
        except Exception as exc:
            self.errors.append(f"behaviour failed on connection {number}: {exc!r}")
        finally:
            self._idle.pop(number, None)
            writer.close()
            with self._lock:
                self.open_connections -= 1
            self._tasks.discard(task)

    async def _next_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, parser: _RequestParser
    ) -> Recorded | None:
        while not parser.done:
            if not parser.in_message:
                self._idle[parser.connection] = writer
            data = await reader.read(READ_SIZE)
            self._idle.pop(parser.connection, None)
            if not data:
                return None
            parser.feed(data)
        return parser.done.popleft()


# --- places that do not answer like an upstream ------------------------------------------------


unused_port = free_port
"""A port nothing listens on, so connecting to it is refused."""


class FullBacklog:
    """A listener that never accepts and whose backlog is full: a new connect hangs (SYN dropped).

    ``with FullBacklog() as url:`` gives an ``http://127.0.0.1:PORT`` to time out connecting to.
    """

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._fillers: list[socket.socket] = []

    def __enter__(self) -> str:
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        port = self._listener.getsockname()[1]
        for _ in range(8):  # connect until one stays pending: the queue is then full
            filler = socket.socket()
            filler.setblocking(False)
            self._fillers.append(filler)
            with contextlib.suppress(BlockingIOError):
                filler.connect(("127.0.0.1", port))
            _, writable, _ = select.select([], [filler], [], 0.2)
            if not writable:
                return f"http://127.0.0.1:{port}"
        self.__exit__(None, None, None)
        raise RuntimeError("could not fill the listen backlog")

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for filler in self._fillers:
            filler.close()
        self._listener.close()
