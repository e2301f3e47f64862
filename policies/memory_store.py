"""The in-process admission store: the Redis scripts' semantics in plain Python.

Used in dev mode (one process, nothing shared, nothing durable) and, with scaled-down limits, as
each process's fallback while Redis is unreachable and ``on_failure = "open"``. It is tested by the
same contract suite as the Redis store. Everything here runs on the event loop without awaiting,
so each admission and settlement is atomic just as a Lua script is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from policies.admission import LEASE_MS as DEFAULT_LEASE_MS
from policies.admission import (
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

MS_PER_MINUTE = 60_000


def _now_ms() -> float:
    return time.time() * 1000  # wall clock, like Redis TIME (jumps back are treated as no time passing)


class MemoryStore:
    """Buckets, slot leases and usage hashes in dicts."""

    def __init__(self, clock: Callable[[], float] = _now_ms, lease_ms: int = DEFAULT_LEASE_MS) -> None:
        self._clock = clock
        self._lease_ms = lease_ms
        self.buckets: dict[str, tuple[float, float]] = {}
        self.slots: dict[str, dict[str, float]] = {}
        self.hashes: dict[str, dict[str, str]] = {}

    async def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    async def admit(self, request: AdmissionRequest) -> Decision:
        now = self._clock()
        failed = self._first_failure(request.tenant, now)
        if failed is not None:
            return Decision(
                False, buckets=self._levels(request.tenant, now), failed=failed[0], wait_s=failed[1]
            )
        chosen, waits, only_breakers, probe = 0, [], True, ""
        for i, group in enumerate(request.candidates):
            failure = self._first_failure(group, now)
            if failure is None:
                chosen = i
                probe = self._take(group, request.slot, now)[1]
                break
            only_breakers = only_breakers and isinstance(failure[0], BreakerCheck)
            if failure[1] is not None:
                waits.append(failure[1])
        else:
            if request.candidates:
                wait = min(waits) if waits else None
                levels = self._levels(request.tenant, now)
                return Decision(False, candidate=-1, buckets=levels, wait_s=wait, only_breakers=only_breakers)
        report = self._take(request.tenant, request.slot, now)[0]
        return Decision(True, candidate=chosen, buckets=report, probe=probe)

    async def settle(self, slot: str, ops: Sequence[SettleOp]) -> list[str]:
        now = self._clock()
        closed = []
        for op in ops:
            if isinstance(op, BreakerSuccess):
                if self._breaker_success(op.key):
                    closed.append(op.key)
            else:
                self._apply(op, slot, now)
        return closed

    async def peek(self, buckets: Sequence[BucketCheck]) -> tuple[BucketState, ...]:
        return self._levels(buckets, self._clock())

    async def breaker_failure(self, key: str, threshold: int) -> BreakerState:
        fields = self.hashes.setdefault(key, {})
        state, failures = int(fields.get("s", 0)), int(fields.get("f", 0)) + 1
        if state == 2:
            return BreakerState(2, failures - 1, "")
        if state == 1 or failures >= threshold:
            fields.update(s="2", f=str(failures), o=repr(self._clock()), p="0")
            return BreakerState(2, failures, "open")
        fields["f"] = str(failures)
        return BreakerState(0, failures, "")

    async def breaker_reset(self, key: str) -> BreakerState:
        fields = self.hashes.setdefault(key, {})
        was = int(fields.get("s", 0))
        fields.update(s="0", f="0", p="0")
        return BreakerState(0, 0, "closed" if was else "")

    def _breaker_success(self, key: str) -> bool:
        fields = self.hashes.get(key)
        if fields is None:
            return False
        state = int(fields.get("s", 0))
        if state == 1:
            fields.update(s="0", f="0", p="0")
            return True
        if state == 0:
            fields["f"] = "0"
        return False

    async def renew(self, slots: Sequence[tuple[str, str]]) -> None:
        expiry = self._clock() + self._lease_ms
        for key, slot in slots:
            leases = self.slots.get(key, {})
            if slot in leases:
                leases[slot] = max(leases[slot], expiry)

    async def read(self, key: str) -> dict[str, str]:
        return dict(self.hashes.get(key, {}))

    def age(self, key: str, ms: float) -> None:
        """Move a bucket's last update ``ms`` into the past (tests: time passing, or a clock jump)."""
        level, updated = self.buckets[key]
        self.buckets[key] = (level, updated - ms)

    def _level(self, check: BucketCheck, now: float) -> float:
        state = self.buckets.get(check.key)
        if state is None:
            return float(check.capacity)
        level, updated = state
        elapsed = max(0.0, now - updated)
        return min(float(check.capacity), level + elapsed * check.capacity / MS_PER_MINUTE)

    def _live_slots(self, key: str, now: float) -> dict[str, float]:
        leases = self.slots.setdefault(key, {})
        for slot in [s for s, expiry in leases.items() if expiry <= now]:
            del leases[slot]
        return leases

    def _first_failure(self, group: Sequence[Check], now: float) -> tuple[Check, float | None] | None:
        for check in group:
            wait = self._wait(check, now)
            if wait is not None:
                return check, (None if wait < 0 else wait)
        return None

    def _wait(self, check: Check, now: float) -> float | None:
        """None when the check passes; else seconds until it could (-1: not by waiting)."""
        if isinstance(check, BucketCheck):
            cost = min(check.cost, check.capacity)
            level = self._level(check, now)
            if level >= cost:
                return None
            return math.ceil((cost - level) * MS_PER_MINUTE / check.capacity) / 1000
        if isinstance(check, SlotCheck):
            leases = self._live_slots(check.key, now)
            if len(leases) < check.limit:
                return None
            return max(1.0, min(leases.values()) - now) / 1000
        if isinstance(check, BreakerCheck):
            passes, wait, _ = self._breaker_verdict(check, now)
            return None if passes else wait / 1000
        self._reclaim(check.leases, check.key, now)
        usage = self.hashes.get(check.key, {})
        used = float(usage.get(check.spent, 0)) + float(usage.get(check.reserved, 0))
        return None if used + check.reserve <= check.limit else -1.0

    def _breaker_verdict(self, check: BreakerCheck, now: float) -> tuple[bool, float, str]:
        fields = self.hashes.get(check.key, {})
        state = int(fields.get("s", 0))
        if state == 0:
            return True, 0.0, ""
        if state == 2:
            ready = float(fields.get("o", 0)) + check.reset_ms
            return (False, ready - now, "") if now < ready else (True, 0.0, "half_open")
        out = int(fields.get("p", 0))
        if now - float(fields.get("h", 0)) > check.probe_ttl_ms:
            out = 0
        return (True, 0.0, "probe") if out < check.probes else (False, 1000.0, "")

    def _levels(self, group: Sequence[Check], now: float) -> tuple[BucketState, ...]:
        """The tenant's buckets as they stand, for the headers of a refusal."""
        return tuple(_state(c, self._level(c, now)) for c in group if isinstance(c, BucketCheck))

    def _take(self, group: Sequence[Check], slot: str, now: float) -> tuple[tuple[BucketState, ...], str]:
        report: list[BucketState] = []
        probe = ""
        for check in group:
            if isinstance(check, BucketCheck):
                level = self._level(check, now) - min(check.cost, check.capacity)
                self.buckets[check.key] = (level, now)
                report.append(_state(check, level))
            elif isinstance(check, SlotCheck):
                self._live_slots(check.key, now)[slot] = now + self._lease_ms
            elif isinstance(check, BreakerCheck):
                probe = self._take_probe(check, now) or probe
            else:
                self._add(check.key, check.reserved, check.reserve)
                member = reservation(slot, check.reserved, check.reserve)
                self.slots.setdefault(check.leases, {})[member] = now + self._lease_ms
        return tuple(report), probe

    def _reclaim(self, leases: str, key: str, now: float) -> None:
        """Give back the reservations whose leases expired (their requests' workers died)."""
        held = self.slots.get(leases, {})
        for member in [m for m, expiry in held.items() if expiry <= now]:
            del held[member]
            _, field, amount = member.split("|")
            self._add(key, field, -float(amount))

    def _take_probe(self, check: BreakerCheck, now: float) -> str:
        verdict = self._breaker_verdict(check, now)[2]
        fields = self.hashes.setdefault(check.key, {})
        if verdict == "half_open":
            fields.update(s="1", p="1", h=repr(now))
        elif verdict == "probe":
            stale = now - float(fields.get("h", 0)) > check.probe_ttl_ms
            fields.update(p="1", h=repr(now)) if stale else fields.update(p=str(int(fields.get("p", 0)) + 1))
        return verdict

    def _add(self, key: str, field: str, amount: float) -> None:
        fields = self.hashes.setdefault(key, {})
        fields[field] = _number(float(fields.get(field, 0)) + amount)

    def _apply(self, op: SettleOp, slot: str, now: float) -> None:
        if isinstance(op, AdjustBucket):
            check = BucketCheck(op.key, op.capacity, 0)
            level = min(float(op.capacity), self._level(check, now) - op.delta)
            self.buckets[op.key] = (level, now)
        elif isinstance(op, ReleaseSlot):
            self.slots.get(op.key, {}).pop(slot, None)
        elif isinstance(op, ReleaseReservation):
            if self.slots.get(op.leases, {}).pop(reservation(slot, op.field, op.amount), None) is not None:
                self._add(op.key, op.field, -op.amount)
        elif isinstance(op, Increment):
            for field, amount in op.fields:
                self._add(op.key, field, amount)
        elif isinstance(op, SetField):
            fields = self.hashes.setdefault(op.key, {})
            if not (op.only_if_missing and op.field in fields):
                fields[op.field] = op.value
        elif isinstance(op, Expire):
            pass  # nothing in memory outlives the process anyway


def _state(check: BucketCheck, level: float) -> BucketState:
    reset = math.ceil((check.capacity - level) * MS_PER_MINUTE / check.capacity) / 1000
    return BucketState(check.capacity, max(0, math.floor(level)), reset)


def _number(value: float) -> str:
    """Format like Redis' HINCRBYFLOAT: integers without a fraction."""
    return str(int(value)) if value == int(value) else repr(value)
