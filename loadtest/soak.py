"""The soak (issue 9): mixed traffic through two gateway instances under chaos, then checks.

Why it exists: the unit and end-to-end tests each pin one behaviour under one fault; the soak runs
everything at once for a long time -- shared limits across instances, accounting, budgets,
breakers, the queue client -- while Redis restarts, the upstream fails, stalls and answers 429, and
gateway and queue worker processes are SIGKILLed, and then checks that nothing was lost, leaked,
double-counted or left unexplained. Everything runs on 127.0.0.1 and stops at the end::

    python -m loadtest.soak [--minutes 10] [--seed 1] [--keep-logs]

It starts (``loadtest/soak_procs.py``) a private ``redis-server`` with ``appendonly yes`` and
``appendfsync always``, the mock upstream, two ``modelgate serve --workers 2`` instances sharing
one config file and that Redis, and two ``modelgate worker`` processes (``soak_handlers.py``).
Traffic (``soak_traffic.py``) runs for ``--minutes``; after a warm-up the chaos loop
(``soak_chaos.py``) injects one fault every few seconds. Then the traffic stops, the queue drains,
a slot lease passes, and the checks (``soak_checks.py``) print one table (check, value, bound,
ok). The exit status is 0 only if every check is true. Progress goes to stderr, the report to
stdout. loadtest/README.md ("Soak") explains each check and its bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
from redis.asyncio import Redis
from redis.exceptions import RedisError

from client import Queue
from client.records import TaskInfo
from loadtest.soak_chaos import KILLS_GATEWAY, Chaos, Fault
from loadtest.soak_checks import Evidence, run_checks, table
from loadtest.soak_handlers import EFFECT_KEY, EFFECT_RUNS, EFFECTS
from loadtest.soak_procs import (
    ADMIN_KEY,
    BUDGETED,
    LIMITED,
    NARROW,
    PREFIX,
    QUEUE,
    SLOT_LEASE_S,
    STEADY,
    TENANTS,
    Fleet,
    rss_kib,
)
from loadtest.soak_traffic import Traffic

BUDGETED_PER_S = 1 / 0.4
"""The budgeted agent's rate, about: one request plus a 0.2-0.5 s pause."""
COST_PER_REQUEST_USD = 1.3e-4
"""A soak request's mean cost: ~90 prompt tokens at $1/Mtok + ~10 completion tokens at $4/Mtok."""
BUDGET_SHARE = 0.4
"""The budget is this share of what the budgeted tenant asks for over the run: used up halfway."""
TASKS_PER_S = 1.0
DRAIN_TIMEOUT_S = 180.0
TERMINAL = ("done", "dead", "failed", "cancelled")
_NARROW_SLOTS = f"{{{PREFIX}}}:t:{NARROW.name}:conc"
_BUDGET_USAGE = f"{{{PREFIX}}}:t:{BUDGETED.name}:usage:total"


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class Run:
    """One soak's shared state: the fleet, its clients, and what it recorded."""

    fleet: Fleet
    client: httpx.AsyncClient
    queue: Queue
    redis: Redis
    traffic: Traffic
    narrow_max_live: int = 0

    @property
    def admin(self) -> str:
        return self.fleet.gateways[0].url

    async def admin_get(self, path: str) -> Any:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        response = await self.client.get(f"{self.admin}/admin{path}", headers=headers)
        response.raise_for_status()
        return response.json()

    async def set_budget(self, usd: float) -> None:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
        body = {"usd": usd, "period": "total"}
        url = f"{self.admin}/admin/tenants/{BUDGETED.name}/budget"
        (await self.client.put(url, json=body, headers=headers)).raise_for_status()


def _load(run: Run) -> list[asyncio.Task[None]]:
    """The traffic's senders; they end when ``run.traffic.stop()`` is called."""
    traffic = run.traffic
    senders = [traffic.agent(STEADY, n, (0.05, 0.3)) for n in range(2)]
    senders += [traffic.agent(NARROW, n, (0.03, 0.12)) for n in range(3)]
    senders.append(traffic.agent(BUDGETED, 0, (0.2, 0.5)))
    assert LIMITED.rpm is not None
    senders.append(traffic.paced(LIMITED, 4 * LIMITED.rpm / 60))
    senders.append(traffic.enqueue(run.queue, TASKS_PER_S))
    return [asyncio.create_task(sender) for sender in senders]


