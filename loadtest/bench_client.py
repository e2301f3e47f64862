"""The benchmark's load generator: a light closed-loop HTTP/1.1 client on uvloop and raw sockets.

An HTTP library would cost more CPU per request than the server it measures, so this client
keeps ``concurrency`` keep-alive connections, writes one pre-encoded request on each, parses only
the status line, the two framing headers (``content-length``, ``transfer-encoding: chunked``) and
the chunked framing, and sends the next request on a connection as soon as its response ends.
Per request it records:

* latency: from writing the request to the end of the response;
* time to first token (TTFT): from writing the request to the first byte of the response *body*
  (for an SSE stream, the first event), recorded for every response but reported for streams.

A response counts as ok when its status is 200 and, for a chunked (SSE) response, its last event
is ``data: [DONE]``. Anything else is counted by status (0: connection error or timeout).

Standalone use, e.g. against a gateway in dev mode::

    python -m loadtest.bench_client http://127.0.0.1:8080 --key "$MODELGATE_DEV_KEY" -c 16 -s 5 [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import msgspec
import uvloop

_HEAD_END = b"\r\n\r\n"
_CRLF = b"\r\n"
_DONE_TAIL = b"data: [DONE]\n\n"
_now = time.perf_counter


def chat_body(model: str, stream: bool, max_tokens: int = 16) -> bytes:
    """The benchmark's request body: a short prompt, a bounded reply."""
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello to the benchmark in a few words."}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return msgspec.json.encode(body)


def build_request(url: str, body: bytes, key: str | None = None) -> bytes:
    """The whole request (head and body) as bytes, encoded once and written for every request."""
    parts = urlsplit(url)
    lines = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"host: {parts.netloc}",
        "content-type: application/json",
        "accept: */*",
        f"content-length: {len(body)}",
    ]
    if key:
        lines.append(f"authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass(slots=True)
class LoadResult:
    """What one run measured. Times are seconds."""

    requests: int = 0
    """Responses received to requests sent after the warm-up (ok or not)."""
    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)
    """Of ok responses."""
    ttfts: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    """Status of every recorded response; 0 for a connection error, a timeout or a broken stream."""
    client_cpu_s: float = 0.0

    @property
    def ok(self) -> int:
        return len(self.latencies)

    @property
    def errors(self) -> int:
        return self.requests - self.ok

    @property
    def rate(self) -> float:
        return self.requests / self.elapsed if self.elapsed > 0 else 0.0

    def merge(self, other: LoadResult) -> None:
        self.requests += other.requests
        self.elapsed += other.elapsed
        self.latencies += other.latencies
        self.ttfts += other.ttfts
        self.statuses.update(other.statuses)
        self.client_cpu_s += other.client_cpu_s


class _Run:
    """Shared state of one run: when to record, when to stop, what was measured."""

    def __init__(self, request: bytes, record_from: float, stop_at: float, max_requests: int | None) -> None:
        self.request = request
        self.record_from = record_from
        self.stop_at = stop_at
        self.budget = max_requests
        self.result = LoadResult()
        self.last_done = record_from
        self.active = 0
        self.idle = asyncio.get_running_loop().create_future()
        self.connections: set[_Connection] = set()
        self.ok_status = 200
        """The status that counts as ok (503 when measuring an open breaker's fast failures)."""

    def more(self) -> bool:
        """Whether requests are still to be sent."""
        return self.budget > 0 if self.budget is not None else _now() < self.stop_at

    def may_send(self) -> bool:
        """Take one request from the run (False once the run is over)."""
        if self.budget is not None:
            if self.budget <= 0:
                return False
            self.budget -= 1
            return True
        return _now() < self.stop_at

    def record(self, sent: float, first: float, done: float, status: int) -> None:
        if sent < self.record_from:
            return
        result = self.result
        result.requests += 1
        result.statuses[status] += 1
        if status == self.ok_status:
            result.latencies.append(done - sent)
            result.ttfts.append(first - sent)
        self.last_done = done

    def finished(self) -> None:
        self.active -= 1
        if self.active == 0 and not self.idle.done():
            self.idle.set_result(None)


_HEAD, _BODY, _CHUNK_SIZE, _CHUNK_DATA, _TRAILER = range(5)


