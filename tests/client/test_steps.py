"""Checkpointed steps: replay instead of re-running, SDK objects, side effects in doubt."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from openai.types.chat import ChatCompletion

from client import Queue, Retryable, TaskContext
from tests.client.support import COMPLETION, hold, running_worker, wait_status


async def test_a_retry_does_not_rerun_checkpointed_steps(queue: Queue) -> None:
    runs: Counter[str] = Counter()

    async def handler(ctx: TaskContext, payload: Any) -> dict[str, Any]:
        def one() -> int:
            runs["one"] += 1
            return 1

        async def two() -> dict[str, int]:
            runs["two"] += 1
            return {"two": 2}

        a = await ctx.step("one", one)  # a plain value
        b = await ctx.step("two", two)  # an awaitable
        if ctx.attempt == 1:
            raise RuntimeError("boom after step 2")
        c = await ctx.step("three", lambda: runs.update(["three"]) or 3)
        return {"a": a, "b": b, "c": c}

    task_id = await queue.enqueue("k", {})
    async with running_worker(queue, {"k": handler}):
        task = await wait_status(queue, task_id, "done")
    assert runs == {"one": 1, "two": 1, "three": 1}
    assert task.result == {"a": 1, "b": {"two": 2}, "c": 3}
    assert task.attempt == 2 and task.steps_done == ["one", "two", "three"]
    assert [(h.attempt, h.outcome) for h in task.history] == [(1, "retrying"), (2, "done")]
    assert task.history[0].error == "RuntimeError: boom after step 2"
    assert task.error is None


async def test_sdk_objects_are_stored_as_dicts_and_rebuilt_on_request(queue: Queue) -> None:
    seen: list[tuple[str, Any, Any]] = []

    async def handler(ctx: TaskContext, payload: Any) -> str:
        plain = await ctx.step("plain", lambda: ChatCompletion.model_validate(COMPLETION))
        typed = await ctx.step(
            "typed", lambda: ChatCompletion.model_validate(COMPLETION), returns=ChatCompletion
        )
        seen.append((f"attempt {ctx.attempt}", type(plain), type(typed)))
        if ctx.attempt == 1:
            raise Retryable("again")
        return str(typed.choices[0].message.content)

    task_id = await queue.enqueue("k")
    async with running_worker(queue, {"k": handler}):
        task = await wait_status(queue, task_id, "done")
    assert seen == [("attempt 1", ChatCompletion, ChatCompletion), ("attempt 2", dict, ChatCompletion)]
    assert task.result == "ok"
    # usage of checkpointed completions is summed once, not again on replay
    assert task.usage == {"requests": 2, "prompt_tokens": 14, "completion_tokens": 6}


async def test_an_output_that_cannot_be_stored_fails_the_task(queue: Queue) -> None:
    async def handler(ctx: TaskContext, payload: Any) -> None:
        await ctx.step("bad", object)

    task_id = await queue.enqueue("k")
    async with running_worker(queue, {"k": handler}):
        task = await wait_status(queue, task_id, "failed")
    assert task.error is not None and "cannot be stored as JSON" in task.error
    assert task.attempt == 1


async def test_duplicate_step_names_fail_the_task(queue: Queue) -> None:
    async def handler(ctx: TaskContext, payload: Any) -> None:
        await ctx.step("same", lambda: 1)
        await ctx.step("same", lambda: 2)

    task_id = await queue.enqueue("k")
    async with running_worker(queue, {"k": handler}):
        task = await wait_status(queue, task_id, "failed")
    assert task.error is not None and "step names must be unique" in task.error


def _charging(calls: Counter[str], *, idempotent: bool = False, fail_with: Exception | None = None) -> Any:
    async def handler(ctx: TaskContext, payload: Any) -> Any:
        async def charge() -> dict[str, str]:
            calls["charge"] += 1
            if fail_with is not None and calls["charge"] == 1:
                raise fail_with
            return {"receipt": ctx.idempotency_key("charge")}

        receipt = await ctx.step("charge", charge, side_effect=True, idempotent=idempotent)
        return receipt

    return handler


async def test_a_side_effect_started_by_a_worker_that_died_parks_the_task(queue: Queue) -> None:
    task_id = await queue.enqueue("pay")
    dead = await hold(queue, "worker-that-dies", lease_ms=100)
    assert await dead.begin_step("charge", side_effect=True) == "ok"  # then the worker "dies"
    calls: Counter[str] = Counter()
    async with running_worker(queue, {"pay": _charging(calls)}, lease_s=1.0):
        task = await wait_status(queue, task_id, "waiting_human")
        assert calls["charge"] == 0
        assert task.error is not None and "'charge'" in task.error and "attempt 1" in task.error
        assert [h.outcome for h in task.history] == ["lease_expired", "waiting_human"]
        assert await queue.approve(task_id)  # a human checked: the charge did not happen
        task = await wait_status(queue, task_id, "done")
    assert calls["charge"] == 1
    assert task.result == {"receipt": f"{task_id}:charge"}


async def test_approve_can_record_what_an_in_doubt_step_did(queue: Queue) -> None:
    task_id = await queue.enqueue("pay")
    dead = await hold(queue, "worker-that-dies", lease_ms=100)
    await dead.begin_step("charge", side_effect=True)
    calls: Counter[str] = Counter()
    async with running_worker(queue, {"pay": _charging(calls)}, lease_s=1.0):
        await wait_status(queue, task_id, "waiting_human")
        assert await queue.approve(task_id, resolve={"charge": {"receipt": "found-by-human"}})
        task = await wait_status(queue, task_id, "done")
    assert calls["charge"] == 0
    assert task.result == {"receipt": "found-by-human"}


async def test_an_idempotent_side_effect_is_simply_run_again(queue: Queue) -> None:
    task_id = await queue.enqueue("pay")
    dead = await hold(queue, "worker-that-dies", lease_ms=100)
    await dead.begin_step("charge", side_effect=True)
    calls: Counter[str] = Counter()
    async with running_worker(queue, {"pay": _charging(calls, idempotent=True)}, lease_s=1.0):
        task = await wait_status(queue, task_id, "done")
    assert calls["charge"] == 1 and task.attempt == 2


async def test_an_ambiguous_error_in_a_side_effect_parks_the_task(queue: Queue) -> None:
    calls: Counter[str] = Counter()
    task_id = await queue.enqueue("pay")
    handler = _charging(calls, fail_with=ConnectionResetError("peer went away mid-request"))
    async with running_worker(queue, {"pay": handler}):
        task = await wait_status(queue, task_id, "waiting_human")
        assert (
            task.error is not None
            and "ConnectionResetError" in task.error
            and "outcome unknown" in task.error
        )
        assert await queue.approve(task_id)
        task = await wait_status(queue, task_id, "done")
    assert calls["charge"] == 2


async def test_a_definite_error_in_a_side_effect_is_retried(queue: Queue) -> None:
    calls: Counter[str] = Counter()
    task_id = await queue.enqueue("pay")
    async with running_worker(queue, {"pay": _charging(calls, fail_with=Retryable("card API said 503"))}):
        task = await wait_status(queue, task_id, "done")
    assert calls["charge"] == 2
    assert [h.outcome for h in task.history] == ["retrying", "done"]


async def test_steps_after_a_replay_still_run_concurrently_safe(queue: Queue) -> None:
    """Steps may be awaited from concurrent coroutines of one handler when names differ."""

    async def handler(ctx: TaskContext, payload: Any) -> list[int]:
        async def slow(i: int) -> int:
            await asyncio.sleep(0.01)
            return i

        return list(await asyncio.gather(*(ctx.step(f"part-{i}", lambda i=i: slow(i)) for i in range(5))))

    task_id = await queue.enqueue("k")
    async with running_worker(queue, {"k": handler}):
        task = await wait_status(queue, task_id, "done")
    assert task.result == [0, 1, 2, 3, 4] and sorted(task.steps_done) == [f"part-{i}" for i in range(5)]
