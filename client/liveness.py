"""Who is working: each worker keeps a heartbeat hash with a TTL, listed by ``modelgate tasks list``.

A worker's hash (``Q:worker:<id>``: id, host, pid, started, last beat, concurrency, running task
ids) is rewritten on every heartbeat and expires after ``ttl_s`` when the worker stops beating. The
set ``Q:workers`` names the hashes to look at; readers drop names whose hash has expired.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable
from typing import Any, cast

import msgspec
from redis.asyncio import Redis

from client.keys import QueueKeys


class WorkerInfo(msgspec.Struct, frozen=True):
    id: str
    host: str
    pid: int
    started: float
    last_beat: float
    concurrency: int
    running: list[str]


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


class Liveness:
    """One worker's heartbeat key."""

    def __init__(self, redis: Redis, keys: QueueKeys, worker_id: str, concurrency: int, ttl_s: float) -> None:
        self._redis = redis
        self._keys = keys
        self._key = keys.worker(worker_id)
        self._ttl_ms = max(int(ttl_s * 1000), 1000)
        self._static = {
            "id": worker_id,
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
            "started": str(time.time()),
            "concurrency": str(concurrency),
        }

    async def beat(self, running: Iterable[str]) -> None:
        fields: dict[Any, Any] = {**self._static, "last_beat": str(time.time())}
        fields["running"] = json.dumps(sorted(running))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key, mapping=fields)
            pipe.pexpire(self._key, self._ttl_ms)
            pipe.sadd(self._keys.workers, self._static["id"])
            await pipe.execute()

    async def remove(self) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key)
            pipe.srem(self._keys.workers, self._static["id"])
            await pipe.execute()


async def live_workers(redis: Redis, keys: QueueKeys) -> list[WorkerInfo]:
    """The workers whose heartbeat has not expired, oldest first; forgets the expired ones."""
    found: list[WorkerInfo] = []
    for worker_id in sorted(cast("set[str]", await redis.smembers(keys.workers))):
        fields = cast("dict[str, str]", await redis.hgetall(keys.worker(worker_id)))
        if not fields:
            await redis.srem(keys.workers, worker_id)
            continue
        found.append(_decode(fields))
    return sorted(found, key=lambda w: w.started)


def _decode(fields: dict[str, str]) -> WorkerInfo:
    return WorkerInfo(
        id=fields["id"],
        host=fields["host"],
        pid=int(fields["pid"]),
        started=float(fields["started"]),
        last_beat=float(fields["last_beat"]),
        concurrency=int(fields["concurrency"]),
        running=json.loads(fields["running"]),
    )
