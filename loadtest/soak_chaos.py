"""The soak's chaos loop: one seeded random fault every few seconds, each recorded as a time window.

Faults, one at a time (so each failure the traffic sees can be traced to one cause):

==========================  ======================================================================
``redis_restart``           SIGKILL redis-server, wait 0.5-2 s, start it again (same port, same AOF)
``upstream_500``            the mock answers 500 for 2-5 s
``upstream_429``            the mock answers 429 with ``retry-after: 1`` for 2-5 s
``upstream_stall``          the mock stalls for 2-5 s: streams after two events, replies half-sent
``upstream_hang``           the mock sends nothing at all for 2-5 s
``gateway_kill``            SIGKILL the victim instance (supervisor and workers), restart it
``gateway_worker_kill``     SIGKILL one worker process of the victim instance; uvicorn replaces it
``worker_kill``             SIGKILL the victim queue worker, restart it 0.5-2 s later
==========================  ======================================================================

The victims are the last gateway instance and the last queue worker; the first instance and the
first queue worker are never killed, so their memory can be followed over the whole soak (the
RSS check). A gateway kill waits until :data:`REPLAY_S` after Redis last came back: a gateway keeps
the settlements that failed while Redis was away in its own memory and replays them at its next
lease renewal (every ``slot_lease_s / 3``), so a SIGKILL in between loses them with the process.
That is inherent in keeping them in memory (README, "Rate limits"); the soak leaves that window
out instead of counting its loss as an accounting error.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from loadtest.soak_procs import (
    BREAKER_RESET_S,
    READ_TIMEOUT_S,
    SLOT_LEASE_S,
    Fleet,
    GatewayInstance,
    QueueWorker,
    RedisServer,
    wait_until,
)

UPSTREAM_MODES: dict[str, dict[str, object]] = {
    "upstream_500": {"mode": "status", "status": 500},
    "upstream_429": {"mode": "status", "status": 429},
    "upstream_stall": {"mode": "stall", "stall_after": 2},
    "upstream_hang": {"mode": "hang"},
}
WEIGHTS = {
    "redis_restart": 2,
    "upstream_500": 2,
    "upstream_429": 2,
    "upstream_stall": 2,
    "upstream_hang": 1,
    "gateway_kill": 2,
    "gateway_worker_kill": 1,
    "worker_kill": 2,
}
KILLS_GATEWAY = ("gateway_kill", "gateway_worker_kill")
"""The faults that SIGKILL gateway processes (and so leave slot leases and settlements behind)."""
GAP_S = (3.0, 7.0)
"""Pause between two faults."""
REPLAY_S = SLOT_LEASE_S / 3 + 2.0
GRACE_S = {
    "redis_restart": 3.0,
    "gateway_kill": 3.0,
    "gateway_worker_kill": 3.0,
    "worker_kill": 0.0,
    **dict.fromkeys(UPSTREAM_MODES, BREAKER_RESET_S + READ_TIMEOUT_S + 2.0),
}
"""How long after a fault ends its effects may still be seen: a reconnect, or for upstream faults
an open breaker's reset timeout plus one read timeout, plus slack for a busy machine."""


@dataclass(slots=True)
class Fault:
    """One injected fault: what, when (``time.time()``), and on which instance (if one)."""

    kind: str
    start: float
    end: float
    instance: int | None = None

    def covers(self, start: float, end: float) -> bool:
        """Whether something that ran from ``start`` to ``end`` overlaps the fault's effects."""
        return start <= self.end + GRACE_S[self.kind] and end >= self.start - 0.5


