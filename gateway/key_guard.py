"""Slows key guessing: an address that sends too many unknown keys is refused for a while.

Failed lookups are counted per client address in a moving window (the ``limits`` library's
in-memory strategy); an address over the limit gets 429 for every key, right or wrong, until the
window lets it through again. The guard is per process: enough to make guessing slow, with no
cost on the happy path (a valid key is one dict lookup here, nothing else).
"""

from __future__ import annotations

import time

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import MovingWindowRateLimiter

from gateway.errors import RateLimited

FAILURES_PER_MINUTE = 30
MAX_BLOCKED = 10_000


class KeyGuard:
    """Counts failed key lookups per address and refuses addresses over the limit."""

    def __init__(self, failures_per_minute: int = FAILURES_PER_MINUTE) -> None:
        self._limit = RateLimitItemPerMinute(failures_per_minute)
        self._window = MovingWindowRateLimiter(MemoryStorage())
        self._blocked: dict[str, float] = {}

    def check(self, address: str) -> None:
        """Raise 429 while ``address`` is blocked."""
        until = self._blocked.get(address)
        if until is None:
            return
        wait = until - time.monotonic()
        if wait <= 0:
            del self._blocked[address]
            return
        seconds = max(1, int(wait + 0.999))
        raise RateLimited(
            "too many invalid API keys from this address; slow down",
            reason="auth",
            headers={"retry-after": str(seconds), "retry-after-ms": str(int(wait * 1000))},
        )

    async def failed(self, address: str) -> None:
        """Count one failed lookup; block the address (and raise 429) once it is over the limit."""
        if await self._window.hit(self._limit, address):
            return
        stats = await self._window.get_window_stats(self._limit, address)
        if len(self._blocked) >= MAX_BLOCKED:
            now = time.monotonic()
            self._blocked = {a: t for a, t in self._blocked.items() if t > now}
        self._blocked[address] = time.monotonic() + max(1.0, stats.reset_time - time.time())
        self.check(address)
