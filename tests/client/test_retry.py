"""Retries: backoff with full jitter, the gateway's retry-after as a floor, fatal answers, dead tasks."""

from __future__ import annotations

import itertools
import statistics
import time
from email.utils import formatdate
from typing import Any

import pytest

from client import Fatal, NeedsHuman, Queue, Retryable, TaskContext
from client.retry import MAX_RETRY_AFTER_S, Backoff, classify, retry_after_s
from tests.client.support import FakeGateway, running_worker, wait_status


def test_backoff_is_exponential_with_full_jitter() -> None:
    top = Backoff(base_s=0.5, max_s=4.0, rng=lambda: 1.0)
    assert [top.delay(attempt) for attempt in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert Backoff(base_s=0.5, rng=lambda: 0.0).delay(3) == 0.0
    samples = [Backoff(base_s=1.0, max_s=60.0).delay(4) for _ in range(4000)]
    assert 0.0 <= min(samples) < 0.5 and 7.5 < max(samples) <= 8.0
    assert 3.7 < statistics.mean(samples) < 4.3  # uniform over [0, 8]


def test_backoff_can_be_scaled_or_switched_off_but_a_floor_holds() -> None:
    assert Backoff(base_s=1.0, rng=lambda: 1.0, scale=0.1).delay(2) == pytest.approx(0.2)
    assert Backoff(scale=0).delay(9) == 0.0
    assert Backoff(scale=0).delay(9, floor_s=1.5) == 1.5
    assert Backoff(base_s=1.0, rng=lambda: 0.5).delay(1, floor_s=0.2) == 0.5


def test_retry_after_headers() -> None:
    assert retry_after_s({"retry-after-ms": "250", "retry-after": "1"}) == 0.25
    assert retry_after_s({"retry-after": "2"}) == 2.0
    assert 9 < retry_after_s({"retry-after": formatdate(time.time() + 10, usegmt=True)}) <= 10
    assert retry_after_s({"retry-after": "soon"}) == 0.0
    assert retry_after_s({"retry-after-ms": "x", "retry-after": "-3"}) == 0.0
    assert retry_after_s({"retry-after": "1e9"}) == MAX_RETRY_AFTER_S
    assert retry_after_s({}) == 0.0


def test_what_a_handler_raises_decides_the_outcome() -> None:
    assert classify(NeedsHuman("check")).outcome == "waiting_human"
    assert classify(Fatal("no")).outcome == "failed"
    assert classify(Retryable("later", retry_after_s=3)).floor_s == 3
    verdict = classify(KeyError("x"))
    assert (verdict.outcome, verdict.error) == ("retry", "KeyError: 'x'")


async def test_a_poison_task_is_dead_with_its_errors_then_requeue_runs_it(queue: Queue) -> None:
    fixed: list[bool] = []

    async def handler(ctx: TaskContext, payload: Any) -> str:
        if not fixed:
            raise ValueError(f"cannot parse, attempt {ctx.attempt}")
        return "parsed"

    task_id = await queue.enqueue("parse", max_attempts=3)
    async with running_worker(queue, {"parse": handler}):
        dead = await wait_status(queue, task_id, "dead")
        assert dead.error == "ValueError: cannot parse, attempt 3"
        assert [(h.attempt, h.outcome) for h in dead.history] == [
            (1, "retrying"),
            (2, "retrying"),
            (3, "dead"),
        ]
        assert [h.error for h in dead.history] == [
            f"ValueError: cannot parse, attempt {i}" for i in (1, 2, 3)
        ]
        assert [t.id for t in await queue.dead()] == [task_id]
        fixed.append(True)
        assert await queue.requeue(task_id)
        done = await wait_status(queue, task_id, "done")
    assert (done.attempt, done.result, len(done.history)) == (1, "parsed", 4)
    assert not await queue.requeue(task_id)  # done tasks stay done


async def test_retries_wait_out_the_backoff(queue: Queue) -> None:
    async def handler(ctx: TaskContext, payload: Any) -> int:
        if ctx.attempt < 3:
            raise Retryable("flaky")
        return ctx.attempt

    task_id = await queue.enqueue("k", max_attempts=3)
    backoff = Backoff(base_s=0.15, max_s=10.0, rng=lambda: 1.0)  # the top of the jitter range
    async with running_worker(queue, {"k": handler}, backoff=backoff):
        task = await wait_status(queue, task_id, "done")
    gaps = [b.started - a.ended for a, b in itertools.pairwise(task.history)]
    assert 0.149 <= gaps[0] < 0.15 + 0.25
    assert 0.299 <= gaps[1] < 0.30 + 0.25


async def _model_call(ctx: TaskContext, payload: Any) -> str:
    reply = await ctx.step(
        "ask",
        lambda: ctx.model.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]),
    )
    return str(reply.choices[0].message.content)


@pytest.mark.parametrize(
    ("status", "code", "final", "requests"),
    [
        (400, "invalid_request", "failed", 1),
        (401, "invalid_api_key", "failed", 1),
        (403, "model_not_allowed", "failed", 1),
        (404, "model_not_found", "failed", 1),
        (429, "insufficient_quota", "failed", 1),
        (429, "rate_limit_exceeded", "done", 2),
        (503, "upstream_unavailable", "done", 2),
        (504, "upstream_timeout", "done", 2),
    ],
)
async def test_gateway_answers_are_fatal_or_retried(
    queue: Queue, fake_gateway: FakeGateway, status: int, code: str, final: str, requests: int
) -> None:
    fake_gateway.reply(status, code)
    task_id = await queue.enqueue("ask")
    gateway = {"gateway_url": fake_gateway.url, "gateway_key": "tenant-key"}
    async with running_worker(queue, {"ask": _model_call}, **gateway):
        task = await wait_status(queue, task_id, final)
    # one request per attempt: the SDK does not retry (max_retries=0); each carries the task id
    assert len(fake_gateway.seen) == requests == task.attempt
    assert {seen.headers["x-task-id"] for seen in fake_gateway.seen} == {task_id}
    assert {seen.headers["authorization"] for seen in fake_gateway.seen} == {"Bearer tenant-key"}
    if final == "failed":
        assert task.error is not None and str(status) in task.error and code in task.error
    else:
        assert task.result == "ok" and task.usage == {
            "requests": 1,
            "prompt_tokens": 7,
            "completion_tokens": 3,
        }


async def test_the_gateways_retry_after_is_a_floor_on_the_delay(
    queue: Queue, fake_gateway: FakeGateway
) -> None:
    fake_gateway.reply(429, "rate_limit_exceeded", {"retry-after-ms": "400", "retry-after": "1"})
    fake_gateway.reply(503, "upstream_unavailable", {"retry-after": "1"})
    task_id = await queue.enqueue("ask", max_attempts=3)
    options = {"gateway_url": fake_gateway.url, "gateway_key": "k", "backoff": Backoff(base_s=0.001)}
    async with running_worker(queue, {"ask": _model_call}, **options):
        await wait_status(queue, task_id, "done")
    arrivals = [seen.at for seen in fake_gateway.seen]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(gaps) == 2
    assert 0.4 <= gaps[0] < 0.4 + 0.3, gaps
    assert 1.0 <= gaps[1] < 1.0 + 0.3, gaps
