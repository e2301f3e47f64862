"""Admission policy: which limits a request meets, what it reserves, and how it is settled.

At admission a request reserves one request from the tenant's ``rpm`` bucket and its token
estimate (prompt estimate + ``max_tokens``, or the configured default) from ``tpm``, takes a
concurrency slot, and does the same at the first candidate target whose provider has room. After
the response it settles: tokens are refunded or debited to the actual usage and slots are freed.
Admission and settlement are one store call each.

When Redis is unreachable, ``on_failure = "closed"`` answers 503 ``state_unavailable``; ``"open"``
admits on a per-process in-memory store whose limits are this process's share of the real ones.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import msgspec
from redis.exceptions import RedisError

from gateway.errors import (
    GatewayError,
    QuotaExceeded,
    RateLimited,
    StateUnavailable,
    UpstreamFailure,
    UpstreamUnavailable,
)
from gateway.tenants import Tenant
from policies.admission import (
    LEASE_MS,
    AdjustBucket,
    AdmissionRequest,
    AdmissionStore,
    BucketCheck,
    Check,
    Decision,
    QuotaCheck,
    ReleaseReservation,
    ReleaseSlot,
    SettleOp,
    SlotCheck,
    reservation,
)
from policies.breakers import Breakers
from policies.durations import go_duration
from policies.keys import Keys
from policies.memory_store import MemoryStore
from policies.routing import Target
from policies.tasks import stop_task

log = logging.getLogger("modelgate.state")

PENDING_SETTLEMENTS = 10_000
"""Settlements kept while Redis is away, replayed when it returns (oldest dropped beyond this)."""


class Limits(msgspec.Struct, frozen=True, gc=False):
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None


@dataclass(slots=True)
class Ticket:
    """What one admitted request holds until it is settled."""

    slot: str
    store: AdmissionStore
    reserved_tokens: int
    tenant: tuple[Check, ...]
    held: list[Held] = field(default_factory=list)
    """The targets admitted for this request's attempts, in order."""
    target_index: int = 0
    share: float = 1.0
    """The part of each limit this request is held to (below 1 on the per-process fallback)."""
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False


class Held(msgspec.Struct, frozen=True, gc=False):
    """One attempt's admission at a target: its provider's checks (breaker included)."""

    target: str
    checks: tuple[Check, ...]


class StateHealth:
    """Whether Redis answered last time; logs each change."""

    def __init__(self) -> None:
        self.ok = True

    def mark(self, ok: bool, error: BaseException | None = None) -> None:
        if ok != self.ok:
            self.ok = ok
            fields = {"redis": "up" if ok else "down", "error": type(error).__name__ if error else None}
            log.warning("redis connectivity changed", extra={"fields": fields})


