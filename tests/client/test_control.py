"""Steering tasks and fencing leases: timeouts, cancel, approve, concurrency, tenant limits."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx

from client import Fatal, NeedsHuman, Queue, TaskContext
from client.claim import Claim, Offer, claim
from client.keys import GROUP
from client.metrics import REGISTRY
from tests.client.support import eventually, hold, running_worker, wait_status
from tests.harness import free_port


async def test_a_hanging_handler_is_cut_by_the_task_timeout(queue: Queue) -> None:
    async def hang(ctx: TaskContext, payload: Any) -> None:
        await asyncio.Event().wait()

    task_id = await queue.enqueue("hang", max_attempts=2)
    async with running_worker(queue, {"hang": hang}, task_timeout_s=0.2):
        task = await wait_status(queue, task_id, "dead")
    assert task.error == "TimeoutError: the task ran longer than 0.2s"
    assert [h.outcome for h in task.history] == ["retrying", "dead"]


async def test_cancelling_a_queued_task_is_immediate(queue: Queue) -> None:
    ran: list[str] = []

    async def handler(ctx: TaskContext, payload: Any) -> None:
        ran.append(ctx.task_id)

    task_id = await queue.enqueue("k")
    assert await queue.cancel(task_id) == "cancelled"
    task = await queue.get(task_id)
    assert task is not None and task.status == "cancelled" and task.cancel_requested
    later = await queue.enqueue("k")
    async with running_worker(queue, {"k": handler}):
        await wait_status(queue, later, "done")
    assert ran == [later]
    assert await queue.cancel(task_id) == "cancelled"  # already: nothing changes
    assert await queue.redis.xlen(queue.keys.stream) == 0


async def test_cancelling_a_running_task_stops_it_at_the_next_step(queue: Queue) -> None:
    started, release = asyncio.Event(), asyncio.Event()
    steps: list[str] = []

    async def handler(ctx: TaskContext, payload: Any) -> None:
        async def first() -> None:
            steps.append("first")
            started.set()
            await release.wait()

        await ctx.step("first", first)
        await ctx.step("second", lambda: steps.append("second"))

    task_id = await queue.enqueue("k")
    async with running_worker(queue, {"k": handler}):
        await asyncio.wait_for(started.wait(), 5)
        assert await queue.cancel(task_id) == "running"
        release.set()
        task = await wait_status(queue, task_id, "cancelled")
    assert steps == ["first"]
    assert task.steps_done == ["first"] and task.history[-1].outcome == "cancelled"


async def test_needs_human_parks_and_approve_resumes_at_the_checkpoint(queue: Queue) -> None:
    runs: Counter[str] = Counter()
    approved: list[bool] = []

    async def handler(ctx: TaskContext, payload: Any) -> str:
        await ctx.step("draft", lambda: runs.update(["draft"]) or "a draft")
        if not approved:
            raise NeedsHuman("please review the draft")
        return await ctx.step("send", lambda: runs.update(["send"]) or "sent")

    task_id = await queue.enqueue("k", max_attempts=1)
    async with running_worker(queue, {"k": handler}):
        task = await wait_status(queue, task_id, "waiting_human")
        assert task.error == "NeedsHuman: please review the draft"
        assert not await queue.requeue(task_id)  # not dead
        approved.append(True)
        assert await queue.approve(task_id)
        assert not await queue.approve(task_id)  # no longer waiting
        task = await wait_status(queue, task_id, "done")
    assert runs == {"draft": 1, "send": 1}
    assert task.result == "sent" and task.attempt == 1  # approve gives a fresh attempt budget


async def test_a_waiting_task_can_be_cancelled(queue: Queue) -> None:
    async def handler(ctx: TaskContext, payload: Any) -> None:
        raise NeedsHuman("look")

    task_id = await queue.enqueue("k")
    async with running_worker(queue, {"k": handler}):
        await wait_status(queue, task_id, "waiting_human")
    assert await queue.cancel(task_id) == "cancelled"


async def test_concurrency_one_holds_one_task_and_prefetches_nothing(queue: Queue) -> None:
    gates = {i: asyncio.Event() for i in range(3)}
    running: list[int] = []

    async def handler(ctx: TaskContext, payload: Any) -> int:
        running.append(payload)
        await gates[payload].wait()
        return int(payload)

    ids = [await queue.enqueue("k", i) for i in range(3)]
    async with running_worker(queue, {"k": handler}, concurrency=1) as first:
        await eventually(lambda: len(running) == 1, what="the first task to start")
        pending = await queue.redis.xpending(queue.keys.stream, GROUP)
        assert pending["pending"] == 1  # nothing read ahead
        assert (await queue.counts())["queued"] == 2
        async with running_worker(queue, {"k": handler}, concurrency=1) as second:
            await eventually(lambda: len(running) == 2, what="the second worker to take one")
            assert len(first.running) == len(second.running) == 1
            for gate in gates.values():
                gate.set()
            for task_id in ids:
                await wait_status(queue, task_id, "done")
    assert sorted(running) == [0, 1, 2]


async def test_a_tenant_limit_holds_across_workers_and_defers(queue: Queue) -> None:
    await queue.set_tenant_limit("acme", 2)
    now = {"acme": 0, "other": 0}
    peak = Counter[str]()

    async def handler(ctx: TaskContext, payload: Any) -> None:
        tenant = ctx.tenant or "other"
        now[tenant] += 1
        peak[tenant] = max(peak[tenant], now[tenant])
        await asyncio.sleep(0.1)
        now[tenant] -= 1

    ids = [await queue.enqueue("k", tenant="acme") for _ in range(6)]
    ids += [await queue.enqueue("k", tenant="other") for _ in range(3)]
    options = {"concurrency": 4, "tenant_defer_s": 0.05}
    async with (
        running_worker(queue, {"k": handler}, **options),
        running_worker(queue, {"k": handler}, **options),
    ):
        for task_id in ids:
            task = await wait_status(queue, task_id, "done", "failed", "dead")
            assert task.status == "done" and task.attempt == 1
    assert peak["acme"] == 2 and peak["other"] >= 2


async def test_a_crashed_holder_does_not_leak_its_tenant_slot(queue: Queue) -> None:
    await queue.set_tenant_limit("acme", 1)
    crashed = await queue.enqueue("k", tenant="acme")
    await hold(queue, "worker-that-dies", lease_ms=200)
    later = await queue.enqueue("k", tenant="acme")

    async def handler(ctx: TaskContext, payload: Any) -> None:
        return None

    async with running_worker(queue, {"k": handler}, lease_s=1.0, tenant_defer_s=0.05):
        await wait_status(queue, later, "done")
        await wait_status(queue, crashed, "done")


async def test_a_worker_that_lost_its_lease_cannot_overwrite_the_new_owner(queue: Queue) -> None:
    task_id = await queue.enqueue("k")
    old = await hold(queue, "old-owner", lease_ms=100)
    assert await old.begin_step("s", side_effect=False) == "ok"
    await asyncio.sleep(0.15)  # let the old lease expire (a frozen worker)
    entries = await queue.redis.xclaim(queue.keys.stream, GROUP, "new-owner", 100, [old.offer.entry])
    assert [fields["task"] for _, fields in entries] == [task_id]
    new = await claim(queue, Offer(entries[0][0], task_id, ""), "new-owner", 5000, 100)
    assert isinstance(new, Claim) and new.attempt == 2
    # the old owner wakes up: every write is refused
    assert await old.heartbeat() == "lost"
    assert await old.end_step("s", '"stale"', (0, 0, 0)) == "lost"
    assert await old.complete('"stale result"') == "lost"
    assert await old.fail("failed", "stale error") == "lost"
    assert await new.complete('"fresh result"') == "done"
    assert await old.complete('"stale result"') == "lost"
    task = await queue.get(task_id)
    assert task is not None
    assert (task.status, task.result, task.worker, task.steps_done) == (
        "done",
        "fresh result",
        "new-owner",
        [],
    )
    assert [(h.worker, h.outcome) for h in task.history] == [
        ("old-owner", "lease_expired"),
        ("new-owner", "done"),
    ]
    assert await queue.redis.xlen(queue.keys.stream) == 0


async def test_a_lease_expiring_on_the_last_attempt_makes_the_task_dead(queue: Queue) -> None:
    task_id = await queue.enqueue("k", max_attempts=1)
    await hold(queue, "worker-that-dies", lease_ms=100)

    async def handler(ctx: TaskContext, payload: Any) -> None:
        raise AssertionError("must not run")

    async with running_worker(queue, {"k": handler}, lease_s=1.0):
        task = await wait_status(queue, task_id, "dead")
    assert task.error == "lease expired on the last attempt (1)"


async def test_workers_count_task_statuses_and_can_serve_them(queue: Queue) -> None:
    async def handler(ctx: TaskContext, payload: Any) -> None:
        if payload == "bad":
            raise Fatal("no")

    def count(status: str) -> float:
        labels = {"queue": queue.name, "status": status}
        return REGISTRY.get_sample_value("modelgate_tasks_total", labels) or 0

    ids = [await queue.enqueue("k", payload) for payload in ("ok", "ok", "ok", "bad")]
    port = free_port()
    async with running_worker(queue, {"k": handler}, metrics_port=port):
        for task_id in ids:
            await wait_status(queue, task_id, "done", "failed")
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    assert (count("done"), count("failed")) == (3, 1)
    assert f'modelgate_tasks_total{{queue="{queue.name}",status="done"}} 3.0' in text
