"""The admission policy (``policies/limiter.py``) on the in-process store, with a hand-driven clock.

What is checked here is the policy on top of the store: which checks a request gets, what it
reserves, the headers and refusals it produces, how it settles (once), and the per-process
fallback when Redis is away. The store arithmetic itself is covered by ``test_store_contract``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import pytest

from gateway.config import BreakerConfig
from gateway.errors import GatewayError, RateLimited, StateUnavailable, render
from gateway.tenants import Tenant
from policies.admission import AdmissionRequest, Decision, SettleOp
from policies.breakers import Breakers
from policies.keys import Keys
from policies.limiter import Limiter, Limits, Ticket
from policies.memory_store import MemoryStore
from policies.redis_pipe import RedisPipe
from policies.redis_store import RedisStore
from policies.routing import Target
from providers.base import Provider
from tests.harness import free_port

KEYS = Keys("unit")
RATE_HEADERS = {
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
}


class Clock:
    """Milliseconds that move only when told to."""

    def __init__(self) -> None:
        self.ms = 1_000_000.0

    def __call__(self) -> float:
        return self.ms

    def advance(self, seconds: float) -> None:
        self.ms += seconds * 1000


def tenant(
    name: str = "acme", *, rpm: int | None = None, tpm: int | None = None, max_concurrency: int | None = None
) -> Tenant:
    return Tenant(name=name, models=None, rpm=rpm, tpm=tpm, max_concurrency=max_concurrency)


def target(provider: str, model: str = "m") -> Target:
    return Target(f"{provider}/{model}", provider, model, 1.0, cast(Provider, None))


def limiter(
    store: Any,
    providers: dict[str, Limits] | None = None,
    *,
    share: float | None = None,
    lease_ms: int = 15_000,
) -> Limiter:
    breakers = Breakers(KEYS, BreakerConfig(), probe_ttl_s=35)
    return Limiter(store, KEYS, providers or {}, 4096, breakers, fallback_share=share, lease_ms=lease_ms)


def level(store: MemoryStore, key: str) -> float:
    return store.buckets[key][0]


def live_slots(store: MemoryStore, key: str) -> int:
    return len(store._live_slots(key, store._clock()))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> MemoryStore:
    return MemoryStore(clock=clock, lease_ms=1000)


async def refused(
    lim: Limiter, who: Tenant, targets: Sequence[Target] = (), reserve: int = 10
) -> RateLimited:
    with pytest.raises(RateLimited) as caught:
        await lim.admit(who, list(targets) or [target("up")], reserve, "refused")
    return caught.value


# --- reservation and settlement ----------------------------------------------------------------


async def test_reserves_one_request_and_the_token_estimate_from_tenant_and_provider(
    store: MemoryStore,
) -> None:
    lim = limiter(store, {"p": Limits(rpm=100, tpm=50_000, max_concurrency=5)})
    ticket = await lim.admit(tenant(rpm=60, tpm=1000, max_concurrency=3), [target("p")], 300, "s1")
    assert ticket.reserved_tokens == 300
    assert level(store, KEYS.tenant("acme", "rpm")) == 59
    assert level(store, KEYS.tenant("acme", "tpm")) == 700
    assert level(store, KEYS.provider("p", "rpm")) == 99
    assert level(store, KEYS.provider("p", "tpm")) == 49_700
    assert live_slots(store, KEYS.tenant("acme", "conc")) == 1
    assert live_slots(store, KEYS.provider("p", "conc")) == 1


async def test_a_refused_request_takes_nothing(store: MemoryStore) -> None:
    lim = limiter(store)
    who = tenant(rpm=1, tpm=1000, max_concurrency=5)
    await lim.admit(who, [target("up")], 300, "s1")
    await refused(lim, who, reserve=300)
    assert level(store, KEYS.tenant("acme", "tpm")) == 700
    assert live_slots(store, KEYS.tenant("acme", "conc")) == 1


@pytest.mark.parametrize(("used", "left"), [(120, 880), (300, 700), (450, 550), (0, 1000)])
async def test_settles_tokens_to_actual_usage(store: MemoryStore, used: int, left: int) -> None:
    lim = limiter(store, {"p": Limits(tpm=5000)})
    ticket = await lim.admit(tenant(tpm=1000), [target("p")], 300, "s1")
    await lim.settle(ticket, used, upstream_answered=True)
    assert level(store, KEYS.tenant("acme", "tpm")) == left
    assert level(store, KEYS.provider("p", "tpm")) == 5000 - used


async def test_settlement_frees_the_slots(store: MemoryStore) -> None:
    lim = limiter(store, {"p": Limits(max_concurrency=1)})
    who = tenant(max_concurrency=1)
    ticket = await lim.admit(who, [target("p")], 10, "s1")
    assert "concurrency" in str(await refused(lim, who, [target("p")]))
    await lim.settle(ticket, 0, upstream_answered=True)
    assert live_slots(store, KEYS.tenant("acme", "conc")) == 0
    assert live_slots(store, KEYS.provider("p", "conc")) == 0
    await lim.admit(who, [target("p")], 10, "s2")


async def test_settling_twice_changes_nothing(store: MemoryStore) -> None:
    lim = limiter(store)
    who = tenant(tpm=1000, max_concurrency=2)
    ticket = await lim.admit(who, [target("up")], 300, "s1")
    other = await lim.admit(who, [target("up")], 100, "s2")
    await lim.settle(ticket, 50, upstream_answered=True)
    after_first = level(store, KEYS.tenant("acme", "tpm"))
    await lim.settle(ticket, 50, upstream_answered=True)
    await lim.settle(ticket, 0, upstream_answered=False)
    assert ticket.settled
    assert level(store, KEYS.tenant("acme", "tpm")) == after_first == 1000 - 50 - 100
    assert live_slots(store, KEYS.tenant("acme", "conc")) == 1, "the other request's slot stays"
    await lim.settle(other, 100, upstream_answered=True)
    assert live_slots(store, KEYS.tenant("acme", "conc")) == 0


async def test_settling_the_same_ticket_concurrently_applies_once(store: MemoryStore) -> None:
    lim = limiter(store)
    ticket = await lim.admit(tenant(tpm=1000), [target("up")], 300, "s1")
    await asyncio.gather(*(lim.settle(ticket, 10, upstream_answered=True) for _ in range(5)))
    assert level(store, KEYS.tenant("acme", "tpm")) == 990


async def test_a_retry_elsewhere_refunds_the_first_provider_and_charges_the_last(store: MemoryStore) -> None:
    lim = limiter(store, {"p1": Limits(tpm=5000), "p2": Limits(tpm=5000)})
    ticket = await lim.admit(tenant(), [target("p1"), target("p2")], 300, "s1")
    assert level(store, KEYS.provider("p1", "tpm")) == 4700
    assert await lim.admit_next(ticket, [target("p2")]) == 0
    assert level(store, KEYS.provider("p2", "tpm")) == 4700
    await lim.settle(ticket, 120, upstream_answered=True)
    assert level(store, KEYS.provider("p1", "tpm")) == 5000
    assert level(store, KEYS.provider("p2", "tpm")) == 4880


# --- headers -------------------------------------------------------------------------------


async def test_headers_report_the_tenant_buckets_in_openai_formats(store: MemoryStore) -> None:
    lim = limiter(store)
    ticket = await lim.admit(tenant(rpm=600, tpm=100_000), [target("up")], 1000, "s1")
    assert ticket.headers == {
        "x-ratelimit-limit-requests": "600",
        "x-ratelimit-remaining-requests": "599",
        "x-ratelimit-reset-requests": "100ms",  # one request back at 10 a second
        "x-ratelimit-limit-tokens": "100000",
        "x-ratelimit-remaining-tokens": "99000",
        "x-ratelimit-reset-tokens": "600ms",  # 1000 tokens back at 100000/60 a second
    }


async def test_reset_counts_until_the_bucket_is_full_again(store: MemoryStore, clock: Clock) -> None:
    lim = limiter(store)
    who = tenant(rpm=2, tpm=120)
    first = await lim.admit(who, [target("up")], 60, "s1")
    assert first.headers["x-ratelimit-reset-requests"] == "30s"
    assert first.headers["x-ratelimit-reset-tokens"] == "30s"
    second = await lim.admit(who, [target("up")], 60, "s2")
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert second.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert second.headers["x-ratelimit-reset-tokens"] == "1m0s"
    clock.advance(15)  # 30 tokens back; one more reserved leaves 29 of 120, 91 to refill at 2 a second
    third = await lim.admit(tenant(tpm=120), [target("up")], 1, "s3")
    assert third.headers["x-ratelimit-reset-tokens"] == "45.5s"


async def test_remaining_decreases_request_by_request(store: MemoryStore) -> None:
    lim = limiter(store)
    who = tenant(rpm=10, tpm=1000)
    tickets = [await lim.admit(who, [target("up")], 30, f"s{i}") for i in range(5)]
    assert [t.headers["x-ratelimit-remaining-requests"] for t in tickets] == ["9", "8", "7", "6", "5"]
    assert [t.headers["x-ratelimit-remaining-tokens"] for t in tickets] == ["970", "940", "910", "880", "850"]


async def test_only_the_limits_a_tenant_has_get_headers(store: MemoryStore) -> None:
    lim = limiter(store, {"p": Limits(rpm=5)})
    only_rpm = await lim.admit(tenant("a", rpm=5), [target("p")], 10, "s1")
    assert set(only_rpm.headers) == {f"x-ratelimit-{w}-requests" for w in ("limit", "remaining", "reset")}
    none = await lim.admit(tenant("b", max_concurrency=3), [target("p")], 10, "s2")
    assert none.headers == {}, "provider buckets are not the tenant's"


# --- refusals ------------------------------------------------------------------------------


async def test_rpm_refusal_says_so_and_when_to_retry(store: MemoryStore) -> None:
    lim = limiter(store)
    who = tenant(rpm=60)
    for i in range(60):  # a whole minute may burst
        await lim.admit(who, [target("up")], 10, f"s{i}")
    error = await refused(lim, who)
    assert error.reason == "rpm"
    assert "rpm" in error.message and "60" in error.message
    assert error.headers["retry-after"] == "1"
    assert error.headers["retry-after-ms"] == "1000"
    status, body, headers = render(error)
    assert status == 429
    assert b'"code":"rate_limit_exceeded"' in body
    assert headers["x-should-retry"] == "false"


async def test_tpm_refusal_waits_for_the_missing_tokens(store: MemoryStore) -> None:
    lim = limiter(store)
    who = tenant(tpm=6000)  # 100 tokens a second
    await lim.admit(who, [target("up")], 5900, "s1")
    error = await refused(lim, who, reserve=250)
    assert error.reason == "tpm"
    assert "tpm" in error.message
    assert error.headers["retry-after-ms"] == "1500"  # 150 tokens missing
    assert error.headers["retry-after"] == "2"


async def test_concurrency_refusal_waits_for_the_earliest_lease(store: MemoryStore, clock: Clock) -> None:
    lim = limiter(store)
    who = tenant(max_concurrency=2)
    await lim.admit(who, [target("up")], 10, "s1")
    clock.advance(0.4)
    await lim.admit(who, [target("up")], 10, "s2")
    error = await refused(lim, who)
    assert error.reason == "concurrency"
    assert "max_concurrency of 2" in error.message
    assert error.headers["retry-after-ms"] == "600"  # the first lease (1 s) ends in 0.6 s
    assert error.headers["retry-after"] == "1"


async def test_a_full_provider_moves_to_the_next_target_then_refuses(store: MemoryStore) -> None:
    lim = limiter(store, {"p1": Limits(rpm=1), "p2": Limits(rpm=1)})
    targets = [target("p1"), target("p2")]
    first = await lim.admit(tenant(), targets, 10, "s1")
    second = await lim.admit(tenant(), targets, 10, "s2")
    assert (first.target_index, second.target_index) == (0, 1)
    error = await refused(lim, tenant(), targets)
    assert error.reason == "provider"
    assert error.headers["retry-after"] == "60"


async def test_a_tenant_refusal_comes_before_any_provider(store: MemoryStore) -> None:
    lim = limiter(store, {"p": Limits(rpm=1)})
    who = tenant(rpm=1)
    await lim.admit(who, [target("p")], 10, "s1")
    assert (await refused(lim, who, [target("p")])).reason == "rpm"


async def test_a_refusal_carries_the_rate_headers(store: MemoryStore) -> None:
    lim = limiter(store)
    who = tenant(rpm=1, tpm=1000)
    await lim.admit(who, [target("up")], 10, "s1")
    error = await refused(lim, who)
    assert set(error.headers) >= RATE_HEADERS, error.headers
    assert error.headers["x-ratelimit-remaining-requests"] == "0"


# --- leases --------------------------------------------------------------------------------


async def test_in_flight_slots_are_renewed_and_a_dead_holders_expire(clock: Clock) -> None:
    store = MemoryStore(clock=clock, lease_ms=1000)
    live = limiter(store, lease_ms=30)  # renews every 10 ms (real time), leases of 1 s (store clock)
    dead = limiter(store, lease_ms=30)  # never renews: its process "died"
    who_live, who_dead = tenant("live", max_concurrency=1), tenant("dead", max_concurrency=1)
    await live.admit(who_live, [target("up")], 10, "s1")
    await dead.admit(who_dead, [target("up")], 10, "s2")
    live.start()
    try:
        for _ in range(3):
            clock.advance(0.6)
            expiry = clock.ms + 1000
            deadline = time.monotonic() + 5
            while store.slots[KEYS.tenant("live", "conc")]["s1"] < expiry:
                assert time.monotonic() < deadline, "the lease was not renewed"
                await asyncio.sleep(0.005)
    finally:
        await live.stop()
    assert (await refused(live, who_live)).reason == "concurrency", "renewed past its first lease"
    await live.admit(who_dead, [target("up")], 10, "s3")  # the dead holder's slot expired


# --- Redis away ----------------------------------------------------------------------------


@pytest.fixture
async def unreachable_redis() -> AsyncIterator[RedisStore]:
    """A Redis store whose server is not there (a closed port)."""
    pipe = RedisPipe(f"redis://127.0.0.1:{free_port()}", connect_timeout_s=0.2, command_timeout_s=0.5)
    yield RedisStore(pipe)
    await pipe.aclose()


async def test_closed_without_redis_is_state_unavailable(unreachable_redis: RedisStore) -> None:
    lim = limiter(unreachable_redis)
    with pytest.raises(StateUnavailable) as caught:
        await lim.admit(tenant(rpm=10), [target("up")], 10, "s1")
    assert render(caught.value)[0] == 503
    assert not lim.health.ok


async def test_open_without_redis_admits_on_the_process_share(unreachable_redis: RedisStore) -> None:
    lim = limiter(unreachable_redis, {"p": Limits(rpm=4)}, share=0.5)
    who = tenant(rpm=4, tpm=1000, max_concurrency=4)
    tickets = [await lim.admit(who, [target("p")], 100, f"s{i}") for i in range(2)]
    assert tickets[0].headers["x-ratelimit-limit-requests"] == "2"
    assert tickets[0].headers["x-ratelimit-limit-tokens"] == "500"
    assert tickets[1].headers["x-ratelimit-remaining-tokens"] == "300"
    error = await refused(lim, who, [target("p")], reserve=100)
    assert error.reason == "rpm" and "limit of 2" in error.message
    assert not lim.health.ok
    # Settlement goes to the fallback that admitted it, never to the absent Redis.
    for ticket in tickets:
        assert isinstance(ticket.store, MemoryStore)
        await lim.settle(ticket, 40, upstream_answered=True)
    assert not lim._pending


@pytest.mark.parametrize(
    ("limits", "share", "admitted"),
    [
        (Limits(max_concurrency=4), 0.5, 2),
        (Limits(max_concurrency=5), 1 / 3, 1),
        (Limits(rpm=1), 0.25, 1),  # never below one
        (Limits(rpm=3), 1.0, 3),
    ],
)
async def test_fallback_scales_every_limit_down_to_the_share(
    unreachable_redis: RedisStore, limits: Limits, share: float, admitted: int
) -> None:
    lim = limiter(unreachable_redis, {"p": limits}, share=share)
    for i in range(admitted):
        await lim.admit(tenant(), [target("p")], 1, f"s{i}")
    assert (await refused(lim, tenant(), [target("p")], reserve=1)).reason == "provider"


async def test_a_retry_during_the_outage_meets_the_providers_share_too(unreachable_redis: RedisStore) -> None:
    lim = limiter(unreachable_redis, {"p2": Limits(rpm=2)}, share=0.5)
    targets = [target("p1"), target("p2")]  # p1 has no limits: every request is admitted there
    first = await lim.admit(tenant(), targets, 10, "s1")
    await lim.admit_next(first, [target("p2")])  # p2's share is 1 request a minute
    second = await lim.admit(tenant(), targets, 10, "s2")
    with pytest.raises(GatewayError):
        await lim.admit_next(second, [target("p2")])


class FlakyStore(MemoryStore):
    """A store that can be made unreachable, like Redis going away."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock=clock, lease_ms=1000)
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionRefusedError("store is down")

    async def admit(self, request: AdmissionRequest) -> Decision:
        self._check()
        return await super().admit(request)

    async def settle(self, slot: str, ops: Sequence[SettleOp]) -> list[str]:
        self._check()
        return await super().settle(slot, ops)

    async def renew(self, slots: Sequence[tuple[str, str]]) -> None:
        self._check()
        await super().renew(slots)


