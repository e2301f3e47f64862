"""The soak's queue task: one model call through the gateway, then one idempotent side effect.

``python -m loadtest.soak`` runs ``modelgate worker loadtest.soak_handlers:handlers`` processes
and SIGKILLs them at random, so a task may be cut anywhere: in the model call, between the call
and the side effect, inside the side effect, or after it. The side effect is a Redis script that
sets ``soak:effect:<task id>`` only if it is not set yet (``SET NX``) and, in the same atomic step,
counts the application in ``soak:effects``; every run of the step is counted per task in the hash
``soak:effect_runs``. At the end the soak checks that each done task applied its effect exactly
once (``soak:effects`` equals the number of effect keys), however often the step ran.

The worker process finds Redis in ``SOAK_REDIS_URL`` and the model in ``SOAK_MODEL``.
"""

from __future__ import annotations

import os
from typing import Any

from openai.types.chat import ChatCompletion
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from client.context import TaskContext

EFFECT_KEY = "soak:effect:{}"
EFFECTS = "soak:effects"
EFFECT_RUNS = "soak:effect_runs"
_APPLY = """
redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
if redis.call('SET', KEYS[1], ARGV[2], 'NX') then
  redis.call('INCR', KEYS[2])
  return 1
end
return 0
"""

_redis: Redis | None = None


def _client() -> Redis:
    global _redis  # noqa: PLW0603 -- one connection pool per worker process, made on first use
    if _redis is None:
        # One retry on a fresh connection: a pooled one may have died with a Redis restart.
        _redis = Redis.from_url(
            os.environ["SOAK_REDIS_URL"], decode_responses=True, retry=Retry(NoBackoff(), 1)
        )
    return _redis


async def _apply_effect(task_id: str, attempt: int) -> bool:
    """Apply the task's effect once; whether this run applied it (``False``: already applied)."""
    keys = [EFFECT_KEY.format(task_id), EFFECTS, EFFECT_RUNS]
    applied = await _client().eval(_APPLY, len(keys), *keys, task_id, str(attempt))
    return bool(applied)


async def ask(ctx: TaskContext, payload: Any) -> dict[str, Any]:
    reply = await ctx.step(
        "ask",
        lambda: ctx.model.chat.completions.create(
            model=os.environ.get("SOAK_MODEL", "mock"),
            messages=[{"role": "user", "content": payload["prompt"]}],
            max_tokens=payload["max_tokens"],
        ),
        returns=ChatCompletion,
    )
    applied = await ctx.step(
        "effect", lambda: _apply_effect(ctx.task_id, ctx.attempt), side_effect=True, idempotent=True
    )
    tokens = reply.usage.total_tokens if reply.usage else 0
    return {"tokens": tokens, "applied_here": applied}


handlers = {"ask": ask}
