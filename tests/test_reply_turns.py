"""Reply steps take turns with the loop's I/O: a slice of them per pass, the rest in later passes
in order, what the loop reads in between first; the slice is long while the worker is busy."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import uvloop

from gateway.reply_turns import BUSY_WINDOW_S, LONG_SLICE_S, SHORT_SLICE_S, ReplyTurns

STEP_S = 0.0002
"""Each fake reply step's work: two fit in a short slice, the third does not."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gate() -> tuple[ReplyTurns, FakeClock, FakeClock]:
    clock, cpu = FakeClock(), FakeClock()
    return ReplyTurns(clock=clock, cpu_clock=cpu), clock, cpu


def step(
    turns: ReplyTurns,
    clock: FakeClock,
    name: str,
    log: list[str],
    during: Callable[[], object] = lambda: None,
) -> Callable[[], Awaitable[None]]:
    """A reply step: takes its turn, then works ``STEP_S`` of fake time (and calls ``during``)."""

    async def reply() -> None:
        turn = turns.take()
        if turn is not None:
            log.append(f"{name} waits")
            await turn
        log.append(f"{name} runs")
        during()
        clock.now += STEP_S

    return reply


def test_steps_past_the_slice_wait_until_the_loop_has_read_its_sockets() -> None:
    # On uvloop, the event loop the gateway runs on: a request that arrives while three replies
    # are under way is read before the third reply's step, which did not fit in the slice.
    async def scenario() -> list[str]:
        turns, clock, _ = gate()
        log: list[str] = []
        loop = asyncio.get_running_loop()
        client, server = socket.socketpair()
        client.setblocking(False)
        server.setblocking(False)
        loop.add_reader(server.fileno(), lambda: log.append(f"read {server.recv(16).decode()}"))
        try:
            arrives = lambda: client.send(b"request")  # noqa: E731 - while the first reply's step runs
            replies = [step(turns, clock, "reply 1", log, arrives)]
            replies += [step(turns, clock, f"reply {n}", log) for n in (2, 3)]
            await asyncio.gather(*(reply() for reply in replies))
        finally:
            loop.remove_reader(server.fileno())
            client.close()
            server.close()
        return log

    log = uvloop.run(scenario())
    assert log == ["reply 1 runs", "reply 2 runs", "reply 3 waits", "read request", "reply 3 runs"]


async def test_waiting_steps_resume_in_the_order_they_came_one_slice_a_pass() -> None:
    turns, clock, _ = gate()
    log: list[str] = []
    passes: list[int] = []
    loop = asyncio.get_running_loop()

    def count_passes() -> None:
        passes.append(len([line for line in log if line.endswith("runs")]))
        if len(passes) < 10:
            loop.call_soon(count_passes)

    tasks = [loop.create_task(step(turns, clock, f"reply {n}", log)()) for n in range(1, 7)]
    loop.call_soon(count_passes)
    await asyncio.gather(*tasks)
    assert [line for line in log if line.endswith("runs")] == [f"reply {n} runs" for n in range(1, 7)]
    # Two steps fit in a slice: 2 in the first pass, then 2 more in each later pass.
    assert passes[:4] == [2, 4, 6, 6]


async def test_a_step_cancelled_while_it_waits_is_skipped_and_the_next_one_runs() -> None:
    turns, clock, _ = gate()
    log: list[str] = []
    loop = asyncio.get_running_loop()
    names = ["reply 1", "reply 2", "cancelled", "after"]
    tasks = {name: loop.create_task(step(turns, clock, name, log)()) for name in names}
    await asyncio.sleep(0)  # all four have taken their turns; the last two wait
    assert log == ["reply 1 runs", "reply 2 runs", "cancelled waits", "after waits"]
    tasks["cancelled"].cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert tasks["cancelled"].cancelled()
    assert log[4:] == ["after runs"]


async def test_a_step_goes_on_at_once_when_nothing_else_is_under_way() -> None:
    turns, clock, _ = gate()
    assert turns.take() is None
    clock.now += 2 * LONG_SLICE_S
    await asyncio.sleep(0)  # the loop's next pass: the gate is free again
    await asyncio.sleep(0)
    assert turns.take() is None


async def test_the_slice_is_long_while_the_worker_is_busy_and_short_again_after() -> None:
    turns, clock, cpu = gate()
    assert turns.slice_s == SHORT_SLICE_S
    clock.now += BUSY_WINDOW_S
    cpu.now += 0.9 * BUSY_WINDOW_S  # busy 90% of the window
    turns.take()
    assert turns.slice_s == LONG_SLICE_S
    clock.now += BUSY_WINDOW_S
    cpu.now += 0.5 * BUSY_WINDOW_S  # busy half of it
    turns.take()
    assert turns.slice_s == SHORT_SLICE_S


def test_a_gate_left_by_a_stopped_loop_lets_the_next_loop_through() -> None:
    # One app served from several event loops in turn (as tests do): a slice under way when its
    # loop stopped must not make the next loop's steps wait for a pass that never comes.
    turns, clock, _ = gate()
    stopped = asyncio.new_event_loop()
    stopped.call_soon(turns.take)  # a slice begins; its next pass is scheduled on this loop...
    stopped.call_soon(stopped.stop)  # ...which stops before running it
    stopped.run_forever()
    stopped.close()
    clock.now += LONG_SLICE_S

    async def next_loop() -> list[str]:
        log: list[str] = []
        await asyncio.wait_for(step(turns, clock, "reply", log)(), 1.0)
        return log

    assert asyncio.run(next_loop()) == ["reply runs"]
