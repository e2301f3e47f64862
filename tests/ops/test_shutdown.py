"""Graceful shutdown of a real ``modelgate serve``: SIGTERM while 20 streams are in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import TENANT_KEY, gateway_config
from tests.harness import Gateway, MockUpstream, RedisServer

STREAMS = 20
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}], "stream": True}
AUTH = {"authorization": f"Bearer {TENANT_KEY}"}


def refused(port: int) -> bool:
    """Whether a new connection is turned away (refused, or reset unanswered) rather than served
    or left hanging in a listener's backlog that no process accepts from any more."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            return sock.recv(64) == b""
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    except TimeoutError:
        return False


async def stream_events(client: httpx.AsyncClient, started: asyncio.Event, count: list[int]) -> list[str]:
    events: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=BODY, headers=AUTH) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 1:
                    count[0] += 1
                    if count[0] == STREAMS:
                        started.set()
    return events


def metrics_dir(pid: int) -> Path | None:
    """The ``PROMETHEUS_MULTIPROC_DIR`` a ``serve`` process gave its workers (None: it has none)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        for entry in environ:
            if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                return Path(entry.split(b"=", 1)[1].decode())
    return None


async def drain_under_sigterm(gateway: Gateway) -> tuple[list[list[str]], bool, str]:
    limits = httpx.Limits(max_connections=STREAMS + 5)
    async with (
        httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=30) as streams,
        httpx.AsyncClient(base_url=gateway.url, timeout=5) as keep_alive,
    ):
        assert (await keep_alive.get("/readyz")).status_code == 200
        started, count = asyncio.Event(), [0]
        tasks = [asyncio.create_task(stream_events(streams, started, count)) for _ in range(STREAMS)]
        await asyncio.wait_for(started.wait(), 10)
        assert gateway.process.proc is not None
        os.kill(gateway.process.proc.pid, signal.SIGTERM)  # the main process only, as orchestrators do
        deadline = time.monotonic() + 1.5
        while not await asyncio.to_thread(refused, gateway.port):
            assert time.monotonic() < deadline, "new connections are still accepted after SIGTERM"
            await asyncio.sleep(0.05)
        draining = not all(t.done() for t in tasks)
        try:
            readiness = str((await keep_alive.get("/readyz")).status_code)
        except httpx.HTTPError:
            readiness = "closed"  # uvicorn closes idle keep-alive connections when the drain starts
        return await asyncio.gather(*tasks), draining, readiness


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_lets_streams_finish_refuses_new_connections_and_exits_0(
    session_tmp: Path, upstream: MockUpstream, redis_server: RedisServer, workers: int
) -> None:
    upstream.configure(chunk_delay_ms=170)  # 12 chunks: about 2 s per stream
    config = gateway_config(upstream.url, request_timeout_s=30)
    if workers > 1:
        config += f'\n[redis]\nurl = "{redis_server.url}"\nprefix = "drain{workers}"\n'
    gateway = Gateway(session_tmp, config, workers).start()
    try:
        assert gateway.process.proc is not None
        directory = metrics_dir(gateway.process.proc.pid)
        assert (directory is not None and directory.is_dir()) == (workers > 1)
        results, draining, readiness = await drain_under_sigterm(gateway)
        assert draining, "the streams ended before new connections were refused"
        assert readiness in {"503", "closed"}
        assert len(results) == STREAMS
        for events in results:
            assert events[-1] == "data: [DONE]"
            assert '"finish_reason":"stop"' in events[-2]
            assert len(events) == len(results[0])  # whole: none was cut short
        assert await asyncio.to_thread(gateway.process.proc.wait, 15) == 0
        assert directory is None or not directory.exists(), "the metrics directory outlived the server"
    finally:
        gateway.stop()
