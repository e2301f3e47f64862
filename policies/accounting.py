"""Accounting and budgets: what a request may spend, and the record of what it did spend.

Usage is kept in hashes per tenant and period (UTC day ``d2026-11-29``, month ``m2026-11`` and
``total``) and per task, each with the fields ``requests``, ``prompt_tokens``,
``completion_tokens``, ``tokens``, ``usd`` and ``estimated_requests`` (tasks also per model:
``m:<model>:<field>``). Budgets are quotas on those same fields: at admission a request reserves
its maximal cost (``usd_reserved`` / ``tokens_reserved``); settlement releases the reservation and
adds the actual usage, in the same script as the token settlement. Concurrent requests therefore
cannot overspend: a budget is exceeded only by the gap between one request's reservation and its
actual cost, never by whole requests.

Retention: a period's usage lives until its period ends plus ``RETAIN_DAY_S`` / ``RETAIN_MONTH_S``
(``total`` forever); a task's record lives ``RETAIN_TASK_S`` after its last request.
"""

from __future__ import annotations

import calendar
import time

import msgspec

from gateway.tenants import Tenant
from policies.admission import Expire, Increment, QuotaCheck, SetField, SettleOp
from policies.keys import Keys

RETAIN_DAY_S = 35 * 86_400
RETAIN_MONTH_S = 400 * 86_400
RETAIN_TASK_S = 30 * 86_400


class Period(msgspec.Struct, frozen=True, gc=False):
    """One budget period: its id in key names and the seconds until it ends (None: never)."""

    id: str
    ends_in_s: float | None


_TOTAL = Period("total", None)
_bounds_of: dict[str, tuple[str, float, float]] = {}
"""Per kind, the period last asked for: (id, start, end), so that a request in the same period
(every request, nearly) costs two comparisons instead of ``gmtime`` and ``timegm``."""


def period(kind: str, now: float | None = None) -> Period:
    """The current ``day``, ``month`` or ``total`` period, in UTC."""
    if kind == "total":
        return _TOTAL
    now = time.time() if now is None else now
    bounds = _bounds_of.get(kind)
    if bounds is None or not bounds[1] <= now < bounds[2]:
        bounds = _bounds_of[kind] = _bounds(kind, now)
    return Period(bounds[0], bounds[2] - now)


def _bounds(kind: str, now: float) -> tuple[str, float, float]:
    t = time.gmtime(now)
    if kind == "day":
        start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
        return f"d{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}", start, start + 86_400
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
    return f"m{t.tm_year:04d}-{t.tm_mon:02d}", start, calendar.timegm((year, month, 1, 0, 0, 0))


class Charge(msgspec.Struct, frozen=True, gc=False):
    """What one request used, to be recorded."""

    tenant: str
    model: str
    task_id: str | None
    prompt_tokens: int
    completion_tokens: int
    usd: float
    estimated: bool


def budget_checks(
    keys: Keys, tenant: Tenant, task_id: str | None, reserve: tuple[int, float]
) -> tuple[QuotaCheck, ...]:
    """The tenant's budget and the task's token ceiling, each reserving this request's maximum.

    ``reserve`` is (tokens, usd) at most: prompt estimate plus the completion limit.
    """
    tokens, usd = reserve
    budget, task_max_tokens = tenant.budget, tenant.task_max_tokens
    checks: list[QuotaCheck] = []
    if budget is not None:
        current = period(budget.period)
        key = keys.usage(tenant.name, current.id)
        if budget.usd is not None:
            checks.append(
                QuotaCheck(key, budget.usd, usd, "usd", "usd_reserved", "budget", current.ends_in_s)
            )
        elif budget.tokens is not None:
            checks.append(
                QuotaCheck(
                    key, budget.tokens, tokens, "tokens", "tokens_reserved", "budget", current.ends_in_s
                )
            )
    if task_id is not None and task_max_tokens is not None:
        key = keys.task(tenant.name, task_id)
        checks.append(QuotaCheck(key, task_max_tokens, tokens, "tokens", "tokens_reserved", "task_budget"))
    return tuple(checks)


def usage_ops(keys: Keys, charge: Charge, now: float | None = None) -> list[SettleOp]:
    """Record ``charge`` in the tenant's day, month and total usage and in its task."""
    now = time.time() if now is None else now
    fields = _fields(charge)
    ops: list[SettleOp] = []
    expiries: list[SettleOp] = []
    # The three increments are adjacent, so the store sends them as one op on three keys; the
    # total never expires, so it needs no expiry op.
    for kind, retain in (("day", RETAIN_DAY_S), ("month", RETAIN_MONTH_S), ("total", 0)):
        current = period(kind, now)
        key = keys.usage(charge.tenant, current.id)
        ops.append(Increment(key, fields))
        if retain:
            expiries.append(Expire(key, int((current.ends_in_s or 0) + retain)))
    ops += expiries
    if charge.task_id is not None:
        ops.extend(_task_ops(keys, charge, fields, now))
    return ops


def _fields(charge: Charge) -> tuple[tuple[str, float], ...]:
    fields: tuple[tuple[str, float], ...] = (
        ("requests", 1),
        ("prompt_tokens", charge.prompt_tokens),
        ("completion_tokens", charge.completion_tokens),
        ("tokens", charge.prompt_tokens + charge.completion_tokens),
        ("usd", float(charge.usd)),
    )
    if charge.estimated:
        fields += (("estimated_requests", 1),)
    return fields


def _task_ops(
    keys: Keys, charge: Charge, fields: tuple[tuple[str, float], ...], now: float
) -> list[SettleOp]:
    assert charge.task_id is not None
    key = keys.task(charge.tenant, charge.task_id)
    stamp = f"{now:.3f}"
    by_model = tuple((f"m:{charge.model}:{name}", value) for name, value in fields)
    ops: list[SettleOp] = [
        Increment(key, fields + by_model),
        SetField(key, "tenant", charge.tenant),
        SetField(key, "first_seen", stamp, only_if_missing=True),
        SetField(key, "last_seen", stamp),
        Expire(key, RETAIN_TASK_S),
    ]
    return ops
