"""The soak's end-of-run checks: each turns the collected :class:`Evidence` into one table row.

The checks, their bounds and why (see also loadtest/README.md, "Soak"):

0. recovery -- faults were injected, and after each the member it hit came back.
1. accounting -- the tokens the gateway recorded (every tenant's usage) equal the tokens the mock
   upstream served: the usage of its whole replies, plus for streams it cut (no usage) the
   gateway's documented estimate, prompt estimate + one token per chunk relayed. The only
   allowed shortfall is requests in flight at a gateway SIGKILL (the process died before it
   settled): at most the most those requests could use. Never more accounted than served.
2. budget -- the budgeted tenant's spend is at most its budget: the documented overshoot is the
   gap between one request's reservation and its actual cost, and the mock never answers past a
   request's ``max_tokens``, so here that gap is never positive. The budget must have been used
   up (refusals seen), else the check proved nothing. Its reservations must all be released.
3. rates -- the rpm tenant's admitted requests are at most its bucket's allowance over the run
   (a minute's quota, then rpm/60 a second); the concurrency tenant never held more live slots
   than its limit (sampled from Redis twice a second).
4. slots -- after the traffic stopped and a slot lease passed, no slot lease is alive.
5. explained -- every 5xx, dropped connection, cut stream and failed task attempt overlaps a
   fault that explains it (its code's cause, on its instance) or that fault's grace period.
6. tasks -- every enqueued task is ``done`` or ``dead`` (none lost, none stuck), and every done
   task applied its side effect exactly once.
7. memory -- the RSS of each never-killed worker (gateway and queue) at the end is at most 1.25x
   its RSS after warm-up.
"""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from client.records import TaskInfo
from loadtest.soak_chaos import KILLS_GATEWAY, UPSTREAM_MODES, Fault
from loadtest.soak_traffic import NEVER_SENT, Outcome

RSS_FACTOR = 1.25
TERMINAL_OK = ("done", "dead")
UPSTREAM = tuple(UPSTREAM_MODES)
EXPLAINED_BY: dict[str, tuple[str, ...]] = {
    "state_unavailable": ("redis_restart",),
    "upstream_unavailable": UPSTREAM,
    "upstream_timeout": UPSTREAM,
    "upstream_error": UPSTREAM,
    "transport": KILLS_GATEWAY,
    "redis": ("redis_restart",),
}
"""Which faults can cause each failure: a gateway error code, ``transport`` (no complete answer
from a gateway instance) or ``redis`` (the task's own Redis call failed)."""
_GATEWAY_ANSWER = re.compile(r"gateway answered (\d{3}) (\w+)")
_TRANSPORT_ERRORS = ("APIConnectionError", "APITimeoutError")
_REDIS_ERRORS = ("ConnectionError", "TimeoutError", "BusyLoadingError")


@dataclass(frozen=True, slots=True)
class Row:
    check: str
    value: str
    bound: str
    ok: bool


@dataclass(frozen=True, slots=True)
class Failure:
    """Something the traffic saw go wrong, to be explained by a fault."""

    source: str
    cause: str
    """A key of :data:`EXPLAINED_BY`, or anything else (never explained)."""
    start: float
    end: float
    instance: int | None
    most_tokens: int = 0
    detail: str = ""
    """What was seen (an error's text), for the report of an unexplained failure."""


@dataclass(slots=True)
class Evidence:
    """Everything the checks read, collected after the traffic stopped and the queue drained."""

    outcomes: list[Outcome]
    faults: list[Fault]
    mock_tokens: dict[str, int]
    usage: dict[str, dict[str, Any]]
    """Tenant -> its usage from ``GET /admin/tenants/{name}``."""
    budget_usd: float
    budget_reserved_usd: float
    limited_rpm: int
    narrow_limit: int
    narrow_max_live: int
    live_slots: int
    expired_slots: int
    tasks: dict[str, TaskInfo | None]
    task_most_tokens: dict[str, int]
    worker_instance: dict[int, int]
    """Queue worker pid -> the gateway instance it calls."""
    effect_keys: set[str]
    effect_applications: int
    effect_runs: int
    enqueue_failures: int
    chaos_errors: list[str] = field(default_factory=list)
    rss: list[tuple[str, int | None, int | None]] = field(default_factory=list)
    """(process, KiB after warm-up, KiB at the end); ``None``: it was not there."""


def failures(evidence: Evidence) -> list[Failure]:
    """Every failure the client and the queue workers saw."""
    found = [_client_failure(o) for o in evidence.outcomes if o.failure is not None]
    for task_id, info in evidence.tasks.items():
        if info is not None:
            most = evidence.task_most_tokens.get(task_id, 0)
            found.extend(_attempt_failures(info, most, evidence.worker_instance))
    return found