class _Connection(asyncio.Protocol):
    """One keep-alive connection sending one request at a time (no pipelining)."""

    def __init__(self, run: _Run) -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.state = _HEAD
        self.need = 0
        self.status = 0
        self.sent = 0.0
        self.first = 0.0
        self.tail = b""
        self.busy = False
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.run.connections.add(self)
        self._next()

    def _next(self) -> None:
        assert self.transport is not None
        if not self.run.may_send():
            self.busy = False
            self.transport.close()
            return
        self.busy = True
        self.state, self.buf, self.first, self.tail = _HEAD, b"", 0.0, b""
        self.sent = _now()
        self.transport.write(self.run.request)

    def data_received(self, data: bytes) -> None:
        if self.state != _HEAD and not self.first:
            self.first = _now()
        self.buf += data
        if self._parse():
            done = _now()
            if not self.first:
                self.first = done
            complete = self.state != _TRAILER or self.tail.endswith(_DONE_TAIL)
            ok = self.status == self.run.ok_status and complete
            self.run.record(self.sent, self.first, done, self.status if ok else 0)
            self._next()

    def _parse(self) -> bool:
        """Consume what the buffer holds; True once the whole response is in."""
        if self.state == _HEAD:
            end = self.buf.find(_HEAD_END)
            if end < 0:
                return False
            head = self.buf[:end].lower()
            self.buf = self.buf[end + 4 :]
            self.status = int(head[9:12])
            if self.buf:
                self.first = _now()
            if b"\r\ntransfer-encoding: chunked" in head:
                self.state = _CHUNK_SIZE
            else:
                start = head.find(b"\r\ncontent-length:")
                end = head.find(_CRLF, start + 2)
                self.need = int(head[start + 17 : end if end > 0 else len(head)]) if start >= 0 else 0
                self.state = _BODY
        if self.state == _BODY:
            return len(self.buf) >= self.need
        return self._chunks()

    def _chunks(self) -> bool:
        buf, pos = self.buf, 0
        while True:
            if self.state == _CHUNK_SIZE:
                end = buf.find(_CRLF, pos)
                if end < 0:
                    break
                self.need = int(buf[pos:end].split(b";", 1)[0], 16)
                pos = end + 2
                self.state = _CHUNK_DATA if self.need else _TRAILER
            elif self.state == _CHUNK_DATA:
                if len(buf) - pos < self.need + 2:
                    break
                data_end = pos + self.need
                self.tail = (self.tail + buf[max(pos, data_end - 16) : data_end])[-16:]
                pos = data_end + 2
                self.state = _CHUNK_SIZE
            else:
                if buf.find(_CRLF, pos) < 0:
                    break
                return True
        self.buf = buf[pos:]
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.run.connections.discard(self)
        if self.busy:
            self.run.record(self.sent, self.sent, _now(), 0)
        self.busy = False
        if not self.closed.done():
            self.closed.set_result(None)


async def _connection(run: _Run, host: str, port: int) -> None:
    """Keep one connection going until the run stops sending; reconnect if the server closes it."""
    loop = asyncio.get_running_loop()
    try:
        while run.more():
            try:
                _, protocol = await loop.create_connection(lambda: _Connection(run), host, port)
            except OSError:
                now = _now()
                run.record(now, now, now, 0)
                await asyncio.sleep(0.05)
                continue
            await protocol.closed
    finally:
        run.finished()


async def run_load(
    url: str,
    request: bytes,
    concurrency: int,
    seconds: float = 5.0,
    warmup: float = 0.5,
    max_requests: int | None = None,
    grace_s: float = 60.0,
    ok_status: int = 200,
) -> LoadResult:
    """Drive ``url``'s host with ``request`` on ``concurrency`` connections.

    Requests sent during the first ``warmup`` seconds are not recorded; no request is sent after
    ``warmup + seconds`` (or, with ``max_requests``, after that many). Responses still missing
    ``grace_s`` seconds after the end are given up and counted as errors.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    started = _now()
    stop_at = started + warmup + seconds if max_requests is None else float("inf")
    run = _Run(request, started + warmup, stop_at, max_requests)
    run.ok_status = ok_status
    cpu = time.process_time()
    run.active = concurrency
    tasks = [asyncio.create_task(_connection(run, host, port)) for _ in range(concurrency)]
    try:
        limit = (stop_at - started + grace_s) if max_requests is None else None
        await asyncio.wait_for(asyncio.shield(run.idle), limit)
    except TimeoutError:
        for connection in list(run.connections):
            if connection.transport is not None:
                connection.transport.abort()  # records the missing response as an error
        await asyncio.sleep(0.05)
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    result = run.result
    result.elapsed = max(run.last_done - run.record_from, 1e-9)
    result.client_cpu_s = time.process_time() - cpu
    return result


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (sorted or not); NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="base URL; /v1/chat/completions is appended unless it has a path")
    parser.add_argument("--key", default=None)
    parser.add_argument("--model", default="mock")
    parser.add_argument("-c", "--concurrency", type=int, default=16)
    parser.add_argument("-s", "--seconds", type=float, default=5.0)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    url = (
        args.url
        if urlsplit(args.url).path not in ("", "/")
        else args.url.rstrip("/") + "/v1/chat/completions"
    )
    request = build_request(url, chat_body(args.model, args.stream), args.key)
    result = uvloop.run(run_load(url, request, args.concurrency, args.seconds))
    ms = [percentile(result.latencies, q) * 1000 for q in (50, 90, 99)]
    ttft = percentile(result.ttfts, 50) * 1000
    print(
        f"{result.rate:,.0f} req/s  p50 {ms[0]:.2f} ms  p90 {ms[1]:.2f} ms  p99 {ms[2]:.2f} ms  "
        f"ttft p50 {ttft:.2f} ms  errors {result.errors} {dict(result.statuses)}  "
        f"client cpu {result.client_cpu_s / max(result.elapsed, 1e-9):.0%}"
    )


if __name__ == "__main__":
    main()