async def test_a_settlement_missed_while_the_store_is_away_is_replayed(clock: Clock) -> None:
    store = FlakyStore(clock)
    lim = limiter(store, lease_ms=30)
    ticket: Ticket = await lim.admit(tenant(tpm=1000, max_concurrency=1), [target("up")], 300, "s1")
    store.down = True
    await lim.settle(ticket, 100, upstream_answered=True)  # never raises
    assert not lim.health.ok
    assert level(store, KEYS.tenant("acme", "tpm")) == 700
    store.down = False
    lim.start()
    try:
        deadline = time.monotonic() + 5
        while level(store, KEYS.tenant("acme", "tpm")) != 900:
            assert time.monotonic() < deadline, "the settlement was not replayed"
            await asyncio.sleep(0.005)
    finally:
        await lim.stop()
    assert live_slots(store, KEYS.tenant("acme", "conc")) == 0
    assert lim.health.ok


async def test_health_stays_down_while_redis_is_away(unreachable_redis: RedisStore) -> None:
    lim = limiter(unreachable_redis, share=1.0, lease_ms=30)  # a renewer tick every 10 ms
    await lim.admit(tenant(rpm=5), [target("up")], 1, "s1")  # admitted by the fallback
    assert not lim.health.ok
    lim.start()
    try:
        watch_until = time.monotonic() + 0.2  # some twenty ticks
        while time.monotonic() < watch_until:
            assert not lim.health.ok, "Redis reported up while it is still unreachable"
            await asyncio.sleep(0.005)
    finally:
        await lim.stop()