def _client_failure(outcome: Outcome) -> Failure:
    cause = {"transport": "transport", "unexpected": f"unexpected {outcome.status} {outcome.code}"}.get(
        outcome.failure or "", outcome.code or f"status {outcome.status}"
    )
    source = f"{outcome.tenant} {'stream' if outcome.stream else 'whole'} {outcome.status}"
    # A connection never made carried no request: the upstream cannot have served it.
    most = 0 if outcome.transport in NEVER_SENT else outcome.most_tokens
    return Failure(source, cause, outcome.sent, outcome.done, outcome.instance, most)


def _attempt_failures(info: TaskInfo, most: int, worker_instance: dict[int, int]) -> Iterable[Failure]:
    for attempt in info.history:
        if attempt.outcome == "lease_expired" or not attempt.error:
            continue  # a killed worker: chaos, not a failure its traffic saw
        pid = int(attempt.worker.split(":")[1]) if attempt.worker.count(":") >= 2 else -1
        instance = worker_instance.get(pid)
        answered = _GATEWAY_ANSWER.search(attempt.error)
        if answered and int(answered.group(1)) >= 500:
            cause = answered.group(2)
        elif attempt.error.startswith(_TRANSPORT_ERRORS):
            cause = "transport"
        elif attempt.error.startswith(_REDIS_ERRORS):
            cause = "redis"
        else:
            cause = f"task error {attempt.error[:80]}"
        transport_most = most if cause == "transport" else 0
        yield Failure(
            f"task {info.id[:8]}",
            cause,
            attempt.started,
            attempt.ended,
            instance,
            transport_most,
            attempt.error[:200],
        )


def explained(failure: Failure, faults: list[Fault]) -> bool:
    kinds = EXPLAINED_BY.get(failure.cause, ())
    return any(
        f.kind in kinds
        and f.covers(failure.start, failure.end)
        and (f.kind not in KILLS_GATEWAY or f.instance == failure.instance)
        for f in faults
    )


def check_accounting(evidence: Evidence, seen: list[Failure]) -> Row:
    t = evidence.mock_tokens
    served = t["prompt_tokens"] + t["completion_tokens"]
    estimated = t["cut_prompt_tokens"] + t["cut_events"]
    upstream = served + estimated
    accounted = round(sum(float(u.get("tokens", 0)) for u in evidence.usage.values()))
    lost = [f for f in seen if f.cause == "transport"]
    bound = sum(f.most_tokens for f in lost)
    missing = upstream - accounted
    estimates = round(sum(float(u.get("estimated_requests", 0)) for u in evidence.usage.values()))
    value = (
        f"gateway {accounted:,} vs upstream {upstream:,} ({served:,} reported + {estimated:,} "
        f"estimated for {t['cut_streams']} cut streams; gateway estimated {estimates}): short {missing:,}"
    )
    bound_text = f"short 0..{bound:,} (the most of {len(lost)} calls cut by a SIGKILL)"
    return Row("1 accounted tokens = upstream tokens", value, bound_text, 0 <= missing <= bound)


def check_budget(evidence: Evidence) -> list[Row]:
    usage = evidence.usage.get("budgeted", {})
    spent = float(usage.get("usd", 0.0))
    refused = sum(1 for o in evidence.outcomes if o.tenant == "budgeted" and o.code == "insufficient_quota")
    budget = evidence.budget_usd
    value = f"spent ${spent:.6f} of ${budget:.6f}; {refused} refused insufficient_quota"
    bound = f"<= ${budget:.6f} (reservation >= actual for every call), used up"
    spend = Row("2 budgeted tenant within budget", value, bound, spent <= budget + 1e-9 and refused > 0)
    reserved = evidence.budget_reserved_usd
    leak = Row(
        "2b budget reservations released",
        f"usd_reserved ${reserved:.6f} after the traffic",
        "$0 (+-1e-9 float residue)",
        abs(reserved) <= 1e-9,
    )
    return [spend, leak]


def check_rates(evidence: Evidence) -> list[Row]:
    mine = [o for o in evidence.outcomes if o.tenant == "limited"]
    admitted = [o for o in mine if o.admitted]
    unknown = sum(1 for o in mine if o.admitted is None)
    refused = sum(1 for o in mine if o.code == "rate_limit_exceeded")
    rpm = evidence.limited_rpm
    span = (max(o.done for o in admitted) - min(o.sent for o in admitted)) if admitted else 0.0
    allowed = rpm + rpm / 60 * span
    rpm_row = Row(
        "3 rpm tenant admitted within its bucket",
        f"admitted {len(admitted)} (+{unknown} unknown: connection cut) of {len(mine)}; {refused} refused",
        f"<= {allowed:.1f} ({rpm} + {rpm}/60 x {span:.1f} s), some refused",
        len(admitted) <= allowed and refused > 0,
    )
    narrow = [o for o in evidence.outcomes if o.tenant == "narrow" and o.code == "rate_limit_exceeded"]
    limit = evidence.narrow_limit
    conc_row = Row(
        "3b concurrency tenant within max_concurrency",
        f"at most {evidence.narrow_max_live} live slots seen; {len(narrow)} refused",
        f"<= {limit} live slots, some refused",
        evidence.narrow_max_live <= limit and len(narrow) > 0,
    )
    return [rpm_row, conc_row]


