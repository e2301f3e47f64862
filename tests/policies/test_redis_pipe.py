"""The pipelined Redis connection of the admission scripts, against real Redis servers.

Covers ordering under concurrency, script loading after ``NOSCRIPT``, error replies, a Redis that
restarts, one that hangs, one that is not there, and the URL's password and database.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from policies.redis_pipe import RedisPipe, Script, encode_command
from tests.harness import RedisServer, free_port, wait_for

ECHO = Script("return {KEYS[1], ARGV[1]}")


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis of this module's own, so stopping it disturbs no other test."""
    server = RedisServer(tmp_path_factory.mktemp("pipe-redis")).start()
    yield server
    server.stop()


@pytest.fixture
async def pipe(own_redis: RedisServer) -> AsyncIterator[RedisPipe]:
    pipe = RedisPipe(own_redis.url, connect_timeout_s=1.0, command_timeout_s=1.0)
    yield pipe
    await pipe.aclose()


def test_commands_are_encoded_as_resp_arrays() -> None:
    assert encode_command(("SET", "k", b"v\r\n", 3, 1.5)) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n$1\r\n3\r\n$3\r\n1.5\r\n"
    )


async def test_concurrent_calls_each_get_their_own_reply(pipe: RedisPipe) -> None:
    replies = await asyncio.gather(*(pipe.evalsha(ECHO, [f"k{i}"], [i]) for i in range(500)))
    assert replies == [[f"k{i}".encode(), str(i).encode()] for i in range(500)]


async def test_a_script_redis_does_not_know_is_loaded_then_run(pipe: RedisPipe) -> None:
    await pipe.call("SCRIPT", "FLUSH")
    assert await pipe.evalsha(ECHO, ["a"], ["b"]) == [b"a", b"b"]
    assert await pipe.call("SCRIPT", "EXISTS", ECHO.sha) == [1]


async def test_an_error_reply_is_raised_and_the_connection_still_works(pipe: RedisPipe) -> None:
    await pipe.call("SET", "text", "x")
    with pytest.raises(ResponseError, match="not an integer"):
        await pipe.call("INCR", "text")
    assert await pipe.call("PING") == b"PONG"


async def test_a_restarted_redis_is_reconnected_to(own_redis: RedisServer, pipe: RedisPipe) -> None:
    assert await pipe.call("PING") == b"PONG"
    own_redis.restart()
    deadline = asyncio.get_running_loop().time() + 5
    while True:  # the first call may still find the old connection's loss
        try:
            assert await pipe.evalsha(ECHO, ["x"], ["y"]) == [b"x", b"y"]  # NOSCRIPT after restart, too
            break
        except RedisConnectionError:
            assert asyncio.get_running_loop().time() < deadline


async def test_a_redis_that_is_not_there_is_a_connection_error() -> None:
    pipe = RedisPipe(f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.5, command_timeout_s=0.5)
    with pytest.raises(RedisConnectionError):
        await pipe.call("PING")
    await pipe.aclose()


async def test_a_hung_redis_times_out_and_the_next_call_reconnects() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pipe = RedisPipe(f"redis://127.0.0.1:{port}/0", connect_timeout_s=0.5, command_timeout_s=0.2)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(RedisTimeoutError):
            await pipe.call("PING")
        assert asyncio.get_running_loop().time() - started < 1.0
        with pytest.raises(RedisTimeoutError):
            await pipe.call("PING")
        assert len(accepted) == 2  # the timed-out connection was dropped, not reused
    finally:
        await pipe.aclose()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.fixture(scope="module")
def password_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    directory: Path = tmp_path_factory.mktemp("auth-redis")
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)]
    args += ["--save", "", "--appendonly", "no", "--requirepass", "s3cret-pass"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def answers() -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"-NOAUTH")
        except OSError:
            return False

    wait_for(answers, 10, "the password-protected redis-server")
    yield port
    proc.terminate()
    proc.wait(10)


async def test_password_and_database_come_from_the_url(password_redis: int) -> None:
    pipe = RedisPipe(
        f"redis://:s3cret-pass@127.0.0.1:{password_redis}/3", connect_timeout_s=1, command_timeout_s=1
    )
    await pipe.call("SET", "where", "db3")
    await pipe.aclose()
    client = aioredis.Redis(host="127.0.0.1", port=password_redis, password="s3cret-pass", db=3)
    assert await client.get("where") == b"db3"
    await client.aclose()


async def test_a_wrong_password_fails_without_echoing_it(password_redis: int) -> None:
    pipe = RedisPipe(
        f"redis://:wrong-pass-xyz@127.0.0.1:{password_redis}/0", connect_timeout_s=1, command_timeout_s=1
    )
    with pytest.raises(RedisConnectionError) as caught:
        await pipe.call("PING")
    assert "wrong-pass-xyz" not in str(caught.value)
    await pipe.aclose()


async def test_a_command_is_written_when_it_is_called(own_redis: RedisServer) -> None:
    # Settlements rely on this: one begun before a client's reply is written (at the end of the
    # loop turn) reaches Redis first. Checked with a blocking client within the turn: only what was
    # already written can have been applied.
    pipe = RedisPipe(own_redis.url, connect_timeout_s=1.0, command_timeout_s=1.0)
    check = redis.Redis.from_url(own_redis.url)
    try:
        await pipe.ping()  # connected
        check.delete("written")
        written = asyncio.ensure_future(pipe.call("SET", "written", "1"))
        await asyncio.sleep(0)  # the call runs up to its wait for the reply; the turn goes on
        assert poll_blocking(lambda: check.get("written") == b"1", 2.0)
        assert await written == b"OK"
    finally:
        check.close()
        await pipe.aclose()


def poll_blocking(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition`` while blocking the event loop on purpose, until it holds or time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.001)
    return False
