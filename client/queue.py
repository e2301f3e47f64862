"""The producer and operator side of a queue: enqueue durably, read records, steer tasks.

A :class:`Queue` names one queue in one Redis. Producers ``enqueue``; operators (and the
``modelgate tasks`` verbs) ``get``, ``list``, ``cancel``, ``approve``, ``requeue`` and read the
fleet's state; :class:`~client.worker.Worker` uses the same object to claim and run tasks. Every
change is one Lua script (:mod:`client.scripts`), so a record and its queue entry never disagree.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, cast

import msgspec
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from client.keys import GROUP, STATUSES, QueueKeys
from client.records import TaskInfo, task_info
from client.scripts import Scripts

DEFAULT_MAX_ATTEMPTS = 3


class Queue:
    """One named queue.

    ``redis`` is a URL or a client to share (made with ``decode_responses=True``). From a URL the
    queue owns a pool of up to ``max_connections`` that makes callers wait for a free connection
    rather than fail, so thousands of concurrent enqueues are fine.
    """

    def __init__(self, redis: str | Redis, name: str = "default", *, max_connections: int = 64) -> None:
        self.keys = QueueKeys(name)
        self.name = name
        self._owns = isinstance(redis, str)
        self.redis: Redis = _client(redis, max_connections) if isinstance(redis, str) else redis
        if not self.redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("the Redis client must be created with decode_responses=True")
        self.scripts = Scripts(self.redis)
        self._group_ready = False

    async def close(self) -> None:
        if self._owns:
            await self.redis.aclose()

    async def __aenter__(self) -> Queue:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def ensure_group(self) -> None:
        """Create the stream and its consumer group if they do not exist yet."""
        if self._group_ready:
            return
        try:
            await self.redis.xgroup_create(self.keys.stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    async def enqueue(
        self,
        kind: str,
        payload: Any = None,
        *,
        idempotency_key: str | None = None,
        tenant: str | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> str:
        """Store a task and queue it, atomically; durable once this returns. Returns the task id.

        The same ``idempotency_key`` on this queue returns the first task's id and stores nothing.
        """
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        task_id = uuid.uuid4().hex
        body = msgspec.json.encode(payload).decode()
        keys = [*self.keys.index, self.keys.task(task_id), self.keys.stream, self.keys.idem]
        args: list[Any] = [task_id, kind, body, tenant or "", max_attempts, idempotency_key or ""]
        result: str = await self.scripts("enqueue", keys, args)
        return result

    async def get(self, task_id: str) -> TaskInfo | None:
        """The task's record, or ``None`` if this queue has no such task."""
        fields = cast("dict[str, str]", await self.redis.hgetall(self.keys.task(task_id)))
        return task_info(self.name, fields) if fields else None

    async def cancel(self, task_id: str) -> str | None:
        """Cancel: a task not yet running reads ``cancelled`` at once; a running one stops at its next
        step boundary. Returns the status afterwards (``running`` while that stop is pending), or
        ``None`` for an unknown task."""
        keys = [*self.keys.index, self.keys.task(task_id), self.keys.stream, self.keys.delayed]
        _, status = await self.scripts("cancel", [*keys, self.keys.stats], [GROUP, task_id])
        return str(status) or None

    async def approve(self, task_id: str, resolve: Mapping[str, Any] | None = None) -> bool:
        """``waiting_human`` -> ``queued``, resuming at its checkpoint with a fresh attempt budget.

        ``resolve`` maps in-doubt side-effect steps to the output they had (a human checked): those
        become checkpoints. Any other in-doubt step will run again. ``False`` if not waiting.
        """
        keys = [*self.keys.index, self.keys.task(task_id), self.keys.steps(task_id), self.keys.stream]
        args: list[str] = [task_id]
        for name, output in (resolve or {}).items():
            args += [name, msgspec.json.encode(output).decode()]
        changed, _ = await self.scripts("approve", keys, args)
        return bool(changed)

    async def requeue(self, task_id: str) -> bool:
        """``dead``, ``failed`` or ``cancelled`` -> ``queued``; attempts reset, history kept."""
        keys = [*self.keys.index, self.keys.task(task_id), self.keys.stream]
        changed, _ = await self.scripts("requeue", keys, [task_id])
        return bool(changed)

    async def purge(
        self, older_than_s: float, statuses: Sequence[str] = ("done", "cancelled"), batch: int = 200
    ) -> int:
        """Delete tasks in ``statuses`` (finished ones only) not updated for ``older_than_s``: their
        records, checkpoints and idempotency keys. Returns how many were deleted.

        Nothing else ever deletes a task, so run this on a schedule (``modelgate tasks purge``) to
        keep Redis from growing with every task ever run.
        """
        unknown = set(statuses) - set(PURGEABLE)
        if unknown:
            raise ValueError(
                f"only finished tasks can be purged ({', '.join(PURGEABLE)}), not {sorted(unknown)}"
            )
        seconds, micros = await self.redis.time()
        cutoff = int((seconds + micros / 1e6 - older_than_s) * 1000)
        purged = 0
        for status in statuses:
            while True:
                index = self.keys.status(status)
                ids = [str(i) for i in await self.redis.zrangebyscore(index, "-inf", f"({cutoff}", 0, batch)]
                if not ids:
                    break
                task_keys = [k for i in ids for k in (self.keys.task(i), self.keys.steps(i))]
                keys = [*self.keys.index, self.keys.idem, *task_keys]
                purged += int(await self.scripts("purge", keys, [cutoff, status, *ids]))
                if len(ids) < batch:
                    break
        return purged

    async def set_tenant_limit(self, tenant: str, limit: int | None) -> None:
        """At most ``limit`` tasks of ``tenant`` run at once across every worker (``None``: no limit).

        Tasks over the limit stay ``queued`` and are tried again shortly."""
        if limit is None:
            await self.redis.hdel(self.keys.limits, tenant)
        else:
            await self.redis.hset(self.keys.limits, tenant, str(limit))

    async def list_tasks(self, status: str | None = None, limit: int = 50) -> list[TaskInfo]:
        """The most recently updated tasks, newest first, in ``status`` or in any status."""
        statuses = [status] if status else list(STATUSES)
        for name in statuses:
            if name not in STATUSES:
                raise ValueError(f"unknown status {name!r}; one of {', '.join(STATUSES)}")
        ranked: list[tuple[str, float]] = []
        for name in statuses:
            found = await self.redis.zrevrange(self.keys.status(name), 0, limit - 1, withscores=True)
            ranked += cast("list[tuple[str, float]]", found)
        ids = [task_id for task_id, _ in sorted(ranked, key=lambda item: item[1], reverse=True)[:limit]]
        records = await asyncio.gather(*(self.get(task_id) for task_id in ids))
        return [record for record in records if record is not None]

    async def dead(self, limit: int = 50) -> list[TaskInfo]:
        return await self.list_tasks("dead", limit)

    async def counts(self) -> dict[str, int]:
        """How many tasks are in each status."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in self.keys.index:
                pipe.zcard(key)
            sizes = await pipe.execute()
        return dict(zip(STATUSES, (int(size) for size in sizes), strict=True))

    async def stalled(self) -> list[TaskInfo]:
        """Running tasks whose lease has expired and that no worker has taken over yet."""
        seconds, micros = await self.redis.time()
        now = seconds + micros / 1e6
        running = await self.list_tasks("running", limit=1000)
        return [task for task in running if task.lease_until is not None and task.lease_until < now]


PURGEABLE = ("done", "cancelled", "failed", "dead")
"""The statuses a task never leaves by itself (``requeue`` can bring failed and dead ones back)."""


def _client(url: str, max_connections: int) -> Redis:
    # A pool made this way gives its connections no retry at all, so a connection left idle across
    # a Redis restart failed its next command ("Connection closed by server") although Redis was
    # back: the soak saw task attempts fail that way a minute after a restart. One immediate retry
    # on a fresh connection covers it; more would only hold callers while Redis is really down.
    pool = BlockingConnectionPool.from_url(
        url, decode_responses=True, max_connections=max_connections, retry=Retry(NoBackoff(), 1)
    )
    return Redis.from_pool(pool)
