"""The shared admission store: token buckets, slot leases and usage in Redis, one script per step.

Admission and settlement are each one Lua script call (``policies/lua/``), so a request costs two
Redis round trips on the happy path and every worker of every instance sees the same numbers.
Scripts run by SHA over one pipelined connection (:mod:`policies.redis_pipe`), sent whole only
after a ``NOSCRIPT`` (e.g. when Redis restarted); every key is passed in ``KEYS``; time comes from
Redis ``TIME``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import msgspec

from policies.admission import (
    LEASE_MS,
    AdjustBucket,
    AdmissionRequest,
    BreakerCheck,
    BreakerState,
    BreakerSuccess,
    BucketCheck,
    BucketState,
    Check,
    Decision,
    Expire,
    Increment,
    ReleaseReservation,
    ReleaseSlot,
    SetField,
    SettleOp,
    SlotCheck,
    reservation,
)
from policies.redis_pipe import RedisPipe, Script

_encode = msgspec.json.encode


def load_script(name: str) -> str:
    return resources.files("policies").joinpath("lua", name).read_text(encoding="utf-8")


class _KeyIndex(dict[str, int]):
    """Collects the keys of one script call and numbers them for ``KEYS[i]`` (a dict in insertion
    order, so numbering a key is one ``setdefault``)."""

    def __call__(self, key: str) -> int:
        return self.setdefault(key, len(self) + 1)


class RedisStore:
    """Admission and settlement against one Redis (or one Cluster slot)."""

    def __init__(self, pipe: RedisPipe, lease_ms: int = LEASE_MS) -> None:
        self.pipe = pipe
        self._lease_ms = lease_ms
        self._admit = Script(load_script("admit_v3.lua"))
        self._settle = Script(load_script("settle_v4.lua"))
        self._breaker = Script(load_script("breaker_v1.lua"))
        self._peek = Script(load_script("peek_v1.lua"))
        self._renew = Script(load_script("renew_v1.lua"))

    async def ping(self) -> None:
        await self.pipe.ping()

    async def aclose(self) -> None:
        await self.pipe.aclose()

    async def admit(self, request: AdmissionRequest) -> Decision:
        index = _KeyIndex()
        slot = request.slot
        groups = [[_check(c, index, slot) for c in request.tenant]]
        groups.extend([_check(c, index, slot) for c in group] for group in request.candidates)
        spec = _encode({"groups": groups, "slot": request.slot, "lease_ms": self._lease_ms})
        reply: list[Any] = await self.pipe.evalsha(self._admit, list(index), [spec])
        if reply[0] == 1:
            chosen = max(0, int(reply[1]) - 2)
            probe = _text(reply[3])
            return Decision(True, candidate=chosen, buckets=_report(request.tenant, reply[2]), probe=probe)
        wait = int(reply[3])
        wait_s = None if wait < 0 else wait / 1000
        buckets = _report(request.tenant, reply[4])
        if int(reply[1]) == 1:
            return Decision(False, buckets=buckets, failed=request.tenant[int(reply[2]) - 1], wait_s=wait_s)
        only_breakers = int(reply[2]) == 1
        return Decision(False, candidate=-1, buckets=buckets, wait_s=wait_s, only_breakers=only_breakers)

    async def settle(self, slot: str, ops: Sequence[SettleOp]) -> list[str]:
        index = _KeyIndex()
        encoded: list[list[Any]] = []
        last_fields: tuple[tuple[str, float], ...] | None = None  # of the last row, an increment
        for op in ops:
            if type(op) is not Increment:
                encoded.append(_ROWS[type(op)](op, index, slot))
                last_fields = None
            elif op.fields is last_fields:
                encoded[-1][1].append(index(op.key))  # the same amounts into another hash
            else:
                row = _increment_row(op, index)
                if last_fields is not None and encoded[-1][2:] == row[2:]:
                    encoded[-1][1].append(row[1][0])
                else:
                    encoded.append(row)
                last_fields = op.fields
        spec = _encode({"ops": encoded, "slot": slot})
        keys = list(index)
        closed: list[Any] = await self.pipe.evalsha(self._settle, keys, [spec])
        return [keys[int(i) - 1] for i in closed]

    async def peek(self, buckets: Sequence[BucketCheck]) -> tuple[BucketState, ...]:
        if not buckets:
            return ()
        rows = await self.pipe.evalsha(self._peek, [b.key for b in buckets], [b.capacity for b in buckets])
        return _report(buckets, rows)

    async def breaker_failure(self, key: str, threshold: int) -> BreakerState:
        return _breaker_state(await self.pipe.evalsha(self._breaker, [key], ["fail", threshold]))

    async def breaker_reset(self, key: str) -> BreakerState:
        return _breaker_state(await self.pipe.evalsha(self._breaker, [key], ["reset"]))

    async def renew(self, slots: Sequence[tuple[str, str]]) -> None:
        if slots:
            keys = [k for k, _ in slots]
            await self.pipe.evalsha(self._renew, keys, [self._lease_ms, *(s for _, s in slots)])

    async def read(self, key: str) -> dict[str, str]:
        flat: list[bytes] = await self.pipe.call("HGETALL", key)
        return {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}


def _check(check: Check, index: _KeyIndex, slot: str) -> list[Any]:
    if isinstance(check, BucketCheck):
        return ["b", index(check.key), check.capacity, check.cost]
    if isinstance(check, SlotCheck):
        return ["c", index(check.key), check.limit]
    if isinstance(check, BreakerCheck):
        return ["k", index(check.key), check.reset_ms, check.probes, check.probe_ttl_ms]
    member = reservation(slot, check.reserved, check.reserve)
    row = ["q", index(check.key), check.limit, check.reserve, check.spent, check.reserved]
    return [*row, index(check.leases), member]


def _increment_row(op: Increment, index: _KeyIndex) -> list[Any]:
    """An ``Increment`` as settle_v4.lua reads it: float amounts' fields are marked with a dot."""
    row: list[Any] = ["i", [index(op.key)]]
    for field, amount in op.fields:
        row += ("." + field if type(amount) is float else field, amount)
    return row