class Limiter:
    """Admits and settles requests against one store, with an optional per-process fallback."""

    def __init__(
        self,
        store: AdmissionStore,
        keys: Keys,
        providers: dict[str, Limits],
        default_max_tokens: int,
        breakers: Breakers,
        *,
        fallback_share: float | None = None,
        lease_ms: int = LEASE_MS,
    ) -> None:
        self._store = store
        self.keys = keys
        self.breakers = breakers
        self._providers = providers
        self._default_max_tokens = default_max_tokens
        self._share = fallback_share
        self._fallback = MemoryStore(lease_ms=lease_ms) if fallback_share is not None else None
        self.health = StateHealth()
        self._in_flight: dict[str, list[tuple[str, str]]] = {}
        self._pending: deque[tuple[str, list[SettleOp]]] = deque(maxlen=PENDING_SETTLEMENTS)
        self._renewer: asyncio.Task[None] | None = None
        self._renew_every_s = lease_ms / 3000

    @property
    def shared(self) -> bool:
        return not isinstance(self._store, MemoryStore)

    @property
    def store(self) -> AdmissionStore:
        return self._store

    async def admit(
        self,
        tenant: Tenant,
        targets: Sequence[Target],
        reserve_tokens: int,
        slot: str,
        quotas: tuple[QuotaCheck, ...] = (),
    ) -> Ticket:
        """Reserve capacity for one request at the first target that can take it.

        Raises ``RateLimited`` (tenant or provider limits), ``UpstreamUnavailable`` (every
        target's breaker is open) or ``StateUnavailable`` (Redis away, ``on_failure = "closed"``).
        """
        request = self._request(tenant, targets, reserve_tokens, slot, 1.0, *quotas)
        store: AdmissionStore = self._store
        try:
            decision = await store.admit(request)
        except (RedisError, OSError) as exc:
            self.health.mark(False, exc)
            if self._fallback is None or self._share is None:
                raise StateUnavailable("the gateway's shared state (Redis) is unreachable") from None
            request = self._request(tenant, targets, reserve_tokens, slot, self._share, *quotas)
            store = self._fallback
            decision = await store.admit(request)
        else:
            self.health.mark(True)
        ticket = Ticket(slot, store, reserve_tokens, request.tenant, target_index=decision.candidate)
        if store is self._fallback and self._share is not None:
            ticket.share = self._share
        ticket.headers = _rate_headers(request.tenant, decision)
        if not decision.admitted:
            raise _refusal(tenant, decision, ticket.headers)
        self._took(ticket, targets[decision.candidate], request.candidates[decision.candidate], decision)
        self._hold(ticket)
        return ticket

    async def rate_headers(self, tenant: Tenant) -> dict[str, str]:
        """The ``x-ratelimit-*`` headers of a tenant's buckets as they stand (one read-only call),
        for answers given without admission; empty if Redis does not answer."""
        limits = Limits(tenant.rpm, tenant.tpm, None)
        buckets = [
            c
            for c in _checks(partial(self.keys.tenant, tenant.name), limits, 0, 1.0)
            if isinstance(c, BucketCheck)
        ]
        if not buckets:
            return {}
        try:
            states = await self._store.peek(buckets)
        except (RedisError, OSError) as exc:
            self.health.mark(False, exc)
            return {}
        return _rate_headers(buckets, Decision(True, buckets=states))

    async def admit_next(self, ticket: Ticket, targets: Sequence[Target]) -> int:
        """Admit a retry at the first of ``targets`` whose provider and breaker let it through."""
        request = AdmissionRequest(
            slot=ticket.slot,
            tenant=(),
            candidates=tuple(self._target_checks(t, ticket.reserved_tokens, ticket.share) for t in targets),
        )
        try:
            decision = await ticket.store.admit(request)
        except (RedisError, OSError) as exc:
            self.health.mark(False, exc)
            raise StateUnavailable("the gateway's shared state (Redis) is unreachable") from None
        if not decision.admitted:
            raise _refusal(None, decision, ticket.headers)
        self._took(ticket, targets[decision.candidate], request.candidates[decision.candidate], decision)
        self._hold(ticket)
        return decision.candidate

    async def failed(self, ticket: Ticket, target: str, failure: UpstreamFailure) -> None:
        """Record a failed attempt against the target's breaker (when the failure counts)."""
        if not failure.breaker_failure:
            return
        try:
            await self.breakers.failure(ticket.store, target)
        except (RedisError, OSError) as exc:
            self.health.mark(False, exc)

    async def settle(
        self, ticket: Ticket, used_tokens: int, upstream_answered: bool, extra: Sequence[SettleOp] = ()
    ) -> None:
        """Settle to the tokens actually used (0 when the call failed); never raises.

        ``upstream_answered``: the last attempt got an answer (success, or an error that is not
        the upstream's fault), which closes a half-open breaker.
        """
        if ticket.settled:
            return
        ticket.settled = True
        self._in_flight.pop(ticket.slot, None)
        ops = _settle_ops(ticket.tenant, used_tokens - ticket.reserved_tokens)
        for i, held in enumerate(ticket.held):
            last = i == len(ticket.held) - 1
            ops.extend(_settle_ops(held.checks, (used_tokens if last else 0) - ticket.reserved_tokens))
        if ticket.held and upstream_answered:
            ops.append(self.breakers.success(ticket.held[-1].target))
        ops.extend(
            ReleaseReservation(c.key, c.reserved, c.reserve)
            for c in ticket.tenant
            if isinstance(c, QuotaCheck)
        )
        ops.extend(extra)
        if not ops:
            return
        try:
            closed = await ticket.store.settle(ticket.slot, ops)
        except (RedisError, OSError) as exc:
            self.health.mark(False, exc)
            self._pending.append((ticket.slot, ops))
            return
        if closed and ticket.held:
            self.breakers.transitioned(ticket.held[-1].target, "closed")

    def _took(self, ticket: Ticket, target: Target, checks: tuple[Check, ...], decision: Decision) -> None:
        ticket.held.append(Held(target.name, checks))
        if decision.probe == "half_open":
            self.breakers.transitioned(target.name, "half_open")

    def start(self) -> None:
        """Start renewing in-flight slot leases (and replaying settlements kept during an outage)."""
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def stop(self) -> None:
        if self._renewer is not None:
            await stop_task(self._renewer)
            self._renewer = None
        await self._store.aclose()

    async def ping(self) -> bool:
        """Whether the shared store answers now (for ``/readyz``)."""
        if not self.shared:
            return True
        try:
            async with asyncio.timeout(0.5):
                await self._store.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            self.health.mark(False, exc)
            return False
        self.health.mark(True)
        return True

    def _request(
        self,
        tenant: Tenant,
        targets: Sequence[Target],
        reserve: int,
        slot: str,
        share: float,
        *quotas: QuotaCheck,
    ) -> AdmissionRequest:
        limits = Limits(tenant.rpm, tenant.tpm, tenant.max_concurrency)
        checks = (*_checks(partial(self.keys.tenant, tenant.name), limits, reserve, share), *quotas)
        candidates = tuple(self._target_checks(t, reserve, share) for t in targets)
        return AdmissionRequest(slot=slot, tenant=checks, candidates=candidates)

    def _target_checks(self, target: Target, reserve: int, share: float) -> tuple[Check, ...]:
        """The provider's limits (if any) and the target's breaker."""
        limits = self._providers.get(target.provider_name)
        breaker = self.breakers.check(target.name)
        if limits is None:
            return (breaker,)
        return (*_checks(partial(self.keys.provider, target.provider_name), limits, reserve, share), breaker)

    def _hold(self, ticket: Ticket) -> None:
        """Keep renewing the leases of the ticket's concurrency slots and quota reservations."""
        slots = [
            (c.key, ticket.slot)
            for group in (ticket.tenant, *(held.checks for held in ticket.held))
            for c in group
            if isinstance(c, SlotCheck)
        ]
        slots.extend(
            (c.leases, reservation(ticket.slot, c.reserved, c.reserve))
            for c in ticket.tenant
            if isinstance(c, QuotaCheck)
        )
        if slots and ticket.store is self._store:
            self._in_flight[ticket.slot] = slots

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self._renew_every_s)
            slots = [pair for pairs in list(self._in_flight.values()) for pair in pairs]
            if not slots and not self._pending:
                continue  # nothing to send: say nothing about Redis' health either
            try:
                await self._store.renew(slots)
                await self._replay()
            except (RedisError, OSError) as exc:
                self.health.mark(False, exc)
            else:
                self.health.mark(True)

    async def _replay(self) -> None:
        while self._pending:
            slot, ops = self._pending[0]
            await self._store.settle(slot, ops)
            self._pending.popleft()


