"""Circuit breakers per upstream target, shared by every worker through the admission store.

The state machine is pybreaker's (closed → open after ``failure_threshold`` consecutive failures →
half-open after ``reset_timeout_s`` → closed on a successful probe, open again on a failed one),
but pybreaker itself is not used: its storage interface is synchronous and its Redis storage reads
and writes in separate commands, which races when many workers fail at once. Here each step is
atomic in the store: admission checks the breaker (and takes a half-open probe) in the same script
that admits the request, a success is folded into settlement, and a failure is one script call.

Only transport errors, timeouts, 5xx, 408 and unusable answers count as failures
(``UpstreamFailure.breaker_failure``); client 4xx and upstream 429 (rate limiting, not breakage)
do not, and a probe that ends with one of them counts as a success: the upstream answered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.config import BreakerConfig
from policies.admission import AdmissionStore, BreakerCheck, BreakerState, BreakerSuccess
from policies.keys import Keys

log = logging.getLogger("modelgate.breaker")

STATE_NAMES = {0: "closed", 1: "half_open", 2: "open"}

Listener = Callable[[str, str], None]
"""Called with (target, new state) on every transition this process makes."""


@dataclass(frozen=True, slots=True)
class BreakerView:
    """One target's breaker as ``/admin/breakers`` shows it."""

    target: str
    state: str
    failures: int
    opened_at: float | None
    retry_at: float | None


class Breakers:
    """Builds breaker checks and records outcomes for every target."""

    def __init__(self, keys: Keys, config: BreakerConfig, probe_ttl_s: float) -> None:
        self._keys = keys
        self._threshold = config.failure_threshold
        self._reset_ms = int(config.reset_timeout_s * 1000)
        self._probes = config.half_open_max_calls
        self._probe_ttl_ms = int(probe_ttl_s * 1000)
        self.listeners: list[Listener] = []

    def key(self, target: str) -> str:
        return self._keys.breaker(target)

    def check(self, target: str) -> BreakerCheck:
        return BreakerCheck(self.key(target), self._reset_ms, self._probes, self._probe_ttl_ms)

    def success(self, target: str) -> BreakerSuccess:
        return BreakerSuccess(self.key(target))

    async def failure(self, store: AdmissionStore, target: str) -> BreakerState:
        state = await store.breaker_failure(self.key(target), self._threshold)
        self.transitioned(target, state.transition)
        return state

    async def reset(self, store: AdmissionStore, target: str) -> BreakerState:
        state = await store.breaker_reset(self.key(target))
        self.transitioned(target, state.transition)
        return state

    def transitioned(self, target: str, state: str) -> None:
        """Log and announce a transition this process made (``state`` empty: none)."""
        if not state:
            return
        log.warning("breaker transition", extra={"fields": {"target": target, "state": state}})
        for listener in self.listeners:
            listener(target, state)

    async def views(self, store: AdmissionStore, targets: Sequence[str]) -> list[BreakerView]:
        """Every target's breaker, read from the store (opened_at and retry_at as epoch seconds)."""
        views = []
        for target in targets:
            fields = await store.read(self.key(target))
            views.append(self._view(target, fields))
        return views

    def _view(self, target: str, fields: dict[str, str]) -> BreakerView:
        state = int(fields.get("s", 0))
        opened = float(fields["o"]) / 1000 if "o" in fields and state else None
        retry = opened + self._reset_ms / 1000 if opened is not None and state == 2 else None
        return BreakerView(target, STATE_NAMES[state], int(fields.get("f", 0)), opened, retry)