def _adjust_row(op: AdjustBucket, index: _KeyIndex, slot: str) -> list[Any]:
    return ["b", index(op.key), op.capacity, op.delta]


def _release_slot_row(op: ReleaseSlot, index: _KeyIndex, slot: str) -> list[Any]:
    return ["c", index(op.key)]


def _release_reservation_row(op: ReleaseReservation, index: _KeyIndex, slot: str) -> list[Any]:
    member = reservation(slot, op.field, op.amount)
    return ["q", index(op.key), op.field, op.amount, index(op.leases), member]


def _set_field_row(op: SetField, index: _KeyIndex, slot: str) -> list[Any]:
    return ["n" if op.only_if_missing else "s", index(op.key), op.field, op.value]


def _breaker_success_row(op: BreakerSuccess, index: _KeyIndex, slot: str) -> list[Any]:
    return ["k", index(op.key)]


def _expire_row(op: Expire, index: _KeyIndex, slot: str) -> list[Any]:
    return ["x", index(op.key), op.seconds]


_ROWS: dict[type, Callable[..., list[Any]]] = {
    AdjustBucket: _adjust_row,
    ReleaseSlot: _release_slot_row,
    ReleaseReservation: _release_reservation_row,
    SetField: _set_field_row,
    BreakerSuccess: _breaker_success_row,
    Expire: _expire_row,
}
"""Each settle op but ``Increment`` as settle_v4.lua reads it, by the op's type (one dict lookup
instead of a ``match`` trying the types in turn)."""


def _report(tenant: Sequence[Check], rows: list[Any]) -> tuple[BucketState, ...]:
    buckets = [c for c in tenant if isinstance(c, BucketCheck)]
    states = []
    for check, (level, reset_ms) in zip(buckets, rows, strict=True):
        remaining = max(0, math.floor(float(level)))
        states.append(BucketState(check.capacity, remaining, int(reset_ms) / 1000))
    return tuple(states)


def _breaker_state(reply: list[Any]) -> BreakerState:
    return BreakerState(int(reply[0]), int(reply[1]), _text(reply[2]))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
