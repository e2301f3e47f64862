"""Start a coroutine now and finish it later, in the same task: what Python 3.12's eager tasks do.

A settlement (of a stream, or of a whole reply) is one Redis call whose reply the client need not
wait for, but whose command must be on its way before the client sees the answer end (so a client
that sends its next request at once finds its slot already free). :class:`Started` runs the
coroutine at once up to its first suspension (with the Redis pipe connected, that is waiting for
the reply, the command already written), and awaiting it later runs the rest in the awaiting
task. A task would do too, but its first step only runs in a later turn of the event loop, after
the client's write, and costs a task per request.
"""

from __future__ import annotations

from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Started(Generic[T]):
    """A coroutine run up to its first suspension on construction; ``await`` it (once) to finish it.

    Until it is awaited, nothing resumes it: whatever it waits on may complete meanwhile, and the
    rest runs when it is awaited. An exception raised before the first suspension is raised by
    the ``await``. Cancelling the awaiting task cancels the coroutine where it waits.
    """

    __slots__ = ("_awaited", "_coro", "_failed", "_outcome", "_waiting")

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro: Coroutine[Any, Any, T] | None = coro
        self._waiting: Any = None
        self._outcome: Any = None
        self._failed = False
        self._awaited = False
        try:
            self._waiting = coro.send(None)
        except StopIteration as stop:
            self._coro, self._outcome = None, stop.value
        except BaseException as exc:  # handed to whoever awaits, as awaiting the coroutine would
            self._coro, self._outcome, self._failed = None, exc, True

    @property
    def done(self) -> bool:
        """Whether the coroutine finished without suspending."""
        return self._coro is None

    def __await__(self) -> Generator[Any, None, T]:
        if self._awaited:
            raise RuntimeError("a started coroutine can be awaited only once")
        self._awaited = True
        coro = self._coro
        if coro is None:
            if self._failed:
                raise self._outcome
            return self._outcome  # type: ignore[no-any-return]
        self._coro = None
        yielded = self._waiting
        while True:
            # Hand what the coroutine waits on to the awaiting task, which wakes us when it is
            # done (or throws in a cancellation), and pass that on: ``yield from`` by hand.
            try:
                yield yielded
            except BaseException as exc:
                try:
                    yielded = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                continue
            try:
                yielded = coro.send(None)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