class Chaos:
    """Injects faults into ``fleet`` until a deadline; :attr:`faults` lists them."""

    def __init__(self, fleet: Fleet, rng: random.Random, note: Callable[[str], None]) -> None:
        self.fleet = fleet
        self.rng = rng
        self.note = note
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        """Faults after which a member did not come back (each one fails the soak)."""
        self._redis_back = 0.0
        self._actions: dict[str, Callable[[str], Awaitable[int | None]]] = {
            "redis_restart": self._restart_redis,
            **dict.fromkeys(UPSTREAM_MODES, self._upstream),
            "gateway_kill": self._kill_gateway,
            "gateway_worker_kill": self._kill_gateway_worker,
            "worker_kill": self._kill_worker,
        }

    @property
    def victim(self) -> int:
        return len(self.fleet.gateways) - 1

    async def run(self, until: float) -> None:
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        while time.time() + GAP_S[0] < until:
            await asyncio.sleep(self.rng.uniform(*GAP_S))  # pacing the chaos, not waiting for state
            kind = self.rng.choices(kinds, weights)[0]
            if kind == "gateway_kill":
                await asyncio.sleep(max(0.0, self._redis_back + REPLAY_S - time.time()))
            start, instance = time.time(), None
            try:
                instance = await self._actions[kind](kind)
            except Exception as exc:  # a member that did not come back is a finding: go on, report it
                self.errors.append(f"{kind} at {time.strftime('%H:%M:%S')}: {type(exc).__name__}: {exc}")
                self.note(f"chaos: {kind} did not recover: {exc}")
            fault = Fault(kind, start, time.time(), instance)
            self.faults.append(fault)
            where = "" if instance is None else f" (instance {instance})"
            self.note(f"chaos: {kind}{where} for {fault.end - fault.start:.1f} s")

    async def restore(self) -> None:
        """Bring back whatever a failed fault left down: the mock's mode, Redis, every process."""
        async with httpx.AsyncClient(base_url=self.fleet.mock_url, timeout=5.0) as mock:
            (await mock.post("/_mock/config", json={"mode": "ok"})).raise_for_status()
        members: list[RedisServer | GatewayInstance | QueueWorker] = [
            self.fleet.redis,
            *self.fleet.gateways,
            *self.fleet.workers,
        ]
        for member in members:
            process = member.process
            if process is None or process.proc.poll() is not None:
                self.errors.append(f"{process.name if process else member} was down at the end: restarted")
                await asyncio.to_thread(member.start)

    def _down_s(self) -> float:
        return self.rng.uniform(0.5, 2.0)

    async def _restart_redis(self, _: str) -> None:
        await asyncio.to_thread(self.fleet.redis.kill)
        await asyncio.sleep(self._down_s())
        await asyncio.to_thread(self.fleet.redis.start)
        self._redis_back = time.time()

    async def _upstream(self, kind: str) -> None:
        async with httpx.AsyncClient(base_url=self.fleet.mock_url, timeout=5.0) as mock:
            (await mock.post("/_mock/config", json=UPSTREAM_MODES[kind])).raise_for_status()
            await asyncio.sleep(self.rng.uniform(2.0, 5.0))
            (await mock.post("/_mock/config", json={"mode": "ok"})).raise_for_status()

    async def _kill_gateway(self, _: str) -> int:
        gateway = self.fleet.gateways[self.victim]
        await asyncio.to_thread(gateway.kill)
        await asyncio.sleep(self._down_s())
        await asyncio.to_thread(gateway.start)
        return self.victim

    async def _kill_gateway_worker(self, _: str) -> int:
        gateway = self.fleet.gateways[self.victim]
        before = gateway.worker_pids()
        if before:
            os.kill(self.rng.choice(before), signal.SIGKILL)
            # uvicorn's supervisor notices within its 0.5 s health check and starts another worker
            await asyncio.to_thread(
                wait_until,
                lambda: len(set(gateway.worker_pids()) - set(before)) == 1,
                30.0,
                "uvicorn to replace the killed worker",
            )
        return self.victim

    async def _kill_worker(self, _: str) -> None:
        worker = self.fleet.workers[-1]
        await asyncio.to_thread(worker.kill)
        await asyncio.sleep(self._down_s())
        await asyncio.to_thread(worker.start)