def _checks(key: Callable[[str], str], limits: Limits, reserve: int, share: float) -> tuple[Check, ...]:
    """The checks of one party (tenant or provider); ``key`` names its bucket or slot set."""
    checks: list[Check] = []
    if limits.rpm is not None:
        checks.append(BucketCheck(key("rpm"), _scaled(limits.rpm, share), 1))
    if limits.tpm is not None:
        checks.append(BucketCheck(key("tpm"), _scaled(limits.tpm, share), reserve, tokens=True))
    if limits.max_concurrency is not None:
        checks.append(SlotCheck(key("conc"), _scaled(limits.max_concurrency, share)))
    return tuple(checks)


def _scaled(limit: int, share: float) -> int:
    return max(1, math.floor(limit * share))


def _settle_ops(group: Sequence[Check], token_delta: int) -> list[SettleOp]:
    ops: list[SettleOp] = []
    for check in group:
        if isinstance(check, BucketCheck) and check.tokens:
            ops.append(AdjustBucket(check.key, check.capacity, token_delta))
        elif isinstance(check, SlotCheck):
            ops.append(ReleaseSlot(check.key))
    return ops


def _rate_headers(tenant: Sequence[Check], decision: Decision) -> dict[str, str]:
    headers: dict[str, str] = {}
    buckets = [c for c in tenant if isinstance(c, BucketCheck)]
    for check, state in zip(buckets, decision.buckets, strict=False):
        kind = "tokens" if check.tokens else "requests"
        headers[f"x-ratelimit-limit-{kind}"] = str(state.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(state.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = go_duration(state.reset_s)
    return headers


def _refusal(tenant: Tenant | None, decision: Decision, headers: dict[str, str]) -> GatewayError:
    """The error for a refused admission: 429 for limits, 503 when only breakers refused."""
    wait = decision.wait_s if decision.wait_s is not None else 1.0
    retry = {
        "retry-after": str(max(1, math.ceil(wait))),
        "retry-after-ms": str(max(1, math.ceil(wait * 1000))),
    }
    failed = decision.failed
    if failed is None and decision.only_breakers:
        message = "every target of this model has an open circuit breaker"
        return UpstreamUnavailable(message, headers={**headers, **retry})
    name = tenant.name if tenant else "?"
    if isinstance(failed, QuotaCheck):
        return _quota_refusal(name, failed, headers)
    if failed is None:
        reason, message = "provider", "every provider that serves this model is at its rate limit"
    elif isinstance(failed, SlotCheck):
        reason, message = "concurrency", f"tenant {name!r} is at its max_concurrency of {failed.limit}"
    else:
        assert isinstance(failed, BucketCheck)
        kind = "tpm" if failed.tokens else "rpm"
        reason, message = kind, f"tenant {name!r} is over its {kind} limit of {failed.capacity}"
    return RateLimited(message, reason=reason, headers={**headers, **retry})


def _quota_refusal(tenant: str, failed: QuotaCheck, headers: dict[str, str]) -> QuotaExceeded:
    what = "budget" if failed.reason == "budget" else "task_max_tokens"
    message = f"tenant {tenant!r} has used up its {what}"
    retry = {}
    if failed.resets_in_s is not None:
        retry = {"retry-after": str(max(1, math.ceil(failed.resets_in_s)))}
    return QuotaExceeded(message, reason=failed.reason, headers={**headers, **retry})


def new_slot_id() -> str:
    return os.urandom(9).hex()
