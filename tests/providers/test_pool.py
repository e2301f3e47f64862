"""The upstream pool (:mod:`providers.pool`) against a real scripted server on 127.0.0.1.

Covers connection reuse and its limits, the three ways a body can end, stale keep-alive
connections, every transport failure and its translation, the header and size guards, and the
request the pool writes. Waits are polls with a deadline; timeouts are a fraction of a second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import pytest

from gateway.errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable
from providers.pool import MAX_HEAD_BYTES, Origin, UpstreamPool, UpstreamResponse
from tests.scripted_upstream import (
    Close,
    Exchange,
    FullBacklog,
    Garbage,
    Hang,
    Raw,
    Reply,
    ScriptedUpstream,
    Stream,
    chunk,
    unused_port,
)

READ_TIMEOUT_S = 0.3
CONNECT_TIMEOUT_S = 0.3
PATH = "/chat/completions"
BODY = b'{"model":"m","messages":[]}'


def make_pool(
    base_url: str,
    *,
    headers: dict[str, str] | None = None,
    read_timeout_s: float = READ_TIMEOUT_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    max_connections: int = 8,
    keepalive_s: float = 30.0,
) -> UpstreamPool:
    return UpstreamPool(
        base_url,
        headers if headers is not None else {"content-type": "application/json"},
        connect_timeout_s=connect_timeout_s,
        read_timeout_s=read_timeout_s,
        max_connections=max_connections,
        keepalive_s=keepalive_s,
    )


@pytest.fixture
async def pool(upstream: ScriptedUpstream) -> AsyncIterator[UpstreamPool]:
    client = make_pool(upstream.url + "/v1")
    yield client
    await client.aclose()


async def fetch(pool: UpstreamPool, body: bytes = BODY, limit: int = 1 << 20) -> tuple[int, bytes]:
    response = await pool.post(PATH, body, {})
    try:
        return response.status, await response.read(limit)
    finally:
        await response.aclose()


async def pieces(response: UpstreamResponse) -> list[bytes]:
    return [piece async for piece in response.aiter_bytes()]


def idle_count(pool: UpstreamPool) -> int:
    return len(pool._idle)


# --- the request ---------------------------------------------------------------------------------


@pytest.mark.parametrize("base", ["/v1", "/v1/", ""], ids=["base-path", "trailing-slash", "no-path"])
async def test_request_line_host_and_body(upstream: ScriptedUpstream, base: str) -> None:
    upstream.respond(200, body=b"ok")
    pool = make_pool(upstream.url + base, headers={"content-type": "application/json", "x-fixed": "1"})
    try:
        response = await pool.post(PATH, BODY, {"traceparent": "00-abc-def-01"})
        assert await response.read(100) == b"ok"
        await response.aclose()
    finally:
        await pool.aclose()
    sent = upstream.last
    assert sent.method == "POST"
    assert sent.path == ("/v1" if base else "") + PATH
    assert sent.http_version == "1.1"
    assert sent.body == BODY
    assert sent.headers == {
        "host": f"127.0.0.1:{upstream.port}",
        "content-type": "application/json",
        "x-fixed": "1",
        "traceparent": "00-abc-def-01",
        "content-length": str(len(BODY)),
    }
    assert len(sent.header_list) == len(sent.headers)  # no field sent twice


async def test_empty_body_is_sent_with_a_zero_length(upstream: ScriptedUpstream, pool: UpstreamPool) -> None:
    upstream.respond(200, body=b"")
    assert await fetch(pool, body=b"") == (200, b"")
    assert upstream.last.headers["content-length"] == "0"
    assert upstream.last.body == b""


@pytest.mark.parametrize("value", ["a\r\nx-injected: 1", "a\nb", "a\rb"], ids=["crlf", "lf", "cr"])
async def test_a_line_break_in_a_header_value_is_refused_before_sending(
    upstream: ScriptedUpstream, value: str
) -> None:
    with pytest.raises(UpstreamError) as caught:
        make_pool(upstream.url, headers={"authorization": f"Bearer {value}"})
    assert "line break" in caught.value.message
    pool = make_pool(upstream.url, max_connections=1, connect_timeout_s=0.2)
    try:
        with pytest.raises(UpstreamError) as caught:
            await pool.post(PATH, BODY, {"x-call": value})
        assert "line break" in caught.value.message
        assert not caught.value.retryable
        assert (upstream.accepted, upstream.requests) == (0, [])  # not even a connection was made
        # and the refused call holds no connection slot (the only one)
        upstream.respond(200, body=b"fine")
        assert await fetch(pool) == (200, b"fine")
    finally:
        await pool.aclose()
    assert [r.headers.get("x-call") for r in upstream.requests] == [None]


# --- bodies and connection reuse -----------------------------------------------------------------


async def test_sequential_requests_share_one_connection(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.script(
        Reply(200, body=b"sized"),
        Reply(200, body=b"chunked", framing="chunked"),
        Reply(503, json={"error": "busy"}),
        Reply(200, body=b""),
    )
    assert await fetch(pool) == (200, b"sized")
    assert await fetch(pool) == (200, b"chunked")
    assert await fetch(pool) == (503, b'{"error":"busy"}')  # an error status is still a clean reply
    assert await fetch(pool) == (200, b"")
    assert upstream.accepted == 1
    assert [r.connection for r in upstream.requests] == [1, 1, 1, 1]
    assert idle_count(pool) == 1


async def test_chunked_body_arrives_piece_by_piece(upstream: ScriptedUpstream, pool: UpstreamPool) -> None:
    gate = asyncio.Event()
    upstream.stream([b"first ", gate, b"second ", b"third"], headers={"x-kind": "sse"})
    response = await pool.post(PATH, BODY, {})
    assert response.status == 200
    assert response.headers["x-kind"] == "sse"
    assert response.headers["transfer-encoding"] == "chunked"
    body = response.aiter_bytes()
    assert await anext(body) == b"first "  # delivered before the server sends the rest
    gate.set()
    rest = b"".join([piece async for piece in body])
    assert rest == b"second third"
    await response.aclose()
    assert idle_count(pool) == 1  # a chunked body that ended properly leaves a reusable connection


async def test_body_delimited_by_close(upstream: ScriptedUpstream, pool: UpstreamPool) -> None:
    upstream.respond(200, body=b"until the end" * 1000, framing="close")
    assert await fetch(pool) == (200, b"until the end" * 1000)
    assert idle_count(pool) == 0
    assert await fetch(pool) == (200, b"until the end" * 1000)
    assert upstream.accepted == 2  # such a connection cannot carry another response


async def test_http_10_response_without_length_ends_at_close(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.script(Raw(b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nold school"))
    assert await fetch(pool) == (200, b"old school")
    assert idle_count(pool) == 0


async def test_connection_close_response_is_not_reused(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.respond(200, body=b"bye", headers={"connection": "close"})
    assert await fetch(pool) == (200, b"bye")
    assert idle_count(pool) == 0
    await upstream.wait_closed()
    assert await fetch(pool) == (200, b"bye")
    assert upstream.accepted == 2


async def test_a_response_sent_byte_by_byte(upstream: ScriptedUpstream, pool: UpstreamPool) -> None:
    wire = (
        b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nX-Twice: a\r\nx-twice: b\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + chunk(b"slow ") + chunk(b"down") + b"0\r\n\r\n"
    )
    upstream.script(Raw(wire, write_size=1, then="keep"), Reply(200, body=b"again"))
    response = await pool.post(PATH, BODY, {})
    assert response.status == 429
    assert response.headers["retry-after"] == "3"  # names lowercased
    assert response.headers["x-twice"] == "a, b"  # repeated fields joined
    assert await response.read(100) == b"slow down"
    await response.aclose()
    assert await fetch(pool) == (200, b"again")
    assert upstream.accepted == 1


async def test_keepalive_expiry_opens_a_new_connection(upstream: ScriptedUpstream) -> None:
    upstream.respond(200, body=b"x")
    pool = make_pool(upstream.url, keepalive_s=0.0)
    try:
        assert await fetch(pool) == (200, b"x")
        assert await fetch(pool) == (200, b"x")
    finally:
        await pool.aclose()
    assert upstream.accepted == 2
    await upstream.wait_closed()  # the expired one was closed, not leaked


async def test_aclose_closes_idle_connections(upstream: ScriptedUpstream, pool: UpstreamPool) -> None:
    upstream.respond(200, body=b"x")
    first, second = await asyncio.gather(pool.post(PATH, BODY, {}), pool.post(PATH, BODY, {}))
    for response in (first, second):
        assert await response.read(10) == b"x"
        await response.aclose()
    assert upstream.open_connections == 2
    await pool.aclose()
    await upstream.wait_closed()


async def test_a_response_finished_after_aclose_is_not_pooled(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.respond(200, body=b"late")
    response = await pool.post(PATH, BODY, {})
    await pool.aclose()
    assert await response.read(10) == b"late"
    await response.aclose()
    assert idle_count(pool) == 0
    await upstream.wait_closed()


# --- abandoned and oversized responses -----------------------------------------------------------


async def test_an_unread_response_is_not_reused(upstream: ScriptedUpstream, pool: UpstreamPool) -> None:
    upstream.script(Stream([b"part of it"], end="stall"), Reply(200, body=b"next"))
    response = await pool.post(PATH, BODY, {})
    assert response.status == 200
    assert upstream.open_connections == 1
    await response.aclose()
    await upstream.wait_closed()  # closed, since the rest of its body is still on the way
    assert await fetch(pool) == (200, b"next")
    assert [r.connection for r in upstream.requests] == [1, 2]


async def test_a_response_abandoned_mid_body_is_not_reused(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.script(Stream([b"one", b"two"], end="stall"), Reply(200, body=b"next"))
    response = await pool.post(PATH, BODY, {})
    body = response.aiter_bytes()
    assert isinstance(body, AsyncGenerator)
    assert (await anext(body)).startswith(b"one")  # pieces that arrived together come joined
    await body.aclose()  # the reader gives up part-way
    await upstream.wait_closed()
    assert await fetch(pool) == (200, b"next")
    await response.aclose()  # a second release is harmless
    assert upstream.accepted == 2


async def test_read_over_the_limit_is_an_error_and_closes(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.script(Stream([b"a" * 600, b"b" * 600], end="stall"), Reply(200, body=b"x" * 1000))
    response = await pool.post(PATH, BODY, {})
    with pytest.raises(UpstreamError) as caught:
        await response.read(1000)
    assert "1000" in caught.value.message
    await response.aclose()
    await upstream.wait_closed()
    assert await fetch(pool, limit=1000) == (200, b"x" * 1000)  # exactly at the limit is fine


# --- stale keep-alive connections ----------------------------------------------------------------


async def test_an_idle_connection_closed_by_the_server_is_replaced(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.respond(200, body=b"x")
    assert await fetch(pool) == (200, b"x")
    upstream.close_idle()
    await upstream.wait_closed()
    await upstream.wait_until(pool._idle[-1].reader.at_eof, "the client to see the close")
    assert await fetch(pool) == (200, b"x")
    assert [r.connection for r in upstream.requests] == [1, 2]


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "reset"])
async def test_a_reused_connection_closed_before_answering_is_retried_once(
    upstream: ScriptedUpstream, pool: UpstreamPool, reset: bool
) -> None:
    # The server takes the request and drops the connection: to the client, the same as a
    # keep-alive connection the server closed just as the request went out.
    upstream.script(Reply(200, body=b"first"), Close(reset=reset), Reply(200, body=b"second"))
    assert await fetch(pool) == (200, b"first")
    assert await fetch(pool) == (200, b"second")
    assert [r.connection for r in upstream.requests] == [1, 1, 2]
    assert [r.body for r in upstream.requests] == [BODY] * 3


async def test_a_fresh_connection_closed_before_answering_is_retryable(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.script(Close())
    with pytest.raises(UpstreamError) as caught:
        await pool.post(PATH, BODY, {})
    assert "without answering" in caught.value.message
    assert caught.value.retryable
    assert caught.value.breaker_failure
    assert len(upstream.requests) == 1  # not retried: a fresh connection is not stale


async def test_a_stale_and_then_a_fresh_close_is_not_retried_twice(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.script(Reply(200, body=b"first"), Close(), Close())
    assert await fetch(pool) == (200, b"first")
    with pytest.raises(UpstreamError) as caught:
        await pool.post(PATH, BODY, {})
    assert caught.value.retryable
    assert len(upstream.requests) == 3


async def test_an_unsolicited_answer_on_an_idle_connection_is_not_taken_as_a_reply(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    upstream.script(Reply(200, body=b"first"), Reply(200, body=b"second"))
    assert await fetch(pool) == (200, b"first")
    idle = pool._idle[-1]
    upstream.close_idle(
        farewell=b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
    )
    await upstream.wait_closed()
    buffered = idle.reader._buffer  # type: ignore[attr-defined]
    await upstream.wait_until(lambda: len(buffered) > 0, "the 408 to reach the client")
    assert await fetch(pool) == (200, b"second")
    assert [r.connection for r in upstream.requests] == [1, 2]


@dataclass(frozen=True)
class InTwoWrites:
    """Send ``first``, pause so the client reads it on its own, then ``second``; then stall."""

    first: bytes
    second: bytes

    async def run(self, exchange: Exchange) -> bool:
        await exchange.send(self.first)
        await asyncio.sleep(0.05)
        await exchange.send(self.second)
        await exchange.hold()
        return False


EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
FINAL = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@pytest.mark.parametrize("together", [True, False], ids=["one-read", "two-reads"])
async def test_informational_responses_are_skipped(
    upstream: ScriptedUpstream, pool: UpstreamPool, together: bool
) -> None:
    # RFC 9110 section 15.2: a client must parse 1xx responses before the final one, even unasked.
    upstream.script(Raw(EARLY_HINTS + FINAL, then="stall") if together else InTwoWrites(EARLY_HINTS, FINAL))
    response = await pool.post(PATH, BODY, {})
    try:
        assert response.status == 200
        assert await response.read(100) == b"ok"
        assert response.headers == {"content-length": "2"}
    finally:
        await response.aclose()


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(
            b"HTTP/1.1 201 Created\r\nx-late: 1\r\ncontent-length: 3\r\n\r\nbad", id="another-response"
        ),
        b"}",
    ],
    ids=["another-response", "junk"],
)
async def test_bytes_after_the_end_of_a_response_are_not_part_of_it(
    upstream: ScriptedUpstream, pool: UpstreamPool, extra: bytes
) -> None:
    # E.g. a server that counts characters, not bytes, in content-length: more comes than it said.
    upstream.script(Raw(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + extra, then="stall"), Reply(200))
    try:
        response = await pool.post(PATH, BODY, {})
    except UpstreamError:
        pass  # refusing the whole response is correct too
    else:
        try:
            assert response.status == 200
            assert response.headers == {"content-length": "2"}
            assert await response.read(100) == b"ok"
        finally:
            await response.aclose()
    assert await fetch(pool) == (200, b"")
    assert [r.connection for r in upstream.requests] == [1, 2]  # that connection is not reused


# --- transport failures --------------------------------------------------------------------------


async def test_connection_refused_is_unavailable() -> None:
    pool = make_pool(f"http://127.0.0.1:{unused_port()}/v1")
    try:
        with pytest.raises(UpstreamUnavailable) as caught:
            await pool.post(PATH, BODY, {})
    finally:
        await pool.aclose()
    assert caught.value.retryable
    assert caught.value.breaker_failure
    assert caught.value.status == 503


async def test_connect_timeout() -> None:
    with FullBacklog() as url:
        pool = make_pool(url, connect_timeout_s=0.2, read_timeout_s=5.0)
        started = time.monotonic()
        try:
            with pytest.raises(UpstreamTimeout) as caught:
                await pool.post(PATH, BODY, {})
        finally:
            await pool.aclose()
    assert 0.15 < time.monotonic() - started < 2.0
    assert "connecting" in caught.value.message
    assert caught.value.retryable
    assert caught.value.breaker_failure


async def test_hang_before_the_head_times_out(upstream: ScriptedUpstream, pool: UpstreamPool) -> None:
    upstream.script(Hang(), Reply(200, body=b"back"))
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout) as caught:
        await pool.post(PATH, BODY, {})
    elapsed = time.monotonic() - started
    assert READ_TIMEOUT_S * 0.9 < elapsed < READ_TIMEOUT_S + 1.0
    assert caught.value.retryable
    assert caught.value.breaker_failure
    await upstream.wait_closed()  # the timed-out connection was closed, not pooled
    assert await fetch(pool) == (200, b"back")


async def test_a_head_that_never_ends_times_out(upstream: ScriptedUpstream, pool: UpstreamPool) -> None:
    upstream.script(Raw(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n", then="stall"))
    with pytest.raises(UpstreamTimeout):
        await pool.post(PATH, BODY, {})
    await upstream.wait_closed()


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_stall_mid_body_times_out_in_aiter_bytes(
    upstream: ScriptedUpstream, pool: UpstreamPool, framing: str
) -> None:
    payload = b"0123456789" * 10
    size_line = b"" if framing == "length" else b"%x\r\n" % len(payload)
    reply = Reply(200, body=payload, stall_after=len(size_line) + 10)
    upstream.script(reply if framing == "length" else dataclasses.replace(reply, framing="chunked"))
    response = await pool.post(PATH, BODY, {})
    received: list[bytes] = []
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout) as caught:
        async for piece in response.aiter_bytes():
            received.append(piece)
    assert READ_TIMEOUT_S * 0.9 < time.monotonic() - started < READ_TIMEOUT_S + 1.0
    assert b"".join(received) == payload[:10]
    assert caught.value.retryable
    await response.aclose()
    await upstream.wait_closed()


async def test_each_piece_gets_its_own_read_timeout(upstream: ScriptedUpstream) -> None:
    # Three pauses of 0.25 s under a 0.6 s read timeout: the whole body takes longer than one timeout.
    upstream.stream([b"a", 0.25, b"b", 0.25, b"c", 0.25, b"d"])
    pool = make_pool(upstream.url, read_timeout_s=0.6)
    try:
        response = await pool.post(PATH, BODY, {})
        started = time.monotonic()
        assert b"".join(await pieces(response)) == b"abcd"
        assert time.monotonic() - started > 0.6
        await response.aclose()
    finally:
        await pool.aclose()


@pytest.mark.parametrize(
    "behaviour",
    [
        Reply(200, body=b"x" * 100, cut_after=10),
        Reply(200, body=b"x" * 100, framing="chunked", cut_after=20),
        Stream([b"data: 1\n\n"], end="close"),
        Raw(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n"),
    ],
    ids=["sized", "chunked", "stream", "mid-head"],
)
async def test_close_mid_response_is_a_retryable_error(
    upstream: ScriptedUpstream, pool: UpstreamPool, behaviour: Reply | Stream | Raw
) -> None:
    upstream.script(behaviour)
    with pytest.raises(UpstreamError) as caught:
        response = await pool.post(PATH, BODY, {})
        try:
            await response.read(1000)
        finally:
            await response.aclose()
    assert "mid-response" in caught.value.message
    assert caught.value.retryable
    assert caught.value.breaker_failure
    assert idle_count(pool) == 0


@pytest.mark.parametrize(
    "data",
    [
        Garbage().data,
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32),  # a TLS record
        b"HTTP/1.1 abc Nope\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
    ids=["ssh", "tls", "status", "header", "chunk-size"],
)
async def test_garbage_is_a_malformed_response(
    upstream: ScriptedUpstream, pool: UpstreamPool, data: bytes
) -> None:
    upstream.script(Raw(data, then="stall"), Reply(200, body=b"ok"))
    with pytest.raises(UpstreamError) as caught:
        await fetch(pool)
    assert "malformed" in caught.value.message
    assert caught.value.retryable
    assert caught.value.breaker_failure
    await upstream.wait_closed()  # the client hung up on it
    assert await fetch(pool) == (200, b"ok")


@pytest.mark.parametrize(
    "head_size",
    [
        MAX_HEAD_BYTES + 1024,
        MAX_HEAD_BYTES * 4,
    ],
    ids=["64k+1k", "256k"],
)
async def test_an_oversized_head_is_refused(
    upstream: ScriptedUpstream, pool: UpstreamPool, head_size: int
) -> None:
    start = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
    filler = b"x-filler: " + b"f" * (head_size - len(start) - len(b"x-filler: \r\n\r\n")) + b"\r\n"
    upstream.script(Raw(start + filler + b"\r\nok", then="stall"))
    with pytest.raises(UpstreamError) as caught:
        await fetch(pool)
    assert "oversized" in caught.value.message
    assert not caught.value.retryable


async def test_a_large_head_under_the_limit_is_accepted(
    upstream: ScriptedUpstream, pool: UpstreamPool
) -> None:
    start = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n"
    filler = b"x-filler: " + b"f" * (MAX_HEAD_BYTES - 2048) + b"\r\n"
    upstream.script(Raw(start + filler + b"\r\nok", then="keep"))
    assert await fetch(pool) == (200, b"ok")


@pytest.mark.parametrize("encoding", ["gzip", "br", "GZIP", "identity, gzip"])
async def test_an_encoded_body_is_refused(
    upstream: ScriptedUpstream, pool: UpstreamPool, encoding: str
) -> None:
    upstream.script(Reply(200, body=b"\x1f\x8b\x08\x00", headers={"content-encoding": encoding}), Reply(200))
    with pytest.raises(UpstreamError) as caught:
        await pool.post(PATH, BODY, {})
    assert "encoded" in caught.value.message
    assert caught.value.breaker_failure
    await upstream.wait_closed()
    assert idle_count(pool) == 0


async def test_identity_encoding_is_fine(upstream: ScriptedUpstream, pool: UpstreamPool) -> None:
    upstream.respond(200, body=b"plain", headers={"content-encoding": "identity"})
    assert await fetch(pool) == (200, b"plain")


# --- the connection bound ------------------------------------------------------------------------


async def test_max_connections_bounds_open_connections(upstream: ScriptedUpstream) -> None:
    upstream.script(Hang(), Hang(), Reply(200, body=b"after"))
    pool = make_pool(upstream.url, max_connections=2, read_timeout_s=5.0, connect_timeout_s=0.2)
    try:
        hung = [asyncio.create_task(pool.post(PATH, BODY, {})) for _ in range(2)]
        await upstream.wait_until(lambda: len(upstream.requests) == 2, "two requests to hang")
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout) as caught:
            await pool.post(PATH, BODY, {})
        assert 0.15 < time.monotonic() - started < 1.5
        assert "free upstream connection" in caught.value.message
        assert caught.value.retryable
        assert upstream.peak_connections == 2
        assert upstream.accepted == 2
        # cancelling the hung calls gives their slots (and connections) back
        for task in hung:
            task.cancel()
        await asyncio.gather(*hung, return_exceptions=True)
        assert all(task.cancelled() for task in hung)
        await upstream.wait_closed()
        assert await fetch(pool) == (200, b"after")
    finally:
        await pool.aclose()
    assert upstream.peak_connections == 2


async def test_a_waiting_call_gets_the_connection_released_first(upstream: ScriptedUpstream) -> None:
    gate = asyncio.Event()
    upstream.script(Stream([b"slow", gate, b" one"]), Reply(200, body=b"second"))
    pool = make_pool(upstream.url, max_connections=1, connect_timeout_s=2.0)
    try:
        first = await pool.post(PATH, BODY, {})
        waiting = asyncio.create_task(fetch(pool))
        await asyncio.sleep(0)
        assert not waiting.done()
        gate.set()
        assert await first.read(100) == b"slow one"
        await first.aclose()
        assert await waiting == (200, b"second")
    finally:
        await pool.aclose()
    assert upstream.accepted == 1  # the waiter reused the released connection


async def test_every_failure_gives_its_slot_back_exactly_once(upstream: ScriptedUpstream) -> None:
    pool = make_pool(upstream.url, max_connections=1, connect_timeout_s=0.1, read_timeout_s=0.4)
    upstream.script(
        Garbage(),
        Close(),
        Hang(),
        Reply(200, body=b"x" * 100, stall_after=10),
        Reply(200, body=b"x" * 100, cut_after=10),
        Reply(200, body=b"zipped", headers={"content-encoding": "gzip"}),
        Stream([b"y" * 100], end="stall"),
        Reply(200, body=b"ok"),
        Hang(),
        Hang(),
    )
    try:
        for _ in range(6):
            with pytest.raises((UpstreamError, UpstreamTimeout)):
                await fetch(pool)
        with pytest.raises(UpstreamError):  # over the read limit
            await fetch(pool, limit=50)
        response = await pool.post(PATH, BODY, {})  # read whole, released twice
        assert await response.read(10) == b"ok"
        await response.aclose()
        await response.aclose()
        hung = asyncio.create_task(pool.post(PATH, BODY, {}))
        await upstream.wait_until(lambda: len(upstream.requests) == 9, "the hung request")
        # with one slot, a second call must still wait for it: no failure above gave back two
        with pytest.raises(UpstreamTimeout) as caught:
            await pool.post(PATH, BODY, {})
        assert "free upstream connection" in caught.value.message
        hung.cancel()
        await asyncio.gather(hung, return_exceptions=True)
    finally:
        await pool.aclose()
    assert upstream.peak_connections == 1
    assert len(upstream.requests) == 9


def test_origin_of_a_base_url() -> None:
    https = Origin.parse("https://api.example.com/v1/")
    assert (https.scheme, https.host, https.port, https.path) == ("https", "api.example.com", 443, "/v1")
    assert https.host_header == "api.example.com"
    assert Origin.parse("http://example.com:80").host_header == "example.com"
    assert Origin.parse("http://example.com:8443/a/b").host_header == "example.com:8443"
    ipv6 = Origin.parse("http://[::1]:8080")
    assert (ipv6.host, ipv6.port, ipv6.path, ipv6.host_header) == ("::1", 8080, "", "[::1]:8080")
    for bad in ("ftp://example.com/", "example.com/v1", "http:///v1", ""):
        with pytest.raises(ValueError):
            Origin.parse(bad)
