"""The ``modelgate tasks`` verbs: ``show ID`` (JSON), ``list [--status S]`` (workers, stalled tasks,
queue depth and a table of tasks), ``cancel ID``, ``approve ID``, ``dead``, ``requeue ID`` and
``purge --older-than DURATION``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeAlias

import msgspec

from client.cli import EXIT_FAILED, EXIT_USAGE, run_async
from client.keys import STATUSES
from client.liveness import WorkerInfo, live_workers
from client.queue import PURGEABLE, Queue
from client.records import TaskInfo

Verb = Callable[[Queue, argparse.Namespace], Awaitable[int]]


Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_verbs(verbs: Subparsers, common: argparse.ArgumentParser) -> None:
    show = verbs.add_parser("show", parents=[common], help="a task's record as JSON")
    show.add_argument("task_id")
    show.set_defaults(run=_command(_show))
    listing = verbs.add_parser("list", parents=[common], help="workers, queue depth and tasks")
    listing.add_argument("--status", choices=STATUSES)
    listing.add_argument("--limit", type=int, default=50)
    listing.set_defaults(run=_command(_list))
    dead = verbs.add_parser("dead", parents=[common], help="dead tasks and their last error")
    dead.add_argument("--limit", type=int, default=50)
    dead.set_defaults(run=_command(_dead))
    purge = verbs.add_parser(
        "purge", parents=[common], help="delete finished tasks older than --older-than (run it on a schedule)"
    )
    purge.add_argument(
        "--older-than", type=_seconds, required=True, metavar="DURATION", help="e.g. 168h, 30m"
    )
    purge.add_argument(
        "--status", action="append", choices=PURGEABLE, help="repeatable; default: done and cancelled"
    )
    purge.set_defaults(run=_command(_purge))
    for name, verb, text in (
        ("cancel", _cancel, "cancel a task (a running one stops at its next step)"),
        ("approve", _approve, "resume a task waiting for a human"),
        ("requeue", _requeue, "queue a dead, failed or cancelled task again"),
    ):
        parser = verbs.add_parser(name, parents=[common], help=text)
        parser.add_argument("task_id")
        parser.set_defaults(run=_command(verb))


def _command(verb: Verb) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if not args.redis:
            print(f"modelgate tasks {args.verb}: needs --redis or MODELGATE_REDIS_URL", file=sys.stderr)
            return EXIT_USAGE
        return run_async(args, _with_queue(verb, args))

    return run


async def _with_queue(verb: Verb, args: argparse.Namespace) -> int:
    async with Queue(args.redis, args.queue) as queue:
        return await verb(queue, args)


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return EXIT_FAILED


async def _show(queue: Queue, args: argparse.Namespace) -> int:
    task = await queue.get(args.task_id)
    if task is None:
        return _fail(f"no task {args.task_id} in queue {queue.name}")
    print(msgspec.json.format(msgspec.json.encode(task)).decode())
    return 0


async def _cancel(queue: Queue, args: argparse.Namespace) -> int:
    status = await queue.cancel(args.task_id)
    if status is None:
        return _fail(f"no task {args.task_id} in queue {queue.name}")
    if status == "running":
        print(f"{args.task_id}: cancel requested; it stops at its next step boundary")
        return 0
    if status != "cancelled":
        return _fail(f"{args.task_id} is {status}: nothing to cancel")
    print(f"{args.task_id}: cancelled")
    return 0


async def _approve(queue: Queue, args: argparse.Namespace) -> int:
    if await queue.approve(args.task_id):
        print(f"{args.task_id}: queued again, resuming at its checkpoint")
        return 0
    return _fail(f"{args.task_id}: {await _status(queue, args.task_id)}, not waiting_human")


async def _requeue(queue: Queue, args: argparse.Namespace) -> int:
    if await queue.requeue(args.task_id):
        print(f"{args.task_id}: queued again")
        return 0
    return _fail(f"{args.task_id}: {await _status(queue, args.task_id)}, not dead, failed or cancelled")


async def _status(queue: Queue, task_id: str) -> str:
    task = await queue.get(task_id)
    return "unknown task" if task is None else task.status


def _seconds(text: str) -> float:
    """A duration: a number with a unit, ``s``, ``m``, ``h`` or ``d`` (``168h``, ``7d``)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value = float(text[:-1])
        scale = units[text[-1]]
    except (ValueError, KeyError, IndexError):
        raise argparse.ArgumentTypeError(f"not a duration like 30m, 168h or 7d: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("a duration cannot be negative")
    return value * scale


async def _purge(queue: Queue, args: argparse.Namespace) -> int:
    statuses = tuple(args.status or ("done", "cancelled"))
    purged = await queue.purge(args.older_than, statuses)
    which = ", ".join(statuses)
    print(f"purged {purged} tasks ({which}) older than {args.older_than:g} s from queue {queue.name}")
    return 0


async def _dead(queue: Queue, args: argparse.Namespace) -> int:
    print(_task_table(await queue.dead(args.limit)))
    return 0


async def _list(queue: Queue, args: argparse.Namespace) -> int:
    counts = await queue.counts()
    depth = ", ".join(f"{status} {count}" for status, count in counts.items())
    print(f"queue {queue.name}: {depth}")
    print(_worker_table(await live_workers(queue.redis, queue.keys)))
    stalled = await queue.stalled()
    print(f"stalled (lease expired, not yet reclaimed): {len(stalled)}")
    if stalled:
        print(_task_table(stalled))
    print(_task_table(await queue.list_tasks(args.status, args.limit)))
    return 0


def _ago(when: float | None) -> str:
    return "-" if when is None else f"{max(time.time() - when, 0):.1f}s ago"


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=False)]
    lines = (
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in [header, *rows]
    )
    return "\n".join(line.rstrip() for line in lines)


def _worker_table(workers: list[WorkerInfo]) -> str:
    rows = [
        (w.id, w.host, str(w.pid), _ago(w.started), _ago(w.last_beat), f"{len(w.running)}/{w.concurrency}")
        for w in workers
    ]
    header = ("WORKER", "HOST", "PID", "STARTED", "LAST HEARTBEAT", "RUNNING")
    return f"workers: {len(workers)}\n" + _table(header, rows)


def _task_table(tasks: list[TaskInfo]) -> str:
    rows = [
        (
            t.id,
            t.kind,
            t.status,
            f"{t.attempt}/{t.max_attempts}",
            t.step or "-",
            _ago(t.updated),
            (t.error or "")[:60],
        )
        for t in tasks
    ]
    return _table(("ID", "KIND", "STATUS", "ATTEMPT", "STEP", "UPDATED", "ERROR"), rows)
