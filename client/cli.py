"""``modelgate worker`` and ``modelgate tasks``: run a queue worker; inspect and steer tasks.

:func:`add_commands` registers both on the ``modelgate`` parser (``gateway/cli.py`` calls it);
``python -m client.cli ...`` runs them on their own. Redis comes from ``--redis`` or
``MODELGATE_REDIS_URL``; the worker's gateway from ``--gateway-url``/``--gateway-key`` or
``MODELGATE_GATEWAY_URL``/``MODELGATE_GATEWAY_KEY``. Exit codes: 0 ok, 1 the operation could not be
done (unknown task, wrong status, Redis unreachable), 2 bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import re
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError

EXIT_FAILED = 1
EXIT_USAGE = 2

log = logging.getLogger("modelgate.client")


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``worker`` and ``tasks`` (with its verbs) on a ``modelgate`` subparsers object."""
    from client import tasks_cli

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis", default=os.environ.get("MODELGATE_REDIS_URL"), help="Redis URL")
    common.add_argument("--queue", default=os.environ.get("MODELGATE_QUEUE", "default"), help="queue name")
    _worker_parser(subparsers, common)
    tasks = subparsers.add_parser("tasks", help="inspect and steer queued tasks")
    tasks_cli.add_verbs(tasks.add_subparsers(dest="verb", required=True), common)


def _worker_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    worker = subparsers.add_parser("worker", parents=[common], help="run a queue worker")
    worker.add_argument("target", metavar="MODULE:ATTR", help="a dict of task kind -> async handler")
    worker.add_argument("--concurrency", type=int, default=1, help="tasks run at once (default 1)")
    worker.add_argument("--gateway-url", default=os.environ.get("MODELGATE_GATEWAY_URL"))
    worker.add_argument("--gateway-key", default=os.environ.get("MODELGATE_GATEWAY_KEY"))
    worker.add_argument("--lease-s", type=float, default=30.0, help="lease length (default 30)")
    worker.add_argument("--task-timeout-s", type=float, default=3600.0, help="per attempt (default 3600)")
    worker.add_argument("--grace-s", type=float, default=30.0, help="drain time after SIGTERM (default 30)")
    worker.add_argument("--poll-s", type=float, default=0.25, help="how often due retries are promoted")
    worker.add_argument("--backoff-scale", type=float, default=1.0, help="0 turns retry backoff off")
    worker.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on 127.0.0.1")
    worker.set_defaults(run=run_worker)


def redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def _loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    run: Callable[[Coroutine[Any, Any, int]], int] = uvloop.run
    return run


def run_async(args: argparse.Namespace, main: Coroutine[Any, Any, int]) -> int:
    """Run ``main`` on uvloop when available; a Redis failure becomes one line and exit 1."""
    try:
        return _loop_runner()(main)
    except RedisError as exc:
        print(f"modelgate {args.command}: Redis at {redacted(args.redis)}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def load_handlers(target: str) -> Mapping[str, Any]:
    """The dict at ``MODULE:ATTR``; ``ValueError`` says what is wrong with it."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected MODULE:ATTR, got {target!r}")
    try:
        handlers = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {target}: {exc}") from exc
    if not isinstance(handlers, Mapping) or not all(callable(h) for h in handlers.values()):
        raise ValueError(f"{target} must be a dict of task kind -> async handler")
    return handlers


def run_worker(args: argparse.Namespace) -> int:
    if not args.redis:
        print("modelgate worker: needs --redis or MODELGATE_REDIS_URL", file=sys.stderr)
        return EXIT_USAGE
    try:
        handlers = load_handlers(args.target)
    except ValueError as exc:
        print(f"modelgate worker: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if not args.gateway_url:
        log.warning("no gateway configured: ctx.model is unavailable to handlers")
    try:
        return run_async(args, _work(args, handlers))
    except ValueError as exc:
        print(f"modelgate worker: {exc}", file=sys.stderr)
        return EXIT_USAGE


async def _work(args: argparse.Namespace, handlers: Mapping[str, Any]) -> int:
    from client.queue import Queue
    from client.retry import Backoff
    from client.worker import Worker

    async with Queue(args.redis, args.queue) as queue:
        worker = Worker(
            queue,
            handlers,
            gateway_url=args.gateway_url,
            gateway_key=args.gateway_key,
            concurrency=args.concurrency,
            lease_s=args.lease_s,
            task_timeout_s=args.task_timeout_s,
            grace_s=args.grace_s,
            poll_s=args.poll_s,
            backoff=Backoff(scale=args.backoff_scale),
            metrics_port=args.metrics_port,
        )
        await worker.run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m client.cli``: the two commands without the rest of ``modelgate``."""
    parser = argparse.ArgumentParser(prog="modelgate", description="modelgate queue worker client")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
