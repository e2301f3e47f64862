"""A quick throughput sanity check of the mock upstream (not a test, not the real benchmark).

The mock must be much faster than the gateway it stands behind, or gateway benchmarks measure the
mock. This starts ``serve`` in a subprocess and drives non-stream chat requests over keep-alive
connections from a raw asyncio HTTP/1.1 client (an HTTP library would be the bottleneck), then
prints requests per second::

    python -m loadtest.mock_bench [--concurrency 16] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

import msgspec
import uvloop

_SERVE = (
    "import sys; from loadtest.mock_upstream import MockSettings, serve; "
    "serve('127.0.0.1', int(sys.argv[1]), MockSettings())"
)
_BODY = msgspec.json.encode({"model": "mock", "messages": [{"role": "user", "content": "hello"}]})
_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _wait_ready(port: int, deadline_s: float = 15.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One request and its whole response on a keep-alive connection."""
    writer.write(_REQUEST)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode("latin-1"))
    lines = head.lower().split(b"\r\n")
    length = next(int(line[15:]) for line in lines if line.startswith(b"content-length:"))
    await reader.readexactly(length)


async def _worker(port: int, stop_at: float) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    done = 0
    try:
        while time.monotonic() < stop_at:
            await _one(reader, writer)
            done += 1
    finally:
        writer.close()
        await writer.wait_closed()
    return done


async def measure(port: int, concurrency: int, seconds: float) -> float:
    """Requests per second over ``seconds`` with ``concurrency`` connections."""
    await _wait_ready(port)
    started = time.monotonic()
    counts = await asyncio.gather(*(_worker(port, started + seconds) for _ in range(concurrency)))
    return sum(counts) / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVE, str(port)])
    try:
        rate = uvloop.run(measure(port, args.concurrency, args.seconds))
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"non-stream, concurrency {args.concurrency}, {args.seconds:g} s: {rate:,.0f} requests/s")


if __name__ == "__main__":
    main()