async def _sample_slots(run: Run, stop: asyncio.Event) -> None:
    """Twice a second: the concurrency tenant's live slot leases (Redis state, read-only)."""
    while not stop.is_set():
        with contextlib.suppress(RedisError, OSError):
            live = await run.redis.zcount(_NARROW_SLOTS, f"({int(time.time() * 1000)}", "+inf")
            run.narrow_max_live = max(run.narrow_max_live, int(live))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


def _steady_pids(fleet: Fleet) -> dict[str, int]:
    """The processes the chaos never kills: the first instance's workers and the first queue worker."""
    pids = {f"gateway-0 worker {pid}": pid for pid in fleet.gateways[0].worker_pids()}
    worker = fleet.workers[0].process
    if worker is not None:
        pids["queue worker-0"] = worker.pid
    return pids


async def _drain(run: Run) -> None:
    """Until every enqueued task is in a final status, or the drain timeout."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    pending = set(run.traffic.tasks)
    while pending and time.monotonic() < deadline:
        with contextlib.suppress(RedisError, OSError):
            infos = await asyncio.gather(*(run.queue.get(task_id) for task_id in pending))
            pending = {i.id for i in infos if i is not None and i.status not in TERMINAL}
        if pending:
            await asyncio.sleep(1.0)  # polling the queue's state from outside: there is no event
    if pending:
        say(f"{len(pending)} tasks still not final after {DRAIN_TIMEOUT_S:.0f} s")


async def _slots(redis: Redis) -> tuple[int, int]:
    """(live, expired) slot leases in every concurrency set of the gateway."""
    now = int(time.time() * 1000)
    live = expired = 0
    async for key in redis.scan_iter(match=f"{{{PREFIX}}}:*:conc"):
        live += int(await redis.zcount(key, f"({now}", "+inf"))
        expired += int(await redis.zcount(key, "-inf", now))
    return live, expired


async def _effects(redis: Redis) -> tuple[set[str], int, int]:
    keys = {key.rsplit(":", 1)[1] async for key in redis.scan_iter(match=EFFECT_KEY.format("*"))}
    applications = int(await redis.get(EFFECTS) or 0)
    runs = sum(int(v) for v in (await redis.hvals(EFFECT_RUNS)))
    return keys, applications, runs


async def _collect(run: Run, faults: list[Fault], budget: float, rss: list[Any]) -> Evidence:
    fleet, traffic = run.fleet, run.traffic
    mock = (await run.client.get(f"{fleet.mock_url}/_mock/stats")).json()
    usage = {t.name: (await run.admin_get(f"/tenants/{t.name}"))["usage"] for t in TENANTS}
    reserved = float(await run.redis.hget(_BUDGET_USAGE, "usd_reserved") or 0.0)
    live, expired = await _slots(run.redis)
    infos = await asyncio.gather(*(run.queue.get(task_id) for task_id in traffic.tasks))
    tasks: dict[str, TaskInfo | None] = dict(zip(traffic.tasks, infos, strict=True))
    keys, applications, runs = await _effects(run.redis)
    assert LIMITED.rpm is not None and NARROW.max_concurrency is not None
    return Evidence(
        outcomes=traffic.outcomes,
        faults=faults,
        mock_tokens=cast("dict[str, int]", mock["tokens"]),
        usage=usage,
        budget_usd=budget,
        budget_reserved_usd=reserved,
        limited_rpm=LIMITED.rpm,
        narrow_limit=NARROW.max_concurrency,
        narrow_max_live=run.narrow_max_live,
        live_slots=live,
        expired_slots=expired,
        tasks=tasks,
        task_most_tokens=traffic.tasks,
        worker_instance={pid: w.index for w in fleet.workers for pid in w.pids},
        effect_keys=keys,
        effect_applications=applications,
        effect_runs=runs,
        enqueue_failures=traffic.enqueue_failures,
        rss=rss,
    )


def _summary(run: Run, faults: list[Fault]) -> str:
    by_tenant: dict[str, Counter[str]] = {}
    for o in run.traffic.outcomes:
        label = o.transport or (f"{o.status} {o.code}" if o.code else str(o.status))
        by_tenant.setdefault(o.tenant, Counter())[label] += 1
    lines = [f"requests: {len(run.traffic.outcomes)}; tasks enqueued: {len(run.traffic.tasks)}"]
    for tenant, counts in sorted(by_tenant.items()):
        lines.append(f"  {tenant}: " + ", ".join(f"{k} x{n}" for k, n in counts.most_common()))
    kinds = Counter(f.kind for f in faults)
    lines.append(f"faults: {len(faults)} (" + ", ".join(f"{k} x{n}" for k, n in kinds.most_common()) + ")")
    return "\n".join(lines)


async def soak(fleet: Fleet, minutes: float, seed: int) -> tuple[str, bool]:
    """Run the soak on a started fleet; the report and whether every check passed."""
    duration = minutes * 60
    warmup = min(20.0, max(5.0, duration / 10))
    started = time.time()
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with (
        httpx.AsyncClient(timeout=30.0, limits=limits) as client,
        Queue(fleet.redis.url, QUEUE) as queue,
        Redis.from_url(fleet.redis.url, decode_responses=True) as redis,
    ):
        urls = [gateway.url for gateway in fleet.gateways]
        run = Run(fleet, client, queue, redis, Traffic(client, urls, seed))
        budget = round(BUDGET_SHARE * BUDGETED_PER_S * duration * COST_PER_REQUEST_USD, 6)
        await run.set_budget(budget)
        stop_sampling = asyncio.Event()
        background = [*_load(run), asyncio.create_task(_sample_slots(run, stop_sampling))]
        say(f"traffic on {', '.join(urls)}; warm-up {warmup:.0f} s, then chaos (seed {seed})")
        await asyncio.sleep(warmup)  # the warm-up is a span of traffic, not a wait for state
        steady = _steady_pids(fleet)
        before = {name: rss_kib(pid) for name, pid in steady.items()}
        chaos = Chaos(fleet, random.Random(seed), say)
        await chaos.run(until=started + duration)
        await asyncio.sleep(max(0.0, started + duration - time.time()))
        run.traffic.stop()
        stop_sampling.set()
        await asyncio.gather(*background)
        await chaos.restore()
        say(f"traffic stopped after {time.time() - started:.0f} s; draining the queue")
        await _drain(run)
        rss = [(name, before[name], rss_kib(pid)) for name, pid in steady.items()]
        await _after_last_kill(chaos.faults)
        evidence = await _collect(run, chaos.faults, budget, rss)
        evidence.chaos_errors = chaos.errors
    rows, unexplained = run_checks(evidence)
    report = [_summary(run, chaos.faults), "", table(rows)]
    for error in chaos.errors:
        report.append(f"chaos: {error}")
    if unexplained:
        report += ["", f"unexplained failures ({len(unexplained)}, first 20):"]
        report += [
            f"  {f.source} {f.cause} at {f.start:.3f}-{f.end:.3f} instance {f.instance}"
            + (f": {f.detail}" if f.detail else "")
            for f in unexplained[:20]
        ]
    return "\n".join(report), all(row.ok for row in rows)


async def _after_last_kill(faults: list[Fault]) -> None:
    """Wait until a slot lease (plus a second) has passed since the last gateway kill."""
    ends = [f.end for f in faults if f.kind in KILLS_GATEWAY]
    wait = max(ends, default=0.0) + SLOT_LEASE_S + 1.0 - time.time()
    if wait > 0:
        say(f"waiting {wait:.0f} s for the slot leases of killed gateway processes to lapse")
        await asyncio.sleep(wait)  # a lease lapses by time alone: nothing to poll


@contextlib.contextmanager
def _workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="modelgate-soak-"))
    failed = True
    try:
        yield path
        failed = False
    finally:
        if keep or failed:
            say(f"logs kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="traffic duration (default 10)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the chaos and the request bodies")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir with every log")
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so that SIGTERM too stops the processes this run started


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with _workdir(args.keep_logs) as tmp:
            fleet = Fleet(tmp)
            try:
                say(f"starting redis, mock upstream, 2 gateways x 2 workers, 2 queue workers in {tmp}")
                fleet.start()
                report, ok = asyncio.run(soak(fleet, args.minutes, args.seed))
            finally:
                fleet.stop()
    except KeyboardInterrupt:
        say("interrupted: the processes this run started are stopped")
        return 130
    print(report, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
