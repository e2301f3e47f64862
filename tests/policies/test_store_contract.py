"""One contract, two stores: the Redis scripts and the in-process store must agree exactly.

Time passing is simulated by moving a bucket's last-update time into the past (both stores keep
it), so the arithmetic is tested without sleeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from policies.accounting import Charge, usage_ops
from policies.admission import (
    AdjustBucket,
    AdmissionRequest,
    BreakerCheck,
    BreakerSuccess,
    BucketCheck,
    BucketState,
    Expire,
    Increment,
    QuotaCheck,
    ReleaseReservation,
    ReleaseSlot,
    SetField,
    SlotCheck,
    reservation,
)
from policies.keys import Keys
from policies.memory_store import MemoryStore
from policies.redis_pipe import RedisPipe
from policies.redis_store import RedisStore
from tests.harness import RedisServer

Store = MemoryStore | RedisStore
Age = Callable[[str, float], Awaitable[None]]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis_server: RedisServer) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore(lease_ms=300)
        return
    client = aioredis.Redis.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    pipe = RedisPipe(redis_server.url, connect_timeout_s=1.0, command_timeout_s=1.0)
    yield RedisStore(pipe, lease_ms=300)
    await pipe.aclose()


@pytest.fixture
def age(store: Store) -> Age:
    async def move(key: str, ms: float) -> None:
        if isinstance(store, MemoryStore):
            store.age(key, ms)
        else:
            await store.pipe.call("HINCRBYFLOAT", key, "t", -ms)

    return move


def one(slot: str, *tenant: BucketCheck | SlotCheck | QuotaCheck, candidates: tuple = ()) -> AdmissionRequest:  # type: ignore[type-arg]
    return AdmissionRequest(slot=slot, tenant=tuple(tenant), candidates=candidates)


async def test_a_whole_minute_may_burst_then_waits_for_refill(store: Store) -> None:
    rpm = BucketCheck("k:rpm", 60, 1)
    results = [await store.admit(one(f"s{i}", rpm)) for i in range(61)]
    assert all(r.admitted for r in results[:60])
    refused = results[60]
    assert not refused.admitted and refused.failed == rpm
    assert refused.wait_s is not None and 0.5 < refused.wait_s <= 1.0  # real time passes in Redis


async def test_refill_is_continuous_and_capped(store: Store, age: Age) -> None:
    tpm = BucketCheck("k:tpm", 6000, 6000)
    assert (await store.admit(one("a", tpm))).admitted
    await age("k:tpm", 30_000)
    half = await store.admit(one("b", BucketCheck("k:tpm", 6000, 3000)))
    assert half.admitted and half.buckets[0].remaining == 0
    await age("k:tpm", 10 * 60_000)
    full = await store.admit(one("c", BucketCheck("k:tpm", 6000, 1)))
    assert full.buckets[0].remaining == 5999


async def test_report_gives_remaining_and_time_to_full(store: Store) -> None:
    decision = await store.admit(one("a", BucketCheck("k:rpm", 600, 1), BucketCheck("k:tpm", 1000, 250)))
    rpm, tpm = decision.buckets
    assert (rpm.limit, rpm.remaining, rpm.reset_s) == (600, 599, 0.1)
    assert (tpm.limit, tpm.remaining, tpm.reset_s) == (1000, 750, 15.0)


async def test_cost_over_capacity_is_clamped_to_a_full_bucket(store: Store) -> None:
    big = BucketCheck("k:tpm", 100, 5000)
    assert (await store.admit(one("a", big))).admitted
    second = await store.admit(one("b", big))
    assert not second.admitted and second.wait_s == pytest.approx(60.0, abs=0.01)


async def test_partial_admission_is_refused_whole(store: Store) -> None:
    rpm, tpm = BucketCheck("k:rpm", 10, 1), BucketCheck("k:tpm", 100, 80)
    assert (await store.admit(one("a", rpm, tpm))).admitted
    refused = await store.admit(one("b", rpm, tpm))
    assert not refused.admitted and refused.failed == tpm
    after = await store.admit(one("c", rpm, BucketCheck("k:tpm", 100, 1)))
    assert after.buckets[0].remaining == 8, "the refused request must not have taken from rpm"


async def test_first_provider_with_room_is_chosen(store: Store) -> None:
    tenant = BucketCheck("t:rpm", 100, 1)
    first, second = BucketCheck("p1:rpm", 1, 1), BucketCheck("p2:rpm", 10, 1)
    candidates = ((first,), (second,))
    assert (await store.admit(one("a", tenant, candidates=candidates))).candidate == 0
    assert (await store.admit(one("b", tenant, candidates=candidates))).candidate == 1
    unlimited = await store.admit(one("c", tenant, candidates=((first,), ())))
    assert unlimited.admitted and unlimited.candidate == 1


async def test_no_provider_with_room_refuses_and_takes_nothing(store: Store) -> None:
    tenant = BucketCheck("t:rpm", 100, 1)
    p1, p2 = BucketCheck("p1:rpm", 1, 1), BucketCheck("p2:rpm", 2, 1)
    await store.admit(one("a", tenant, candidates=((p1,),)))
    await store.admit(one("b", tenant, candidates=((p2,),)))
    await store.admit(one("c", tenant, candidates=((p2,),)))
    refused = await store.admit(one("d", tenant, candidates=((p1,), (p2,))))
    assert not refused.admitted and refused.candidate == -1 and refused.failed is None
    assert refused.wait_s == pytest.approx(30.0, abs=0.01), "the earliest provider refill: p2 in 30 s"
    check = await store.admit(one("e", tenant))
    assert check.buckets[0].remaining == 96


async def test_concurrency_slots_are_freed_by_settlement(store: Store) -> None:
    slots = SlotCheck("t:conc", 2)
    assert (await store.admit(one("a", slots))).admitted
    assert (await store.admit(one("b", slots))).admitted
    refused = await store.admit(one("c", slots))
    assert not refused.admitted and refused.failed == slots
    await store.settle("a", [ReleaseSlot("t:conc")])
    assert (await store.admit(one("c", slots))).admitted


async def test_an_unrenewed_slot_expires_after_its_lease(store: Store) -> None:
    slots = SlotCheck("t:conc", 1)
    assert (await store.admit(one("dead-worker", slots))).admitted
    assert not (await store.admit(one("x", slots))).admitted
    for _ in range(100):
        if (await store.admit(one("x", slots))).admitted:
            return
        await asyncio.sleep(0.05)
    pytest.fail("the slot lease never expired")


async def test_a_dead_workers_reservation_is_given_back_after_its_lease(store: Store) -> None:
    quota = QuotaCheck("t:usage", 10, 6, "usd", "usd_reserved")
    assert (await store.admit(one("dead-worker", quota))).admitted  # never settled
    assert not (await store.admit(one("x", quota))).admitted
    deadline = asyncio.get_running_loop().time() + 5
    while not (await store.admit(one("x", quota))).admitted:
        assert asyncio.get_running_loop().time() < deadline, "the reservation's lease never expired"
        await asyncio.sleep(0.05)
    assert float((await store.read("t:usage"))["usd_reserved"]) == 6  # x's own, not the dead one's
    # the dead worker's late settlement must not give its reservation back a second time
    await store.settle("dead-worker", [ReleaseReservation("t:usage", "usd_reserved", 6)])
    assert float((await store.read("t:usage"))["usd_reserved"]) == 6


async def test_renewal_keeps_a_reservation(store: Store) -> None:
    quota = QuotaCheck("t:usage", 10, 6, "usd", "usd_reserved")
    assert (await store.admit(one("live", quota))).admitted
    for _ in range(8):
        await asyncio.sleep(0.1)
        await store.renew([(quota.leases, reservation("live", "usd_reserved", 6))])
        assert not (await store.admit(one("other", quota))).admitted
    await store.settle("live", [ReleaseReservation("t:usage", "usd_reserved", 6)])
    assert float((await store.read("t:usage"))["usd_reserved"]) == 0
    assert (await store.admit(one("other", quota))).admitted


async def test_renewal_keeps_a_slot(store: Store) -> None:
    slots = SlotCheck("t:conc", 1)
    assert (await store.admit(one("live", slots))).admitted
    for _ in range(8):
        await asyncio.sleep(0.1)
        await store.renew([("t:conc", "live")])
        assert not (await store.admit(one("other", slots))).admitted


async def test_settlement_refunds_and_debits(store: Store) -> None:
    tpm = BucketCheck("t:tpm", 1000, 100)
    assert (await store.admit(one("a", tpm))).admitted
    await store.settle("a", [AdjustBucket("t:tpm", 1000, 30 - 100)])
    probe = await store.admit(one("b", BucketCheck("t:tpm", 1000, 0)))
    assert probe.buckets[0].remaining == 970
    await store.settle("b", [AdjustBucket("t:tpm", 1000, 1500)])
    refused = await store.admit(one("c", BucketCheck("t:tpm", 1000, 1)))
    assert not refused.admitted, "a debit past zero leaves the bucket in debt"
    assert refused.wait_s == pytest.approx((530 + 1) * 60 / 1000, abs=0.1)


async def test_quota_reserves_then_settles_to_actual(store: Store) -> None:
    quota = QuotaCheck("t:usage", 10, 4, "usd", "usd_reserved")
    assert (await store.admit(one("a", quota))).admitted
    assert (await store.admit(one("b", quota))).admitted
    refused = await store.admit(one("c", quota))
    assert not refused.admitted and refused.failed == quota and refused.wait_s is None
    await store.settle(
        "a", [ReleaseReservation("t:usage", "usd_reserved", 4), Increment("t:usage", (("usd", 1.5),))]
    )
    assert (await store.admit(one("c", quota))).admitted
    usage = await store.read("t:usage")
    assert float(usage["usd"]) == 1.5 and float(usage["usd_reserved"]) == 8


async def test_a_clock_that_jumps_back_refills_nothing(store: Store, age: Age) -> None:
    rpm = BucketCheck("k:rpm", 60, 60)
    assert (await store.admit(one("a", rpm))).admitted
    await age("k:rpm", -3_600_000)
    assert not (await store.admit(one("b", BucketCheck("k:rpm", 60, 1)))).admitted


async def test_usage_fields_add_up_and_first_seen_sticks(store: Store) -> None:
    key = "t:task:1"
    for value in ("100", "200"):
        await store.settle(
            "s",
            [
                Increment(key, (("prompt_tokens", 7), ("usd", 0.25))),
                SetField(key, "first_seen", value, only_if_missing=True),
                SetField(key, "last_seen", value),
            ],
        )
    usage = await store.read(key)
    assert usage == {"prompt_tokens": "14", "usd": "0.5", "first_seen": "100", "last_seen": "200"}
    assert await store.read("missing") == {}


async def test_the_same_amounts_reach_every_period_hash(store: Store) -> None:
    fields = (("requests", 1), ("tokens", 30), ("usd", 0.125))
    keys = ["t:usage:d", "t:usage:m", "t:usage:total"]
    await store.settle("s", [Increment(key, fields) for key in keys])
    await store.settle("s2", [Increment(keys[0], (("tokens", 5), ("usd", 0.5)))])
    assert [await store.read(key) for key in keys] == [
        {"requests": "1", "tokens": "35", "usd": "0.625"},
        {"requests": "1", "tokens": "30", "usd": "0.125"},
        {"requests": "1", "tokens": "30", "usd": "0.125"},
    ]


async def test_a_charge_reaches_the_period_hashes_and_only_day_and_month_expire(store: Store) -> None:
    keys = Keys("acct")
    charge = Charge("t1", "gpt", None, 18, 12, 0.5, estimated=False)
    ops = usage_ops(keys, charge)
    assert [type(op) for op in ops] == [Increment] * 3 + [Expire] * 2  # adjacent increments: one row
    await store.settle("s", ops)
    await store.settle("s2", usage_ops(keys, charge))
    hashes = [op.key for op in ops[:3]]
    expected = {"requests": "2", "prompt_tokens": "36", "completion_tokens": "24", "tokens": "60", "usd": "1"}
    assert [await store.read(key) for key in hashes] == [expected] * 3
    if isinstance(store, RedisStore):
        ttls = [await store.pipe.call("TTL", key) for key in hashes]
        assert ttls[0] > 0 and ttls[1] > ttls[0] and ttls[2] == -1  # the total never expires


async def test_integer_fields_written_as_floats_before_still_add_up(store: Store) -> None:
    # settle_v3 added every field with HINCRBYFLOAT; Redis stored whole numbers without a point,
    # which the integer increments of settle_v4 accept.
    if isinstance(store, RedisStore):
        await store.pipe.call("HINCRBYFLOAT", "t:usage:old", "tokens", 30.0)
    else:
        store.hashes["t:usage:old"] = {"tokens": "30"}
    await store.settle("s", [Increment("t:usage:old", (("tokens", 12),))])
    assert await store.read("t:usage:old") == {"tokens": "42"}


@pytest.fixture
def age_field(store: Store) -> Callable[[str, str, float], Awaitable[None]]:
    async def move(key: str, field: str, ms: float) -> None:
        if isinstance(store, MemoryStore):
            fields = store.hashes[key]
            fields[field] = repr(float(fields[field]) - ms)
        else:
            await store.pipe.call("HINCRBYFLOAT", key, field, -ms)

    return move


BREAKER = BreakerCheck("b:up/m", reset_ms=30_000, probes=1, probe_ttl_ms=60_000)


async def test_breaker_opens_at_the_threshold_and_refuses_until_reset(store: Store) -> None:
    for expected in (1, 2):
        state = await store.breaker_failure(BREAKER.key, 3)
        assert (state.state, state.failures, state.transition) == (0, expected, "")
    opened = await store.breaker_failure(BREAKER.key, 3)
    assert (opened.state, opened.transition) == (2, "open")
    refused = await store.admit(one("a", candidates=((BREAKER,),)))
    assert not refused.admitted and refused.only_breakers
    assert refused.wait_s is not None and 29 < refused.wait_s <= 30
    again = await store.breaker_failure(BREAKER.key, 3)
    assert again.transition == "" and again.state == 2


async def test_half_open_lets_exactly_the_probes_through_then_closes(
    store: Store, age_field: Callable
) -> None:  # type: ignore[type-arg]
    for _ in range(2):
        await store.breaker_failure(BREAKER.key, 2)
    await age_field(BREAKER.key, "o", 30_001)
    probe = await store.admit(one("p1", candidates=((BREAKER,),)))
    assert probe.admitted and probe.probe == "half_open"
    second = await store.admit(one("p2", candidates=((BREAKER,),)))
    assert not second.admitted, "half_open_max_calls = 1: one probe at a time"
    closed = await store.settle("p1", [BreakerSuccess(BREAKER.key)])
    assert closed == [BREAKER.key]
    after = await store.admit(one("p3", candidates=((BREAKER,),)))
    assert after.admitted and after.probe == ""


async def test_a_failed_probe_opens_the_breaker_again(store: Store, age_field: Callable) -> None:  # type: ignore[type-arg]
    await store.breaker_failure(BREAKER.key, 1)
    await age_field(BREAKER.key, "o", 30_001)
    assert (await store.admit(one("p1", candidates=((BREAKER,),)))).probe == "half_open"
    reopened = await store.breaker_failure(BREAKER.key, 5)
    assert (reopened.state, reopened.transition) == (2, "open")
    assert not (await store.admit(one("p2", candidates=((BREAKER,),)))).admitted


async def test_a_probe_whose_worker_died_is_forgotten(store: Store, age_field: Callable) -> None:  # type: ignore[type-arg]
    await store.breaker_failure(BREAKER.key, 1)
    await age_field(BREAKER.key, "o", 30_001)
    assert (await store.admit(one("lost", candidates=((BREAKER,),)))).admitted
    assert not (await store.admit(one("p2", candidates=((BREAKER,),)))).admitted
    await age_field(BREAKER.key, "h", 60_001)
    retried = await store.admit(one("p3", candidates=((BREAKER,),)))
    assert retried.admitted and retried.probe == "probe"


async def test_success_forgets_failures_and_reset_closes(store: Store) -> None:
    await store.breaker_failure(BREAKER.key, 3)
    await store.breaker_failure(BREAKER.key, 3)
    assert await store.settle("s", [BreakerSuccess(BREAKER.key)]) == []
    assert (await store.breaker_failure(BREAKER.key, 3)).failures == 1
    for _ in range(2):
        await store.breaker_failure(BREAKER.key, 3)
    reset = await store.breaker_reset(BREAKER.key)
    assert (reset.state, reset.transition) == (0, "closed")
    assert (await store.admit(one("x", candidates=((BREAKER,),)))).admitted


async def test_an_open_breaker_moves_the_request_to_the_next_target(store: Store) -> None:
    other = BreakerCheck("b:backup/m", 30_000, 1, 60_000)
    await store.breaker_failure(BREAKER.key, 1)
    decision = await store.admit(one("x", candidates=((BREAKER,), (other,))))
    assert decision.admitted and decision.candidate == 1
    limited = BucketCheck("p:rpm", 1, 1)
    await store.admit(one("y", candidates=((limited,),)))
    mixed = await store.admit(one("z", candidates=((BREAKER,), (limited,))))
    assert not mixed.admitted and not mixed.only_breakers


async def test_peek_reports_levels_and_takes_nothing(store: Store, age: Age) -> None:
    rpm, tpm = BucketCheck("k:rpm", 600, 1), BucketCheck("k:tpm", 1000, 400, tokens=True)
    assert await store.peek([rpm, tpm]) == (BucketState(600, 600, 0.0), BucketState(1000, 1000, 0.0))
    assert (await store.admit(one("a", rpm, tpm))).admitted
    await age("k:tpm", 6_000)
    first = await store.peek([rpm, tpm])
    second = await store.peek([rpm, tpm])
    assert first[0].remaining == second[0].remaining == 599
    assert 700 <= first[1].remaining <= second[1].remaining <= 702
