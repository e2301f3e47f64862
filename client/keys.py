"""Every Redis key the queue client uses, built in one place.

All of a queue's keys share the hash tag ``{mgq:<queue>}`` so they live in one Redis Cluster slot and
every Lua script can be handed all the keys it touches in ``KEYS``. Layout (``Q`` = ``{mgq:<name>}``):

================================  ==========  ==================================================
key                               type        holds
================================  ==========  ==================================================
``Q:task:<id>``                   hash        the task record (see :mod:`client.records`)
``Q:steps:<id>``                  hash        ``out:<step>`` checkpoints, ``sfx:<step>`` markers
``Q:stream``                      stream      one entry per claimable task (``task``, ``tenant``)
``Q:delayed``                     zset        retries and deferred tasks, scored by due time (ms)
``Q:idem``                        hash        idempotency key -> task id
``Q:status:<status>``             zset        task ids in that status, scored by last update (ms)
``Q:tenant_limits``               hash        tenant -> max tasks running across the fleet
``Q:tenant_slots:<tenant>``       zset        task ids holding a tenant slot, scored by lease end
``Q:stats``                       hash        terminal transitions counted by status
``Q:workers`` / ``Q:worker:<id>`` set/hash    live workers; each hash expires unless renewed
================================  ==========  ==================================================
"""

from __future__ import annotations

import re

PREFIX = "mgq"
GROUP = "workers"
STATUSES = ("queued", "running", "retrying", "waiting_human", "done", "failed", "cancelled", "dead")

_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class QueueKeys:
    """The keys of one queue."""

    def __init__(self, name: str) -> None:
        if not _NAME.match(name):
            raise ValueError(f"queue name must be 1-64 characters of [A-Za-z0-9._:-], got {name!r}")
        self.name = name
        self.base = f"{{{PREFIX}:{name}}}"
        self.stream = f"{self.base}:stream"
        self.delayed = f"{self.base}:delayed"
        self.idem = f"{self.base}:idem"
        self.limits = f"{self.base}:tenant_limits"
        self.stats = f"{self.base}:stats"
        self.workers = f"{self.base}:workers"
        self.index = tuple(f"{self.base}:status:{status}" for status in STATUSES)

    def status(self, status: str) -> str:
        return self.index[STATUSES.index(status)]

    def task(self, task_id: str) -> str:
        return f"{self.base}:task:{task_id}"

    def steps(self, task_id: str) -> str:
        return f"{self.base}:steps:{task_id}"

    def worker(self, worker_id: str) -> str:
        return f"{self.base}:worker:{worker_id}"

    def tenant_slots(self, tenant: str) -> str:
        return f"{self.base}:tenant_slots:{tenant}"
