"""The ``modelgate worker`` and ``modelgate tasks`` verbs (run through ``client.cli.main``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

from client import NeedsHuman, Queue, TaskContext
from client.cli import add_commands, load_handlers, main, redacted
from tests.client.support import ROOT, eventually, hold, running_worker, wait_status
from tests.harness import RedisServer


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _verb(redis: RedisServer, queue: Queue, verb: str, *rest: str) -> list[str]:
    return ["tasks", verb, *rest, "--redis", redis.url, "--queue", queue.name]


async def test_show_prints_the_record_as_json(
    redis_server: RedisServer, queue: Queue, capsys: pytest.CaptureFixture[str]
) -> None:
    task_id = await queue.enqueue("summarise", {"url": "u"}, tenant="acme")
    code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "show", task_id))
    record = json.loads(out)
    assert code == 0
    assert {k: record[k] for k in ("id", "kind", "status", "attempt", "tenant", "payload")} == {
        "id": task_id,
        "kind": "summarise",
        "status": "queued",
        "attempt": 0,
        "tenant": "acme",
        "payload": {"url": "u"},
    }
    assert {"steps_done", "result", "error", "usage", "history"} <= record.keys()
    code, _, err = await _cli(capsys, *_verb(redis_server, queue, "show", "nope"))
    assert (code, err.strip()) == (1, f"no task nope in queue {queue.name}")


async def test_list_shows_workers_depth_stalled_and_tasks(
    redis_server: RedisServer, queue: Queue, capsys: pytest.CaptureFixture[str]
) -> None:
    stalled = await queue.enqueue("k")
    await hold(queue, "frozen-worker", lease_ms=1)
    busy = await queue.enqueue("k")
    gate = asyncio.Event()

    async def handler(ctx: TaskContext, payload: Any) -> None:
        await gate.wait()

    async with running_worker(queue, {"k": handler}, concurrency=3) as worker:
        await eventually(lambda: worker.running == [busy], what="the worker to take the task")
        code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "list"))
        assert code == 0
        assert f"queue {queue.name}: queued 0, running 2, retrying 0" in out
        assert "workers: 1" in out and worker.worker_id in out and "1/3" in out
        assert "stalled (lease expired, not yet reclaimed): 1" in out
        assert stalled in out and busy in out
        code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "list", "--status", "queued"))
        tasks_table = out.rsplit("ID  ", 1)[1]
        assert stalled not in tasks_table and busy not in tasks_table
        gate.set()


async def test_cancel_approve_dead_requeue(
    redis_server: RedisServer, queue: Queue, capsys: pytest.CaptureFixture[str]
) -> None:
    fixed: list[bool] = []

    async def handler(ctx: TaskContext, payload: Any) -> str:
        if payload == "ask":
            raise NeedsHuman("check")
        if payload == "poison" and not fixed:
            raise ValueError("poison")
        return "ok"

    to_cancel = await queue.enqueue("k", "x")
    code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "cancel", to_cancel))
    assert (code, out.strip()) == (0, f"{to_cancel}: cancelled")
    code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "cancel", to_cancel))
    assert (code, out.strip()) == (0, f"{to_cancel}: cancelled")  # idempotent

    ask = await queue.enqueue("k", "ask")
    poison = await queue.enqueue("k", "poison", max_attempts=1)
    async with running_worker(queue, {"k": handler}):
        await wait_status(queue, ask, "waiting_human")
        await wait_status(queue, poison, "dead")
        code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "dead"))
        assert code == 0 and poison in out and "ValueError: poison" in out and ask not in out
        code, _, err = await _cli(capsys, *_verb(redis_server, queue, "approve", poison))
        assert (code, err.strip()) == (1, f"{poison}: dead, not waiting_human")
        fixed.append(True)
        code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "requeue", poison))
        assert (code, out.strip()) == (0, f"{poison}: queued again")
        code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "approve", ask))
        assert code == 0 and "resuming at its checkpoint" in out
        await wait_status(queue, poison, "done")
        await wait_status(queue, ask, "waiting_human")  # it asks again; approve worked
    code, _, err = await _cli(capsys, *_verb(redis_server, queue, "requeue", ask))
    assert (code, err.strip()) == (1, f"{ask}: waiting_human, not dead, failed or cancelled")
    code, _, err = await _cli(capsys, *_verb(redis_server, queue, "cancel", poison))
    assert (code, err.strip()) == (1, f"{poison} is done: nothing to cancel")


async def test_purge_deletes_old_finished_tasks(
    redis_server: RedisServer, queue: Queue, capsys: pytest.CaptureFixture[str]
) -> None:
    cancelled = await queue.enqueue("k", "x")
    await queue.cancel(cancelled)
    code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "purge", "--older-than", "1h"))
    assert (code, out.strip()) == (
        0,
        f"purged 0 tasks (done, cancelled) older than 3600 s from queue {queue.name}",
    )
    code, out, _ = await _cli(capsys, *_verb(redis_server, queue, "purge", "--older-than", "0s"))
    assert code == 0 and out.startswith("purged 1 tasks")
    assert await queue.get(cancelled) is None
    with pytest.raises(SystemExit) as exited:  # argparse refuses it
        await _cli(capsys, *_verb(redis_server, queue, "purge", "--older-than", "soon"))
    assert exited.value.code == 2 and "not a duration" in capsys.readouterr().err


async def test_usage_errors_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MODELGATE_REDIS_URL", raising=False)
    code, _, err = await _cli(capsys, "tasks", "show", "x")
    assert (code, err.strip()) == (2, "modelgate tasks show: needs --redis or MODELGATE_REDIS_URL")
    code, _, err = await _cli(capsys, "worker", "client.example:nothing", "--redis", "redis://127.0.0.1:1/0")
    assert code == 2 and "cannot load client.example:nothing" in err
    code, _, err = await _cli(capsys, "tasks", "list", "--redis", "redis://:hunter2@127.0.0.1:1/0")
    assert code == 1 and "hunter2" not in err and "redis://***@127.0.0.1:1/0" in err


def test_handlers_must_be_a_dict_of_callables() -> None:
    assert load_handlers("client.example:handlers").keys() == {"summarise"}
    for bad in ("client.example", "client.example:MAX_CHARS", "nope.module:x"):
        with pytest.raises(ValueError):
            load_handlers(bad)
    assert redacted("redis://user:pw@h:1/0") == "redis://***@h:1/0"


def test_add_commands_plugs_into_the_modelgate_parser() -> None:
    parser = argparse.ArgumentParser(prog="modelgate")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve")
    add_commands(commands)
    args = parser.parse_args(["worker", "m:h", "--queue", "q", "--concurrency", "3", "--redis", "redis://r"])
    assert (args.target, args.queue, args.concurrency, args.redis) == ("m:h", "q", 3, "redis://r")
    assert callable(args.run)
    args = parser.parse_args(["tasks", "list", "--status", "dead"])
    assert (args.verb, args.status) == ("list", "dead") and callable(args.run)


def test_python_dash_m_runs_the_verbs(redis_server: RedisServer) -> None:
    env_url = redis_server.url
    result = subprocess.run(
        [sys.executable, "-m", "client.cli", "tasks", "show", "missing", "--redis", env_url],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1 and "no task missing in queue default" in result.stderr
