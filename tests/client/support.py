"""Helpers for the queue client tests: polling with deadlines, in-process and real worker processes,
a scripted fake gateway, and a way to hold a lease by hand (to play a worker that then dies)."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import uvicorn

from client import Queue, Worker
from client.claim import Claim, Offer, claim
from client.keys import GROUP
from client.records import TaskInfo
from client.retry import Backoff
from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
FAST = {"lease_s": 5.0, "poll_s": 0.02, "grace_s": 1.0, "backoff": Backoff(scale=0)}


async def eventually(
    check: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0, what: str = "it"
) -> None:
    """Poll ``check`` (sync or async) until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if await result if inspect.isawaitable(result) else result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_status(queue: Queue, task_id: str, *statuses: str, timeout: float = 10.0) -> TaskInfo:
    found: list[TaskInfo] = []

    async def reached() -> bool:
        task = await queue.get(task_id)
        found[:] = [task] if task else []
        return task is not None and task.status in statuses

    await eventually(reached, timeout, f"task {task_id} to be {'/'.join(statuses)}")
    return found[0]


@asynccontextmanager
async def running_worker(queue: Queue, handlers: Mapping[str, Any], **options: Any) -> AsyncIterator[Worker]:
    """A worker running in this event loop for the duration of the block."""
    worker = Worker(queue, handlers, **{**FAST, **options})
    task = asyncio.create_task(worker.run(install_signals=False))
    try:
        yield worker
    finally:
        worker.stop()
        done, _ = await asyncio.wait({task}, timeout=15)
        if not done:
            task.cancel()
            raise AssertionError(f"worker did not stop; it still runs {worker.running}")
        task.result()


async def hold(queue: Queue, consumer: str, lease_ms: int = 200) -> Claim:
    """Take the next task as a worker called ``consumer`` would, without running it."""
    await queue.ensure_group()
    reply = await queue.redis.xreadgroup(GROUP, consumer, {queue.keys.stream: ">"}, count=1, block=1000)
    [(_, [(entry, fields)])] = reply
    got = await claim(queue, Offer(entry, fields["task"], fields.get("tenant", "")), consumer, lease_ms, 100)
    assert isinstance(got, Claim), got
    return got


@dataclass
class Seen:
    at: float
    headers: dict[str, str]
    body: Any


COMPLETION = {
    "id": "chatcmpl-fake",
    "object": "chat.completion",
    "created": 0,
    "model": "fake",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
}


@dataclass
class FakeGateway:
    """A minimal OpenAI-compatible server on 127.0.0.1: scripted answers, then 200s; records requests."""

    port: int = field(default_factory=free_port)
    replies: deque[tuple[int, dict[str, str], Any]] = field(default_factory=deque)
    seen: list[Seen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def reply(self, status: int, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        body = {"error": {"message": f"fake {status}", "type": "fake", "param": None, "code": code}}
        self.replies.append((status, {"x-should-retry": "false", **(headers or {})}, body))

    def reset(self) -> None:
        self.replies.clear()
        self.seen.clear()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append(Seen(time.monotonic(), headers, msgspec.json.decode(body or b"null")))
        status, extra, answer = self.replies.popleft() if self.replies else (200, {}, COMPLETION)
        raw = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in extra.items())]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": msgspec.json.encode(answer)})

    def start(self) -> FakeGateway:
        config = uvicorn.Config(
            self, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off", ws="none"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


class WorkerProcess:
    """``python -m client.cli worker ...`` in its own process group, output to a file."""

    def __init__(
        self, log: Path, redis_url: str, queue: str, *args: str, env: Mapping[str, str] = {}
    ) -> None:
        self.log = log
        command = [sys.executable, "-m", "client.cli", "worker", "tests.client.proc_handlers:handlers"]
        command += ["--redis", redis_url, "--queue", queue, *args]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def exit_code(self, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {self.pid} did not exit:\n{self.output()}")
            await asyncio.sleep(0.02)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
