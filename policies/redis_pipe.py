"""One pipelined Redis connection for the admission scripts, the gateway's per-request Redis calls.

Why not redis-py for these: its asyncio client takes a pooled connection per command (64 requests
in flight kept 65 connections open) and, with a socket timeout set, wraps every write in
``asyncio.wait_for``, which on Python 3.11 creates a task per command; its client code was a fifth
of the gateway worker's CPU samples. Redis answers in order, so one connection carries every
in-flight call: commands are written back to back, replies are parsed by hiredis and handed to the
waiting callers first in, first out, each caller resuming as its reply is read
(:class:`gateway.reply_future.ReplyFuture`: at c=64 and a 50 ms upstream, whole replies 0.910 ->
0.939, 0.920 -> 0.929 and 0.916 -> 0.938 of direct throughput in three side-by-side runs, streams
0.918 -> 0.944).

Each command is written when it is called, not gathered into one write at the end of the event-loop
turn. Measured on the 2-core benchmark machine (64 clients, 50 ms upstream, three gateways side by
side): gathered writes left a request's admission waiting for the rest of the turn, and the reply
then usually missed the loop's next poll, a whole turn more; with immediate writes streams went
from 0.78 to 0.85 of direct throughput. A write per command costs a system call each (at 0 ms
upstream, 64 clients: about 8% less throughput), which that buys back. It also means a command is on
its way to Redis before anything the caller writes to a client afterwards.

A command Redis leaves unanswered for ``command_timeout_s`` closes the connection (so a hung
Redis cannot hold later calls), failing every call waiting on it, and the next call reconnects.
Failures are raised as redis-py's ``ConnectionError`` and ``TimeoutError`` (both ``RedisError``),
as the callers already expect. redis-py stays for everything off the hot
path: the admin API, the tenant store, the queue client.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.reply_future import ReplyFuture

Arg = str | bytes | int | float


# hiredis' stub types the argument as a tuple of one element; it takes any number.
encode_command: Callable[[tuple[Arg, ...]], bytes] = hiredis.pack_command  # type: ignore[assignment]
"""A command (a tuple) as a RESP array of bulk strings, numbers as their ``repr``: hiredis' C
encoder, 1.0 µs against 3.6 µs in Python for an admission's eight arguments."""


class Script:
    """A Lua script, called by its SHA1 and sent whole only when Redis does not know it."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()


class _Protocol(asyncio.Protocol):
    """The connection: commands written as they come, replies matched in order.

    One watchdog timer, not one per call, bounds how long Redis may take: it looks at the oldest
    unanswered command every quarter of ``timeout_s`` and drops the connection once that command
    is older than ``timeout_s`` (every waiting caller then gets a ``TimeoutError``). A timer per
    call (``asyncio.timeout``) measured about a tenth of the gateway's CPU across its calls.
    """

    def __init__(self, timeout_s: float) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[ReplyFuture] = deque()
        self.closed = False
        self._deadlines: deque[float] = deque()
        self._timeout_s = timeout_s
        self._watchdog: asyncio.TimerHandle | None = None
        self._timed_out = False
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, command: bytes) -> ReplyFuture:
        if self.transport is not None and not self.closed:
            self.transport.write(command)
        future = ReplyFuture(self._loop)
        self.waiting.append(future)
        self._deadlines.append(self._loop.time() + self._timeout_s)
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self._timeout_s / 4, self._watch)
        return future

    def _watch(self) -> None:
        self._watchdog = None
        if self.closed or not self._deadlines:
            return
        if self._loop.time() >= self._deadlines[0]:
            self._timed_out = True
            self.abort()
            return
        self._watchdog = self._loop.call_later(self._timeout_s / 4, self._watch)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            if not self.waiting:  # a reply nobody asked for: the stream is out of step
                self.abort()
                return
            future = self.waiting.popleft()
            self._deadlines.popleft()
            if not future.done():  # its caller may have been cancelled
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        error: Exception = (
            RedisTimeoutError("Redis did not answer in time")
            if self._timed_out
            else RedisConnectionError("the connection to Redis was lost")
        )
        self._deadlines.clear()
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self.connection_lost(None)


class RedisPipe:
    """Script calls and a few plain commands over one pipelined connection to the Redis of ``url``."""

    def __init__(self, url: str, *, connect_timeout_s: float, command_timeout_s: float) -> None:
        self._target = _Target.parse(url)
        self._connect_timeout_s = connect_timeout_s
        self._command_timeout_s = command_timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None

    async def evalsha(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        """Run ``script``; loads it first (``EVAL``) when Redis answers ``NOSCRIPT``."""
        head: list[Arg] = [script.sha, len(keys), *keys, *args]
        try:
            return await self.call("EVALSHA", *head)
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.call("EVAL", script.source, *head[1:])

    async def call(self, *args: Arg) -> Any:
        """One command's reply; an error reply is raised as ``ResponseError``."""
        protocol = self._protocol
        if protocol is None or protocol.closed:
            protocol = await self._connect()
        reply = await protocol.send(encode_command(args))
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def ping(self) -> None:
        await self.call("PING")

    async def aclose(self) -> None:
        if self._protocol is not None:
            self._protocol.abort()
            self._protocol = None

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._protocol is not None and not self._protocol.closed:
                return self._protocol  # another caller connected meanwhile
            protocol = await self._open()
            self._protocol = protocol
            return protocol

    async def _open(self) -> _Protocol:
        target = self._target
        loop = asyncio.get_running_loop()

        def make() -> _Protocol:
            return _Protocol(self._command_timeout_s)

        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if target.path is not None:
                    _, protocol = await loop.create_unix_connection(make, target.path)
                else:
                    _, protocol = await loop.create_connection(make, target.host, target.port, ssl=target.tls)
                for command in target.setup:
                    reply = await protocol.send(encode_command(command))
                    if isinstance(reply, ResponseError):
                        protocol.abort()
                        raise RedisConnectionError(f"Redis refused the connection setup: {reply}")
        except TimeoutError:
            raise RedisTimeoutError("timed out connecting to Redis") from None
        except OSError as exc:
            raise RedisConnectionError(f"could not connect to Redis: {exc.strerror or exc}") from None
        return protocol


class _Target:
    """Where to connect and what to send first (AUTH, SELECT), from a redis-py style URL."""

    def __init__(self) -> None:
        self.host = "127.0.0.1"
        self.port = 6379
        self.path: str | None = None
        self.tls: ssl.SSLContext | None = None
        self.setup: list[tuple[Arg, ...]] = []

    @classmethod
    def parse(cls, url: str) -> _Target:
        parts = urlsplit(url)
        target = cls()
        query = parse_qs(parts.query)
        db = query.get("db", [""])[0]
        if parts.scheme == "unix":
            target.path = unquote(parts.path)
        elif parts.scheme in ("redis", "rediss"):
            target.host = parts.hostname or target.host
            target.port = parts.port or target.port
            target.tls = ssl.create_default_context() if parts.scheme == "rediss" else None
            db = parts.path.lstrip("/") or db
        else:
            raise ValueError("a Redis URL starts with redis://, rediss:// or unix://")
        if parts.password is not None:
            password = unquote(parts.password)
            user = unquote(parts.username) if parts.username else None
            target.setup.append(("AUTH", user, password) if user else ("AUTH", password))
        if db and db != "0":
            target.setup.append(("SELECT", int(db)))
        return target
