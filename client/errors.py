"""What a task handler raises to steer its task, and the signals the worker uses to stop one.

Handlers raise the public three; everything else a handler raises is retried (see
:func:`client.retry.classify`)::

    Exception
     └── TaskError            base of the errors a handler raises on purpose
          ├── Retryable       try again after backoff; ``retry_after_s`` is a floor on the delay
          ├── Fatal           fail now (status ``failed``), no retry
          └── NeedsHuman      park in ``waiting_human`` until ``Queue.approve``

    BaseException
     └── TaskInterrupt        internal: ends the attempt; not an ``Exception`` so that a handler's
          │                   ``except Exception`` cannot swallow it
          ├── TaskCancelled   ``Queue.cancel`` was called; raised by ``ctx.step`` at a step boundary
          ├── LeaseLost       another worker owns the task now; this attempt must write nothing more
          └── InDoubt         a side-effect step may or may not have happened; a human must decide
"""

from __future__ import annotations


class TaskError(Exception):
    """Base of the errors a handler raises on purpose."""


class Retryable(TaskError):
    """Try the task again after backoff, no sooner than ``retry_after_s`` when given."""

    def __init__(self, message: str = "", *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Fatal(TaskError):
    """Fail the task now: no further attempts."""


class NeedsHuman(TaskError):
    """Park the task in ``waiting_human``; ``Queue.approve`` resumes it at its checkpoint."""


class TaskInterrupt(BaseException):
    """Internal: ends the current attempt."""


class TaskCancelled(TaskInterrupt):
    """The task was cancelled; raised at the next step boundary."""


class LeaseLost(TaskInterrupt):
    """The lease passed to another worker; nothing this attempt does may be written."""


class InDoubt(TaskInterrupt):
    """A side-effect step started but its outcome is unknown."""

    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"side-effect step {step!r}: {why}; a human must check it, then approve")
        self.step = step
