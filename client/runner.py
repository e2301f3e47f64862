"""One attempt of one claimed task: run the handler, judge how it ended, make the fenced write.

The handler runs under the per-task timeout. Its ending becomes one write: ``complete`` (result
stored, then acknowledged, atomically) or ``fail`` with a verdict from :func:`client.retry.classify`.
An attempt that lost its lease writes nothing; one cut by worker shutdown (``CancelledError``) also
writes nothing and is reclaimed by another worker when its lease runs out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from client import codec, metrics
from client.claim import Claim
from client.context import TaskContext
from client.errors import InDoubt, TaskCancelled, TaskInterrupt
from client.retry import Backoff, classify, describe

Handler = Callable[[TaskContext, Any], Awaitable[Any]]

log = logging.getLogger("modelgate.client")


@dataclass(frozen=True)
class Ending:
    """How an attempt ended: ``done``, ``retry``, ``failed``, ``waiting_human``, ``cancelled``, ``lost``."""

    outcome: str
    result: str = ""
    error: str = ""
    floor_s: float = 0.0


async def run_attempt(ctx: TaskContext, handler: Handler, payload: Any, timeout_s: float) -> Ending:
    """Run ``handler`` and say how it ended; never raises except ``CancelledError``."""
    try:
        async with asyncio.timeout(timeout_s) as scope:
            value = await handler(ctx, payload)
    except TaskInterrupt as exc:
        return _interrupted(exc)
    except TimeoutError as exc:
        if scope.expired():
            return Ending("retry", error=f"TimeoutError: the task ran longer than {timeout_s:g}s")
        return _judged(exc)
    except Exception as exc:
        return _judged(exc)
    return _done(value)


def _interrupted(exc: TaskInterrupt) -> Ending:
    if isinstance(exc, TaskCancelled):
        return Ending("cancelled", error="cancelled")
    if isinstance(exc, InDoubt):
        return Ending("waiting_human", error=str(exc))
    return Ending("lost")


def _judged(exc: Exception) -> Ending:
    verdict = classify(exc)
    return Ending(verdict.outcome, error=verdict.error, floor_s=verdict.floor_s)


def _done(value: Any) -> Ending:
    try:
        return Ending("done", result=codec.encode("the task's result", value))
    except Exception as exc:
        return Ending("failed", error=describe(exc))


async def finish(claim: Claim, ending: Ending, backoff: Backoff) -> str:
    """Write the ending (fenced); returns the task's status afterwards, or ``lost``."""
    if ending.outcome == "lost":
        return "lost"
    if ending.outcome == "done":
        return await claim.complete(ending.result)
    delay = backoff.delay(claim.attempt, ending.floor_s) if ending.outcome == "retry" else 0.0
    return await claim.fail(ending.outcome, ending.error, delay)


@dataclass(frozen=True)
class Runner:
    """Runs claimed tasks with a worker's handlers and settings."""

    handlers: Mapping[str, Handler]
    model_factory: Callable[[str], Any]
    timeout_s: float
    backoff: Backoff

    async def run(self, claim: Claim, ctx: TaskContext) -> str:
        handler = self.handlers.get(ctx.kind)
        if handler is None:
            ending = Ending("failed", error=f"Fatal: this worker has no handler for kind {ctx.kind!r}")
        else:
            payload = codec.decode(claim.fields.get("payload") or "null")
            ending = await run_attempt(ctx, handler, payload, self.timeout_s)
        status = await finish(claim, ending, self.backoff)
        self._log(claim, ending, status)
        return status

    def _log(self, claim: Claim, ending: Ending, status: str) -> None:
        if status == "lost":
            log.warning("lease lost: task=%s attempt=%d result discarded", claim.task_id, claim.attempt)
            return
        metrics.record(claim.queue.name, status)
        level = logging.INFO if status in ("done", "retrying") else logging.WARNING
        log.log(level, "task=%s attempt=%d status=%s %s", claim.task_id, claim.attempt, status, ending.error)
