"""Real worker processes: a chaos run with a killed and a frozen worker, and a graceful SIGTERM drain."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import Queue
from client.keys import GROUP
from client.records import TaskInfo
from tests.client.support import WorkerProcess, eventually, wait_status
from tests.harness import RedisServer

TASKS = 200


@pytest.fixture
def spawn(redis_server: RedisServer, queue: Queue, tmp_path: Path) -> Iterator[Spawner]:
    spawner = Spawner(redis_server.url, queue.name, tmp_path)
    yield spawner
    for worker in spawner.started:
        worker.kill()


class Spawner:
    def __init__(self, redis_url: str, queue: str, tmp: Path) -> None:
        self.redis_url, self.queue, self.tmp = redis_url, queue, tmp
        self.started: list[WorkerProcess] = []

    def __call__(self, *args: str) -> WorkerProcess:
        log = self.tmp / f"worker-{len(self.started)}.log"
        worker = WorkerProcess(log, self.redis_url, self.queue, *args, env={"MG_TEST_REDIS": self.redis_url})
        self.started.append(worker)
        return worker


async def _holding(queue: Queue, pid: int, step: str | None = None) -> set[str]:
    """Ids of the running tasks whose lease the worker process ``pid`` holds (in ``step``, if given)."""
    running = await queue.list_tasks("running", limit=1000)
    mine = [task for task in running if task.worker and task.worker.split(":")[1] == str(pid)]
    return {task.id for task in mine if step is None or task.step == step}


async def _all(queue: Queue, ids: list[str]) -> list[TaskInfo]:
    found = await asyncio.gather(*(queue.get(task_id) for task_id in ids))
    return [task for task in found if task is not None]


async def test_chaos_a_killed_and_a_frozen_worker_lose_nothing_and_duplicate_nothing(
    queue: Queue, spawn: Spawner
) -> None:
    counter = f"chaos-{uuid.uuid4().hex[:8]}"
    payloads = [{"n": n, "sleep": 0.1, "counter": counter} for n in range(TASKS)]
    ids = await asyncio.gather(*(queue.enqueue("chaos", p, max_attempts=5) for p in payloads))
    options = ("--concurrency", "8", "--lease-s", "1", "--poll-s", "0.05", "--backoff-scale", "0")
    killed, frozen, steady = spawn(*options), spawn(*options), spawn(*options)
    started = time.monotonic()

    async def both_mid_effect() -> bool:
        # the worst moment: the effect happened, its checkpoint is not written yet
        return bool(await _holding(queue, killed.pid, "effect")) and bool(await _holding(queue, frozen.pid))

    await eventually(both_mid_effect, 30, "the victims to hold tasks")
    killed.signal(signal.SIGKILL)
    frozen.signal(signal.SIGSTOP)  # from Redis' side the same as an event loop blocked for good
    orphaned = await _holding(queue, killed.pid)
    held = await _holding(queue, frozen.pid)
    assert orphaned and held

    async def reclaimed() -> bool:
        return all(task.status == "done" for task in await _all(queue, sorted(held | orphaned)))

    await eventually(reclaimed, 30, "the victims' tasks to be finished by other workers")
    frozen.signal(signal.SIGCONT)  # it wakes up holding leases that are no longer its own

    async def all_done() -> bool:
        return (await queue.counts())["done"] == TASKS

    await eventually(all_done, 60, f"all {TASKS} tasks to be done")
    elapsed = time.monotonic() - started
    for worker in (frozen, steady):
        worker.signal(signal.SIGTERM)
        assert await worker.exit_code() == 0, worker.output()

    tasks = await _all(queue, ids)
    assert [task.result for task in tasks] == [{"n": n, "doubled": 2 * n} for n in range(TASKS)]
    redis = queue.redis
    assert await redis.get(f"{counter}:count") == str(TASKS)  # the side effect happened once per task
    runs = int(await redis.get(f"{counter}:runs") or 0)
    assert runs >= TASKS
    assert await redis.hget(queue.keys.stats, "done") == str(TASKS)  # each task completed once
    assert await redis.xlen(queue.keys.stream) == 0
    assert (await redis.xpending(queue.keys.stream, GROUP))["pending"] == 0
    assert await redis.zcard(queue.keys.delayed) == 0
    for task in tasks:
        if task.id in held | orphaned:
            assert task.history[0].outcome == "lease_expired"
            assert task.worker is not None and str(frozen.pid) not in task.worker.split(":")
    assert "lease lost" in frozen.output()  # it noticed, and wrote nothing
    victims = f"{len(orphaned)} orphaned by SIGKILL, {len(held)} by SIGSTOP"
    print(f"\nchaos: {TASKS} tasks in {elapsed:.1f}s; {victims}")
    print(f"chaos: side-effect step ran {runs} times for {TASKS} effects")


async def test_sigterm_drains_in_flight_tasks_and_exits_zero(queue: Queue, spawn: Spawner) -> None:
    in_flight = [await queue.enqueue("slow", {"seconds": 1.5}) for _ in range(2)]
    worker = spawn("--concurrency", "2", "--lease-s", "1", "--grace-s", "10")

    async def both_started() -> bool:
        return len(await _holding(queue, worker.pid)) == 2

    await eventually(both_started, 30, "the worker to start both tasks")
    waiting = await queue.enqueue("slow", {"seconds": 1.5})
    worker.signal(signal.SIGTERM)
    assert await worker.exit_code() == 0, worker.output()
    for task_id in in_flight:
        task = await queue.get(task_id)
        assert task is not None and task.status == "done"
    task = await queue.get(waiting)
    assert task is not None and (task.status, task.attempt) == ("queued", 0)
    assert await queue.redis.smembers(queue.keys.workers) == set()
    assert (await queue.redis.xpending(queue.keys.stream, GROUP))["pending"] == 0


async def test_tasks_outliving_the_grace_period_are_left_for_another_worker(
    queue: Queue, spawn: Spawner
) -> None:
    task_id = await queue.enqueue("slow", {"seconds": 2})
    first = spawn("--lease-s", "0.5", "--grace-s", "0.2")
    await eventually(lambda: _holding(queue, first.pid), 30, "the first worker to start it")
    first.signal(signal.SIGTERM)
    assert await first.exit_code() == 0, first.output()
    task = await queue.get(task_id)
    assert task is not None and task.status == "running"  # not acknowledged, not failed
    spawn("--lease-s", "1")
    task = await wait_status(queue, task_id, "done", timeout=30)
    assert (task.history[0].outcome, task.history[-1].outcome) == ("lease_expired", "done")
