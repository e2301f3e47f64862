"""A future for a Redis reply whose waiting task resumes at once, inside the read that brought it.

An asyncio future wakes its waiter through the event loop's queue: the task resumes only after
everything already queued, and after the next look for I/O. Under load that queue is long
(clusters of requests arrive together), so a request's admission answer waited for the work of
every request around it before the request could make its upstream call. :class:`ReplyFuture`
runs the waiting task's next step right there, in the Redis connection's ``data_received``, as the
reply is read: the upstream call leaves as soon as Redis has answered, and the calls of a cluster
leave as Redis answers them, one by one, not together at the end of the loop's next pass.

The Redis pipe (:mod:`policies.redis_pipe`) uses it, and so does :mod:`gateway.reply_turns` for
the reply steps it lets through in the loop's next pass. The same for the upstream connections'
reads (the reply step run inside the read of the upstream's answer) was measured and dropped:
0.912 of direct against 0.929 with the Redis pipe's alone, side by side; work on the way back,
done sooner, lands in the middle of the next cluster's arrivals.

It has what a task needs of the future it waits on (``_asyncio_future_blocking``,
``add_done_callback``, ``get_loop``, ``result``, ``cancel``), so a task awaits it like any other;
nothing else is asked of it (its makers hand it to a caller that awaits it at once). Callbacks
run at once only from a callback of the loop itself, never from inside a running task (a task
cannot step inside another task's step): then, as for a cancellation, they are scheduled as usual.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Generator
from typing import Any

_PENDING, _DONE, _CANCELLED = 0, 1, 2

Callback = Callable[["ReplyFuture"], object]


class ReplyFuture:
    """The reply to one command: set by the connection, awaited by the caller."""

    __slots__ = (
        "_asyncio_future_blocking",
        "_callbacks",
        "_exception",
        "_loop",
        "_message",
        "_result",
        "_state",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._state = _PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._message: str | None = None
        self._callbacks: list[tuple[Callback, contextvars.Context]] = []
        self._asyncio_future_blocking = False

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self) -> Any:
        if self._state == _CANCELLED:
            raise asyncio.CancelledError(self._message)
        if self._state == _PENDING:
            raise asyncio.InvalidStateError("the reply has not arrived")
        if self._exception is not None:
            raise self._exception
        return self._result

    def add_done_callback(self, fn: Callback, *, context: contextvars.Context | None = None) -> None:
        context = contextvars.copy_context() if context is None else context
        if self._state == _PENDING:
            self._callbacks.append((fn, context))
        else:
            self._loop.call_soon(fn, self, context=context)

    def set_result(self, result: Any) -> None:
        if self._state != _PENDING:
            raise asyncio.InvalidStateError("the reply is already set")
        self._result, self._state = result, _DONE
        self._wake(at_once=True)

    def set_exception(self, exception: BaseException) -> None:
        if self._state != _PENDING:
            raise asyncio.InvalidStateError("the reply is already set")
        self._exception, self._state = exception, _DONE
        self._wake(at_once=True)

    def cancel(self, msg: str | None = None) -> bool:
        if self._state != _PENDING:
            return False
        self._message, self._state = msg, _CANCELLED
        self._wake(at_once=False)
        return True

    def _wake(self, *, at_once: bool) -> None:
        callbacks, self._callbacks = self._callbacks, []
        if not at_once or asyncio.current_task(self._loop) is not None:
            for fn, context in callbacks:
                self._loop.call_soon(fn, self, context=context)
            return
        for fn, context in callbacks:
            try:
                context.run(fn, self)
            except Exception as exc:  # as the loop does for a failing callback: report, go on
                self._loop.call_exception_handler(
                    {"message": "exception in a Redis reply callback", "exception": exc, "future": self}
                )

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state == _PENDING:
            self._asyncio_future_blocking = True
            yield self
        if self._state == _PENDING:
            raise RuntimeError("await wasn't used with future")
        return self.result()
