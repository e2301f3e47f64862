"""The worker: claims tasks from the shared stream, runs them under renewed leases, drains on stop.

Design (why Streams plus a fenced lease). Each queued task has one entry in a Redis stream read
by one consumer group, so any number of workers on any number of machines share the queue and
Redis hands each entry to exactly one of them (XREADGROUP). Delivery alone is not ownership: a
worker turns an entry into a *lease* with ``claim.lua``, which writes a fresh random token and
``lease_until`` into the task record. While the handler runs, a heartbeat renews ``lease_until``
and, in the same script, resets the entry's idle time in the group's pending list (XCLAIM JUSTID).
A worker that dies, freezes (SIGSTOP, a blocked event loop) or is cut off stops renewing both, so
after ``lease_s`` its entries show up as idle in the pending list (XPENDING IDLE) for any other
worker, which takes them with XCLAIM; its ``claim.lua`` takes over only if ``lease_until`` really
passed, records the lost attempt and issues a new token. Every
write of an attempt checks its token atomically (see :mod:`client.claim`), so the old holder, if it
wakes up, cannot overwrite the new owner's result. The entry is acknowledged in the same script
that stores the result. Retries and deferred tasks wait in a sorted set that workers promote back
to the stream when due, so no handler slot sleeps.

A worker reads only as many entries as it has free slots (``concurrency=1``: one task at a time,
no prefetch). ``stop()`` (SIGTERM/SIGINT under ``run()``) stops claiming, hands back entries it
was delivered but had not started, lets running tasks finish within ``grace_s`` and leaves the
rest, unacknowledged, to be reclaimed when their leases expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast
from wsgiref.simple_server import WSGIServer

import openai
from redis.asyncio import Redis
from redis.exceptions import RedisError

from client import metrics
from client.claim import Claim, Offer, claim, promote, redis_now_ms, release
from client.context import TaskContext
from client.keys import GROUP
from client.liveness import Liveness, new_worker_id
from client.queue import Queue
from client.retry import Backoff
from client.runner import Handler, Runner

log = logging.getLogger("modelgate.client")

MAX_BLOCK_S = 0.5


@dataclass
class _Job:
    claim: Claim
    ctx: TaskContext
    task: asyncio.Task[str]


class Worker:
    """Runs the handlers (``kind -> async def handler(ctx, payload)``) for tasks of ``queue``."""

    def __init__(
        self,
        queue: Queue,
        handlers: Mapping[str, Handler],
        *,
        gateway_url: str | None = None,
        gateway_key: str | None = None,
        concurrency: int = 1,
        lease_s: float = 30.0,
        task_timeout_s: float = 3600.0,
        grace_s: float = 30.0,
        backoff: Backoff | None = None,
        poll_s: float = 0.25,
        tenant_defer_s: float = 0.5,
        metrics_port: int | None = None,
    ) -> None:
        if concurrency < 1 or lease_s <= 0 or task_timeout_s <= 0 or poll_s <= 0:
            raise ValueError("concurrency, lease_s, task_timeout_s and poll_s must be positive")
        if gateway_url and not gateway_key:
            raise ValueError("gateway_key is required with gateway_url")
        self.queue = queue
        self.concurrency = concurrency
        self.worker_id = new_worker_id()
        self._gateway = (gateway_url, gateway_key or "")
        self._client: openai.AsyncOpenAI | None = None
        self._lease_ms = int(lease_s * 1000)
        self._defer_ms = int(tenant_defer_s * 1000)
        self._beat_s = lease_s / 3
        self._reclaim_s = max(poll_s, lease_s / 4)
        self._poll_s = poll_s
        self._grace_s = grace_s
        self._metrics_port = metrics_port
        self._metrics_server: WSGIServer | None = None
        self._runner = Runner(handlers, self._model_for, task_timeout_s, backoff or Backoff())
        self._liveness = Liveness(queue.redis, queue.keys, self.worker_id, concurrency, 3 * self._beat_s + 1)
        self._running: dict[str, _Job] = {}
        self._stop = asyncio.Event()
        self._halt = asyncio.Event()  # ends the heartbeat and promote loops
        self._wake = asyncio.Event()
        self._next_reclaim = 0.0
        self._clock_offset_ms = 0.0
        self._next_clock = 0.0
        self._reader: Redis | None = None  # the connection that blocks in XREADGROUP
        self._reader_id: int | None = None
        self._unblocking: asyncio.Task[None] | None = None

    def stop(self) -> None:
        """Stop claiming and drain (what SIGTERM and SIGINT do). Call it from the worker's loop."""
        if self._stop.is_set():
            return
        log.info("worker %s stopping: %d task(s) in flight", self.worker_id, len(self._running))
        self._stop.set()
        self._wake.set()
        with contextlib.suppress(RuntimeError):  # no running loop: the read ends within MAX_BLOCK_S
            self._unblocking = asyncio.get_running_loop().create_task(self._unblock())

    async def _unblock(self) -> None:
        """End the blocked XREADGROUP now (CLIENT UNBLOCK) instead of at its timeout."""
        if self._reader_id is not None:
            with contextlib.suppress(RedisError):
                await self.queue.redis.client_unblock(self._reader_id)

    @property
    def running(self) -> list[str]:
        """Ids of the tasks this worker holds now."""
        return list(self._running)

    async def run(self, *, install_signals: bool = True) -> None:
        """Work until :meth:`stop` (or SIGTERM/SIGINT when ``install_signals``), then drain and return."""
        await self.queue.ensure_group()
        if self._metrics_port is not None:
            self._metrics_server = metrics.serve(self._metrics_port)
        signals = self._install_signals() if install_signals else []
        await self._liveness.beat(())
        background = [asyncio.create_task(self._beat_loop()), asyncio.create_task(self._promote_loop())]
        log.info("worker %s on queue %s: concurrency %d", self.worker_id, self.queue.name, self.concurrency)
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            self._halt.set()
            await _cancel_all(background)
            self._remove_signals(signals)
            await self._shutdown()

    async def _shutdown(self) -> None:
        await self._close_reader()
        try:
            await self._liveness.remove()
            await self._leave_group()
        except RedisError as exc:
            log.warning("could not deregister worker: %s", exc)
        if self._client is not None:
            await self._client.close()
        if self._metrics_server is not None:
            await asyncio.to_thread(self._metrics_server.shutdown)
            self._metrics_server.server_close()
        log.info("worker %s stopped", self.worker_id)

    async def _leave_group(self) -> None:
        """Drop this worker's consumer from the group unless it still has entries pending (tasks left
        for reclaim must stay in the pending list)."""
        stream = self.queue.keys.stream
        held = await self.queue.redis.xpending_range(stream, GROUP, "-", "+", 1, consumername=self.worker_id)
        if not held:
            await self.queue.redis.xgroup_delconsumer(stream, GROUP, self.worker_id)

    def _install_signals(self) -> list[signal.Signals]:
        loop = asyncio.get_running_loop()
        sigs = [signal.SIGTERM, signal.SIGINT]
        for sig in sigs:
            loop.add_signal_handler(sig, self.stop)
        return sigs

    def _remove_signals(self, sigs: list[signal.Signals]) -> None:
        loop = asyncio.get_running_loop()
        for sig in sigs:
            loop.remove_signal_handler(sig)

    def _model_for(self, task_id: str) -> openai.AsyncOpenAI:
        url, key = self._gateway
        if not url:
            raise RuntimeError("no gateway: pass gateway_url (--gateway-url or MODELGATE_GATEWAY_URL)")
        if self._client is None:
            self._client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        return self._client.with_options(default_headers={"X-Task-Id": task_id})

    def _free(self) -> int:
        return self.concurrency - len(self._running)

    async def _claim_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            free = self._free()
            if free <= 0:
                await self._wake.wait()
                continue
            try:
                offers = await self._reclaimable(free) or await self._read(free)
                await asyncio.gather(*(self._take(offer) for offer in offers))
            except RedisError as exc:
                log.warning("claiming failed, retrying: %s", exc)
                await self._close_reader()  # a new connection has a new client id
                await _sleep_unless(self._stop, self._poll_s)
        await self._close_reader()

    async def _close_reader(self) -> None:
        reader, self._reader, self._reader_id = self._reader, None, None
        if reader is not None:
            with contextlib.suppress(RedisError):
                await reader.aclose()

    async def _read(self, count: int) -> list[Offer]:
        if self._reader is None:
            self._reader = Redis(
                connection_pool=self.queue.redis.connection_pool, single_connection_client=True
            )
            self._reader_id = int(await self._reader.client_id())
        block_ms = int(min(MAX_BLOCK_S, self._reclaim_s) * 1000)
        streams: dict[Any, Any] = {self.queue.keys.stream: ">"}
        reply = await self._reader.xreadgroup(GROUP, self.worker_id, streams, count=count, block=block_ms)
        return [offer for _, entries in cast("list[Any]", reply or []) for offer in _offers(entries)]

    async def _reclaimable(self, count: int) -> list[Offer]:
        """Entries whose holder stopped renewing its lease (or never claimed them), now ours.

        XPENDING with IDLE finds them in one pass over the pending list; XCLAIM with the same
        minimum idle time takes them atomically, so two workers never both get one.
        """
        now = time.monotonic()
        if now < self._next_reclaim:
            return []
        self._next_reclaim = now + self._reclaim_s
        redis, stream = self.queue.redis, self.queue.keys.stream
        idle = await redis.xpending_range(stream, GROUP, "-", "+", count, idle=self._lease_ms)
        if not idle:
            return []
        ids: list[Any] = [item["message_id"] for item in idle]
        taken = await redis.xclaim(stream, GROUP, self.worker_id, self._lease_ms, ids)
        return _offers(cast("list[Any]", taken))

    async def _take(self, offer: Offer) -> None:
        if self._stop.is_set():
            await release(self.queue, offer)
            return
        got = await claim(self.queue, offer, self.worker_id, self._lease_ms, self._defer_ms)
        if isinstance(got, str):
            if got in ("dead", "cancelled"):
                metrics.record(self.queue.name, got)
            log.debug("task=%s not claimed: %s", offer.task_id, got)
            return
        self._start(got)

    def _start(self, got: Claim) -> None:
        ctx = TaskContext(got, self._model_for)
        task = asyncio.create_task(self._runner.run(got, ctx), name=f"task-{got.task_id}")
        self._running[got.task_id] = _Job(got, ctx, task)
        task.add_done_callback(lambda done: self._finished(got.task_id, done))

    def _finished(self, task_id: str, done: asyncio.Task[str]) -> None:
        self._running.pop(task_id, None)
        self._wake.set()
        if not done.cancelled() and done.exception() is not None:
            log.error("task=%s could not be finished, left for reclaim: %r", task_id, done.exception())

    async def _beat_loop(self) -> None:
        while not await _sleep_unless(self._halt, self._beat_s):
            try:
                await self._beat()
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    async def _beat(self) -> None:
        jobs = [job for job in self._running.values() if not job.claim.ending]
        replies = await asyncio.gather(*(job.claim.heartbeat() for job in jobs))
        for job, reply in zip(jobs, replies, strict=True):
            if reply == "lost" and not job.claim.ending:
                log.warning("lease lost: task=%s attempt=%d stopped", job.claim.task_id, job.claim.attempt)
                job.task.cancel()
            elif reply == "cancel":
                job.ctx.note(reply)
        await self._liveness.beat(self._running)

    async def _promote_loop(self) -> None:
        while not await _sleep_unless(self._halt, self._poll_s):
            try:
                await promote(self.queue, await self._redis_now_ms())
            except RedisError as exc:
                log.warning("promoting delayed tasks failed: %s", exc)

    async def _redis_now_ms(self) -> float:
        """Redis time, estimated from the local clock and an offset measured every 30 s."""
        if time.monotonic() >= self._next_clock:
            self._clock_offset_ms = await redis_now_ms(self.queue) - time.time() * 1000
            self._next_clock = time.monotonic() + 30
        return time.time() * 1000 + self._clock_offset_ms

    async def _drain(self) -> None:
        tasks = [job.task for job in self._running.values()]
        if not tasks:
            return
        log.info("draining %d task(s), grace %gs", len(tasks), self._grace_s)
        _, pending = await asyncio.wait(tasks, timeout=self._grace_s)
        if pending:
            log.warning("%d task(s) still running after the grace period: left for reclaim", len(pending))
        await _cancel_all(list(pending))


def _offers(entries: list[Any]) -> list[Offer]:
    # Redis 6.2 reports entries deleted while pending as nil fields; they have nothing to claim.
    return [Offer(entry, fields["task"], fields.get("tenant", "")) for entry, fields in entries if fields]


async def _cancel_all(tasks: list[asyncio.Task[Any]], attempts: int = 5) -> None:
    """Cancel ``tasks`` and wait for them, cancelling again a few times: on Python 3.11 a cancel that
    lands while redis-py sends a command can be lost (``asyncio.wait_for``, CPython gh-86296)."""
    pending = {task for task in tasks if not task.done()}
    for _ in range(attempts):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)
    if pending:
        log.warning("%d task(s) ignored cancellation; abandoning them", len(pending))


async def _sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` or until ``event`` is set; whether it is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
    return event.is_set()