def check_slots(evidence: Evidence) -> Row:
    return Row(
        "4 no leaked concurrency slots",
        f"{evidence.live_slots} live leases ({evidence.expired_slots} expired, not yet swept)",
        "0 live, a lease after the last kill",
        evidence.live_slots == 0,
    )


def check_explained(evidence: Evidence, seen: list[Failure]) -> tuple[Row, list[Failure]]:
    unexplained = [f for f in seen if not explained(f, evidence.faults)]
    causes = Counter(f.cause for f in seen)
    summary = ", ".join(f"{cause} {n}" for cause, n in causes.most_common()) or "none"
    row = Row(
        "5 every 5xx / failure explained by a fault",
        f"{len(seen) - len(unexplained)} of {len(seen)} explained ({summary})",
        "all, within a fault window + its grace",
        not unexplained,
    )
    return row, unexplained


def check_tasks(evidence: Evidence) -> Row:
    statuses = Counter(info.status if info is not None else "lost" for info in evidence.tasks.values())
    done = {task_id for task_id, info in evidence.tasks.items() if info is not None and info.status == "done"}
    without_effect = len(done - evidence.effect_keys)
    settled = sum(statuses[s] for s in TERMINAL_OK)
    value = (
        f"{settled} of {len(evidence.tasks)} done or dead ({dict(statuses)}); effects applied "
        f"{evidence.effect_applications} for {len(evidence.effect_keys)} tasks in {evidence.effect_runs} "
        f"runs; {without_effect} done without; {evidence.enqueue_failures} enqueues failed"
    )
    ok = (
        settled == len(evidence.tasks)
        and without_effect == 0
        and evidence.effect_applications == len(evidence.effect_keys)
        and evidence.enqueue_failures == 0
        and len(evidence.tasks) > 0
    )
    return Row("6 every task done or dead, effects once", value, "all; applied == tasks with effect", ok)


def check_memory(evidence: Evidence) -> Row:
    parts, ok = [], bool(evidence.rss)
    for name, before, after in evidence.rss:
        if before is None or after is None:
            parts.append(f"{name} {'gone' if after is None else 'restarted'}")
            ok = False
            continue
        parts.append(
            f"{name} {before / 1024:.1f}->{after / 1024:.1f} MiB ({100 * (after / before - 1):+.1f}%)"
        )
        ok = ok and after <= RSS_FACTOR * before
    return Row("7 worker RSS bounded", "; ".join(parts), f"<= {RSS_FACTOR}x after warm-up", ok)


def check_recovery(evidence: Evidence) -> Row:
    kinds = Counter(f.kind for f in evidence.faults)
    return Row(
        "0 every fault injected and recovered",
        f"{len(evidence.faults)} faults ({', '.join(f'{k} {n}' for k, n in kinds.most_common())}); "
        f"{len(evidence.chaos_errors)} did not recover",
        "all recovered",
        not evidence.chaos_errors and bool(evidence.faults),
    )


def run_checks(evidence: Evidence) -> tuple[list[Row], list[Failure]]:
    seen = failures(evidence)
    explained_row, unexplained = check_explained(evidence, seen)
    rows = [
        check_recovery(evidence),
        check_accounting(evidence, seen),
        *check_budget(evidence),
        *check_rates(evidence),
        check_slots(evidence),
        explained_row,
        check_tasks(evidence),
        check_memory(evidence),
    ]
    return rows, unexplained


def table(rows: list[Row], value_width: int = 60, bound_width: int = 36) -> str:
    """The rows as a plain-text table (check, value, bound, ok), long cells wrapped."""
    header = Row("check", "value", "bound", True)
    check_width = max(len(r.check) for r in [header, *rows])
    widths = [check_width, value_width, bound_width, 5]
    lines = []
    for i, row in enumerate([header, *rows]):
        ok = "ok" if i == 0 else ("true" if row.ok else "FALSE")
        columns = [[row.check], _wrap(row.value, value_width), _wrap(row.bound, bound_width), [ok]]
        for n in range(max(len(c) for c in columns)):
            cells = [(c[n] if n < len(c) else "").ljust(w) for c, w in zip(columns, widths, strict=True)]
            lines.append("  ".join(cells).rstrip())
        lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines[:-1])


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False) or [""]
