"""The queue's Lua scripts, registered once per Redis client.

Every state change of a task is one script (one file per operation under ``client/lua/``), so each is
atomic and fenced where it must be. Each file is prefixed with the shared helpers of ``_lib.lua``;
every key a script touches is passed in ``KEYS`` (the eight status indexes first) and time comes from
Redis ``TIME``. ``register_script`` hashes a script once and runs it with EVALSHA, loading it into
Redis the first time (and again after a Redis restart).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

NAMES = (
    "enqueue",
    "claim",
    "heartbeat",
    "step_begin",
    "step_done",
    "step_abort",
    "complete",
    "fail",
    "promote",
    "cancel",
    "approve",
    "requeue",
    "release",
    "purge",
)


@cache
def source(name: str) -> str:
    """The full text of script ``name``: the helpers, then the operation."""
    lua = resources.files("client") / "lua"
    return (lua / "_lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


class Scripts:
    """The scripts bound to one Redis client."""

    def __init__(self, redis: Redis) -> None:
        self._scripts: dict[str, AsyncScript] = {name: redis.register_script(source(name)) for name in NAMES}

    async def __call__(self, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        return await self._scripts[name](keys=list(keys), args=list(args))
