"""Reply steps take turns with the event loop's I/O: a slice of them per pass of the loop.

A request's life in the worker has three steps on its client's critical path: the admission
(parse, then the Redis command), the upstream call (sent as soon as Redis answers), and the reply
(read the upstream's answer, settle, write to the client, count and log). The reply step is the
long one, about four times either of the others. When answers from the upstream arrive together,
asyncio runs their reply steps back to back, and everything the loop reads from its sockets meanwhile
waits for all of them: the next requests' admissions, and the Redis answers that would send their
upstream calls. Measured at 64 clients and a 50 ms upstream, a request spent about 2 ms in the worker
outside its upstream call against 0.4 ms of its own CPU, most of it behind other requests' replies;
the upstream calls that then left back to back came back together, and the next round waited again.

:class:`ReplyTurns` lets the reply steps of one pass run for at most a slice of time (from the first
one's start); the rest wait for the loop's next pass and go first in it, in the order they came.
Between two passes the loop reads its sockets, so a request that arrived, or an admission Redis has
answered, waits behind at most one slice of reply work (and the step that ran past its end: a step
is never cut). A step that has to wait costs one more suspension; with no reply waiting a turn
costs a clock read and one callback per pass. The waiting line holds at most one entry per request
in flight (each request takes one turn), so ``server.max_connections`` bounds it.

The slice depends on how busy the worker is. With spare CPU it is short (250 µs): passes of the loop
are cheap then. A worker busy for 80% of the last 50 ms or more is at its CPU ceiling, where every
extra pass costs throughput (reads, writes and Redis answers batched less): the slice is 2 ms.
Measured side by side (64 clients, one worker, Redis admission; the loadtest README has the runs):
with a 50 ms upstream, 0.90 -> 0.98-0.99 of direct throughput for whole replies with a 200-500 µs
slice (0.96 with 1 ms, 0.95 with 2 ms); at 0 ms, a fixed 200 µs slice cost 21% of the throughput and
500 µs 8%, 2 ms nothing measurable.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from gateway.reply_future import ReplyFuture

SHORT_SLICE_S = 0.00025
"""Reply work per pass of the loop while the worker has spare CPU."""
LONG_SLICE_S = 0.002
"""Reply work per pass of the loop while the worker is busy (at least ``BUSY_SHARE``)."""
BUSY_SHARE = 0.8
BUSY_WINDOW_S = 0.05
"""How often the worker's busy share is measured (its thread's CPU time over wall time)."""

Clock = Callable[[], float]


class ReplyTurns:
    """Gates the reply steps of one event loop: before a reply step, ``take()`` a turn and await
    the future it hands back, if any."""

    __slots__ = (
        "_clock",
        "_cpu_clock",
        "_loop",
        "_slice_s",
        "_slice_started",
        "_turning",
        "_waiting",
        "_window_cpu",
        "_window_started",
    )

    def __init__(self, clock: Clock = time.perf_counter, cpu_clock: Clock = time.thread_time) -> None:
        """``clock``: wall time; ``cpu_clock``: the CPU time of the loop's thread (tests fake both)."""
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: deque[ReplyFuture] = deque()
        self._turning = False  # a slice is under way, and the next pass's callback is scheduled
        self._slice_started = 0.0
        self._slice_s = SHORT_SLICE_S
        self._window_started = clock()
        self._window_cpu = cpu_clock()

    def take(self) -> ReplyFuture | None:
        """None: go on now. Else a future to await: the step's turn comes in a later pass."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (tests run one app in several): nothing carries over
            self._loop, self._turning = loop, False
            self._waiting.clear()
        now = self._clock()
        if now - self._window_started >= BUSY_WINDOW_S:
            self._measure(now)
        if not self._turning:
            self._turning = True
            self._slice_started = now
            loop.call_soon(self._next_pass, loop)
            return None
        if not self._waiting and now - self._slice_started < self._slice_s:
            return None
        turn = ReplyFuture(loop)
        self._waiting.append(turn)
        return turn

    @property
    def slice_s(self) -> float:
        """The current slice of reply work per pass of the loop."""
        return self._slice_s

    def _measure(self, now: float) -> None:
        """Choose the slice from the worker's busy share since the last measurement."""
        cpu = self._cpu_clock()
        busy = (cpu - self._window_cpu) / (now - self._window_started)
        self._slice_s = LONG_SLICE_S if busy >= BUSY_SHARE else SHORT_SLICE_S
        self._window_started, self._window_cpu = now, cpu

    def _next_pass(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run in the loop's next pass, outside any task: resume waiting steps for one slice."""
        if loop is not self._loop:
            return  # scheduled on a loop this gate has since left
        waiting = self._waiting
        if not waiting:
            self._turning = False
            return
        clock = self._clock
        self._slice_started = started = clock()
        while waiting and clock() - started < self._slice_s:
            turn = waiting.popleft()
            if not turn.done():  # its task may have been cancelled meanwhile
                turn.set_result(None)  # the step runs here and now, up to its next wait
        loop.call_soon(self._next_pass, loop)
