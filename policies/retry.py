"""The one retry layer: how many upstream attempts a request gets and how long to wait between them.

Attempts are counted across targets (``retry.attempts`` in all). A retry first goes to a target
not tried yet, at once; going back to a target already tried waits an exponential backoff with
full jitter (uniform in [0, min(max_delay, base_delay * 2^n)]), and at least the upstream's
``retry-after``. No wait may end past the request's deadline: then the last failure stands.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gateway.config import RetryConfig


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int
    base_delay_s: float
    max_delay_s: float

    @classmethod
    def from_config(cls, config: RetryConfig) -> RetryPolicy:
        return cls(config.attempts, config.base_delay_ms / 1000, config.max_delay_ms / 1000)

    def backoff(self, repeat: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait before going back to a tried target for the ``repeat``-th time (1, 2, ...)."""
        ceiling = min(self.max_delay_s, self.base_delay_s * 2 ** (repeat - 1))
        delay = random.uniform(0, ceiling)
        return max(delay, retry_after_s or 0.0)
