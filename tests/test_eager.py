"""Starting a coroutine at once and finishing it later in the awaiting task (gateway/eager.py)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.eager import Started


async def test_the_coroutine_runs_up_to_its_first_wait_at_once_and_the_rest_when_awaited() -> None:
    steps: list[str] = []
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def work() -> str:
        steps.append("before")
        value = await gate
        steps.append("after")
        return value + "!"

    started = Started(work())
    assert steps == ["before"]
    assert not started.done
    gate.set_result("answer")
    await asyncio.sleep(0)
    assert steps == ["before"]  # nothing resumes it until it is awaited
    assert await started == "answer!"
    assert steps == ["before", "after"]


async def test_a_coroutine_that_never_waits_is_done_at_once() -> None:
    async def quick() -> int:
        return 7

    started = Started(quick())
    assert started.done
    assert await started == 7


async def test_an_error_before_the_first_wait_is_raised_by_the_await() -> None:
    async def broken() -> None:
        raise ValueError("early")

    started = Started(broken())
    with pytest.raises(ValueError, match="early"):
        await started


async def test_an_error_after_the_wait_is_raised_by_the_await() -> None:
    async def late() -> None:
        await asyncio.sleep(0)
        raise KeyError("late")

    with pytest.raises(KeyError, match="late"):
        await Started(late())


async def test_several_waits_are_all_passed_through() -> None:
    async def many() -> int:
        total = 0
        for i in range(5):
            await asyncio.sleep(0)
            total += i
        return total

    assert await Started(many()) == 10


async def test_cancelling_the_awaiting_task_cancels_the_coroutine_where_it_waits() -> None:
    cleaned: list[str] = []
    waiting = asyncio.Event()

    async def slow() -> None:
        try:
            waiting.set()
            await asyncio.sleep(30)
        finally:
            cleaned.append("finally")

    async def awaiter() -> None:
        await Started(slow())

    task = asyncio.get_running_loop().create_task(awaiter())
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["finally"]


async def test_a_coroutine_that_swallows_the_cancellation_finishes_normally() -> None:
    async def stubborn() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "kept going"
        return "slept"

    async def awaiter() -> str:
        return await Started(stubborn())

    task = asyncio.get_running_loop().create_task(awaiter())
    await asyncio.sleep(0)
    task.cancel()
    assert await task == "kept going"


async def test_it_can_be_awaited_only_once() -> None:
    async def one() -> int:
        await asyncio.sleep(0)
        return 1

    started = Started(one())
    assert await started == 1
    with pytest.raises(RuntimeError, match="only once"):
        await started
