"""The Redis reply future: its waiting task resumes inside ``set_result`` when the loop itself sets
it, and is scheduled as usual from inside a task, on cancellation and on a late callback."""

from __future__ import annotations

import asyncio

import pytest

from gateway.reply_future import ReplyFuture


async def _waiter(future: ReplyFuture, log: list[object]) -> object:
    value = await future
    log.append(("resumed", value))
    return value


async def test_a_reply_set_by_a_loop_callback_resumes_its_task_at_once() -> None:
    loop = asyncio.get_running_loop()
    future = ReplyFuture(loop)
    log: list[object] = []
    task = loop.create_task(_waiter(future, log))
    await asyncio.sleep(0)  # the task now waits on the future

    def reply_arrives() -> None:
        future.set_result(b"OK")
        log.append("set_result returned")

    loop.call_soon(reply_arrives)
    assert await task == b"OK"
    assert log == [("resumed", b"OK"), "set_result returned"]


async def test_a_reply_set_from_inside_a_task_is_scheduled() -> None:
    loop = asyncio.get_running_loop()
    future = ReplyFuture(loop)
    log: list[object] = []
    task = loop.create_task(_waiter(future, log))
    await asyncio.sleep(0)
    future.set_result(1)  # this test is itself a running task
    log.append("set_result returned")
    assert await task == 1
    assert log == ["set_result returned", ("resumed", 1)]


async def test_an_error_reply_is_raised_in_the_waiting_task() -> None:
    loop = asyncio.get_running_loop()
    future = ReplyFuture(loop)
    task = loop.create_task(_waiter(future, []))
    await asyncio.sleep(0)
    loop.call_soon(future.set_exception, ConnectionError("gone"))
    with pytest.raises(ConnectionError, match="gone"):
        await task


async def test_a_timeout_cancels_the_wait_and_the_late_reply_is_ignored() -> None:
    loop = asyncio.get_running_loop()
    future = ReplyFuture(loop)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await future
    assert future.cancelled()
    with pytest.raises(asyncio.CancelledError):
        future.result()
    with pytest.raises(asyncio.InvalidStateError):
        future.set_result(1)  # the connection checks done() first, as it does for any future


async def test_a_callback_added_after_the_reply_is_scheduled() -> None:
    loop = asyncio.get_running_loop()
    future = ReplyFuture(loop)
    future.set_result(7)
    seen: asyncio.Future[object] = loop.create_future()
    future.add_done_callback(lambda f: seen.set_result(f.result()))
    assert not seen.done()
    assert await seen == 7
    assert await future == 7
