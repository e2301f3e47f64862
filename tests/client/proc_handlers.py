"""Handlers for worker processes started by the tests (``tests.client.proc_handlers:handlers``).

``chaos`` does some work, then bumps a counter through an idempotent side-effect step: the bump is
deduplicated by the step's idempotency key, so the counter counts tasks, while ``runs`` counts every
execution of the step (re-runs after a crash included).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from redis.asyncio import Redis

from client import TaskContext

BUMP = """
if redis.call('SET', KEYS[1], '1', 'NX') then redis.call('INCR', KEYS[2]) end
redis.call('INCR', KEYS[3])
return 1
"""
_redis: list[Redis] = []


def _client() -> Redis:
    if not _redis:
        _redis.append(Redis.from_url(os.environ["MG_TEST_REDIS"], decode_responses=True))
    return _redis[0]


async def _work(n: int, seconds: float) -> int:
    await asyncio.sleep(seconds)
    return n * 2


async def _bump(prefix: str, key: str, seconds: float) -> bool:
    await _client().eval(BUMP, 3, f"{prefix}:seen:{key}", f"{prefix}:count", f"{prefix}:runs")  # type: ignore[misc]
    await asyncio.sleep(seconds)  # a crash here leaves the effect done but not checkpointed
    return True


async def chaos(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, int]:
    n = payload["n"]
    doubled = await ctx.step("work", lambda: _work(n, payload["sleep"]))
    await ctx.step(
        "effect",
        lambda: _bump(payload["counter"], ctx.idempotency_key("effect"), payload["sleep"]),
        side_effect=True,
        idempotent=True,
    )
    return {"n": n, "doubled": doubled}


async def slow(ctx: TaskContext, payload: dict[str, Any]) -> str:
    await ctx.step("sleep", lambda: asyncio.sleep(payload["seconds"]))
    return "slept"


handlers = {"chaos": chaos, "slow": slow}
