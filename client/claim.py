"""A worker's hold on one task: the claim token and every fenced write made under it.

Claiming issues a random token stored in the task record; each later write (heartbeat, step begin
and checkpoint, result, failure) is a script that first checks the record still carries that token
and status ``running``. When the lease expired and another worker claimed the task, the token
changed, so a worker that was frozen, partitioned or just slow gets ``lost`` back and writes nothing
over the new owner's work.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Literal, cast

from client.keys import GROUP
from client.queue import Queue
from client.records import pairs

BeatReply = Literal["ok", "cancel", "lost"]
HISTORY_LIMIT = 20
CLAIMED_FIELDS = ("attempt", "kind", "payload", "tenant", "cancel")


@dataclass(frozen=True)
class Offer:
    """A stream entry a worker was handed: which task, for which tenant."""

    entry: str
    task_id: str
    tenant: str


@dataclass
class Claim:
    """A task this worker holds: ``fields`` (``CLAIMED_FIELDS`` of its record) and ``steps`` (its
    checkpoints and side-effect markers) as they were when it was claimed."""

    queue: Queue
    offer: Offer
    worker_id: str
    token: str
    lease_ms: int
    fields: dict[str, str]
    steps: dict[str, str]
    ending: bool = False  # the final write (complete or fail) has been sent

    @property
    def task_id(self) -> str:
        return self.offer.task_id

    @property
    def attempt(self) -> int:
        return int(self.fields["attempt"])

    def _task_keys(self, *extra: str) -> list[str]:
        return [*self.queue.keys.index, self.queue.keys.task(self.task_id), *extra]

    @property
    def _slots(self) -> str:
        return self.queue.keys.tenant_slots(self.offer.tenant or "-")

    async def heartbeat(self) -> BeatReply:
        keys = self._task_keys(self.queue.keys.stream, self._slots)
        args: list[Any] = [self.token, self.lease_ms, GROUP, self.worker_id, self.task_id]
        reply: BeatReply = await self.queue.scripts("heartbeat", keys, args)
        return reply

    async def begin_step(self, name: str, side_effect: bool) -> BeatReply:
        keys = self._task_keys(self.queue.keys.steps(self.task_id))
        args: list[Any] = [self.token, name, "1" if side_effect else "0", self.attempt]
        reply: BeatReply = await self.queue.scripts("step_begin", keys, args)
        return reply

    async def end_step(self, name: str, output: str, usage: tuple[int, int, int]) -> BeatReply:
        keys = self._task_keys(self.queue.keys.steps(self.task_id))
        reply: BeatReply = await self.queue.scripts("step_done", keys, [self.token, name, output, *usage])
        return reply

    async def abort_step(self, name: str) -> BeatReply:
        keys = self._task_keys(self.queue.keys.steps(self.task_id))
        reply: BeatReply = await self.queue.scripts("step_abort", keys, [self.token, name])
        return reply

    async def complete(self, result: str) -> str:
        """Store ``result`` and acknowledge; returns the final status, or ``lost``."""
        self.ending = True
        keys = self._task_keys(self.queue.keys.stream, self._slots, self.queue.keys.stats)
        args: list[Any] = [self.token, result, GROUP, HISTORY_LIMIT, self.task_id]
        final: str = await self.queue.scripts("complete", keys, args)
        return final

    async def fail(self, outcome: str, error: str, delay_s: float = 0.0) -> str:
        """End the attempt without a result; returns the status it left the task in, or ``lost``."""
        self.ending = True
        keys = self._task_keys(
            self.queue.keys.stream, self.queue.keys.delayed, self._slots, self.queue.keys.stats
        )
        delay_ms = int(delay_s * 1000)
        args: list[Any] = [self.token, outcome, error, delay_ms, GROUP, HISTORY_LIMIT, self.task_id]
        final: str = await self.queue.scripts("fail", keys, args)
        return final


async def claim(queue: Queue, offer: Offer, worker_id: str, lease_ms: int, defer_ms: int) -> Claim | str:
    """Try to take the task behind ``offer``; a :class:`Claim`, or why not (``skip``, ``busy``, ...)."""
    keys = queue.keys
    task_keys = [keys.task(offer.task_id), keys.steps(offer.task_id), keys.stream, keys.delayed]
    all_keys = [*keys.index, *task_keys, keys.tenant_slots(offer.tenant or "-"), keys.limits, keys.stats]
    token = secrets.token_hex(12)
    args: list[Any] = [GROUP, offer.entry, worker_id, token, lease_ms, defer_ms, offer.tenant]
    reply = await queue.scripts("claim", all_keys, [*args, HISTORY_LIMIT, offer.task_id])
    if reply[0] != "claimed":
        return str(reply[0])
    fields = {name: value for name, value in zip(CLAIMED_FIELDS, reply[1], strict=True) if value is not None}
    return Claim(queue, offer, worker_id, token, lease_ms, fields, pairs(reply[2]))


async def release(queue: Queue, offer: Offer) -> None:
    """Hand back an entry delivered to a stopping worker, so another worker gets it now."""
    keys = [*queue.keys.index, queue.keys.task(offer.task_id), queue.keys.stream]
    await queue.scripts("release", keys, [GROUP, offer.entry, offer.task_id])


async def redis_now_ms(queue: Queue) -> int:
    seconds, micros = await queue.redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def promote(queue: Queue, due_by_ms: float, batch: int = 100) -> int:
    """Queue the delayed tasks that are due; returns how many moved.

    ``due_by_ms`` (an estimate of Redis time) only picks the candidates; the script checks each one
    against Redis ``TIME``, so a wrong estimate delays a retry but never runs one early.
    """
    due = await queue.redis.zrangebyscore(queue.keys.delayed, "-inf", due_by_ms, start=0, num=batch)
    if not due:
        return 0
    ids = cast("list[str]", due)
    keys = [*queue.keys.index, queue.keys.delayed, queue.keys.stream, *map(queue.keys.task, ids)]
    moved: int = await queue.scripts("promote", keys, ids)
    return moved
