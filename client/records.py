"""The task record as callers see it: the Redis hash decoded into a typed, JSON-ready struct.

Scripts store times as Redis milliseconds and lists as JSON text; :class:`TaskInfo` turns those into
epoch seconds and Python values, so ``modelgate tasks show`` and ``Queue.get`` agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec


class Attempt(msgspec.Struct, frozen=True, omit_defaults=True):
    """How one attempt ended (``outcome`` is the status it left, or ``lease_expired``)."""

    attempt: int
    worker: str
    started: float
    ended: float
    outcome: str
    error: str | None = None


class TaskInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One task. ``usage`` sums the model usage carried by checkpointed step outputs."""

    id: str
    queue: str
    kind: str
    status: str
    tenant: str | None
    payload: Any
    attempt: int
    max_attempts: int
    step: str | None
    steps_done: list[str]
    result: Any
    error: str | None
    usage: dict[str, int]
    history: list[Attempt]
    created: float
    updated: float
    started: float | None
    finished: float | None
    due: float | None
    worker: str | None
    lease_until: float | None
    cancel_requested: bool
    idempotency_key: str | None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = msgspec.to_builtins(self)
        return data


def _seconds(raw: str | None) -> float | None:
    return int(raw) / 1000 if raw else None


def _json(raw: str | None) -> Any:
    return msgspec.json.decode(raw) if raw else None


def _history(raw: str | None) -> list[Attempt]:
    items = _json(raw) or []
    return [
        Attempt(**{**item, "started": item["started"] / 1000, "ended": item["ended"] / 1000})
        for item in (items if isinstance(items, list) else [])
    ]


def _usage(fields: Mapping[str, str]) -> dict[str, int]:
    names = ("requests", "prompt_tokens", "completion_tokens")
    return {name: int(fields.get(f"usage_{name}") or 0) for name in names}


def task_info(queue: str, fields: Mapping[str, str]) -> TaskInfo:
    """Decode a task hash (as returned by HGETALL with ``decode_responses``)."""
    return TaskInfo(
        id=fields["id"],
        queue=queue,
        kind=fields["kind"],
        status=fields["status"],
        tenant=fields.get("tenant") or None,
        payload=_json(fields.get("payload")),
        attempt=int(fields.get("attempt") or 0),
        max_attempts=int(fields.get("max_attempts") or 0),
        step=fields.get("step") or None,
        steps_done=_json(fields.get("steps_done")) or [],
        result=_json(fields.get("result")),
        error=fields.get("error") or None,
        usage=_usage(fields),
        history=_history(fields.get("history")),
        created=_seconds(fields.get("created")) or 0.0,
        updated=_seconds(fields.get("updated")) or 0.0,
        started=_seconds(fields.get("started")),
        finished=_seconds(fields.get("finished")),
        due=_seconds(fields.get("due")),
        worker=fields.get("worker") or None,
        lease_until=_seconds(fields.get("lease_until")),
        cancel_requested=fields.get("cancel") == "1",
        idempotency_key=fields.get("idempotency_key") or None,
    )


def pairs(flat: list[str]) -> dict[str, str]:
    """``[k1, v1, k2, v2, ...]`` (a script's HGETALL) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))
