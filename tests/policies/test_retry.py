"""RetryPolicy.backoff: exponential ceiling, full jitter, ``retry-after`` as a floor.

Every property of the distribution is checked on samples, with bounds so wide (many standard
deviations) that a correct policy fails them with negligible probability; no seeding needed.
"""

from __future__ import annotations

import statistics

import pytest

from gateway.config import RetryConfig
from policies.retry import RetryPolicy

SAMPLES = 5000


def samples(
    policy: RetryPolicy, repeat: int, retry_after: float | None = None, n: int = SAMPLES
) -> list[float]:
    return [policy.backoff(repeat, retry_after) for _ in range(n)]


def test_from_config_converts_milliseconds() -> None:
    policy = RetryPolicy.from_config(RetryConfig(attempts=4, base_delay_ms=250, max_delay_ms=3000))
    assert policy == RetryPolicy(attempts=4, base_delay_s=0.25, max_delay_s=3.0)


def test_config_defaults_are_the_contracts() -> None:
    assert RetryPolicy.from_config(RetryConfig()) == RetryPolicy(3, 0.2, 5.0)


@pytest.mark.parametrize(("repeat", "ceiling"), [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (12, 1.0)])
def test_delays_fill_zero_to_an_exponential_ceiling_capped_by_max_delay(repeat: int, ceiling: float) -> None:
    policy = RetryPolicy(attempts=20, base_delay_s=0.1, max_delay_s=1.0)
    drawn = samples(policy, repeat)
    assert all(0.0 <= d <= ceiling for d in drawn)
    # Full jitter: uniform on [0, ceiling], so both ends are reached and the mean is near the middle
    # (the standard error of the mean is ceiling / sqrt(12 * 5000) ~ 0.004 * ceiling).
    assert min(drawn) < 0.01 * ceiling
    assert max(drawn) > 0.99 * ceiling
    assert statistics.fmean(drawn) == pytest.approx(ceiling / 2, rel=0.05)
    assert statistics.pstdev(drawn) == pytest.approx(ceiling / 12**0.5, rel=0.05)


def test_delays_are_spread_evenly_over_the_range() -> None:
    """Each tenth of [0, ceiling] gets about a tenth of the draws (expected 500, sd ~21)."""
    policy = RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=5.0)
    counts = [0] * 10
    for delay in samples(policy, 1):
        counts[min(9, int(delay / 0.2 * 10))] += 1
    assert all(400 < c < 600 for c in counts), counts


def test_fifty_retries_are_jittered_not_all_equal() -> None:
    """The spread the end-to-end test measures, at unit level: 50 draws with base 50 ms."""
    policy = RetryPolicy(attempts=3, base_delay_s=0.05, max_delay_s=0.05)
    drawn = samples(policy, 1, n=50)
    assert len(set(drawn)) == 50
    assert min(drawn) < max(drawn) / 2
    assert statistics.pstdev(drawn) / statistics.fmean(drawn) > 0.2  # uniform: CV = 1/sqrt(3) ~ 0.58


def test_retry_after_is_a_floor_above_the_ceiling() -> None:
    policy = RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=5.0)
    assert samples(policy, 1, retry_after=1.0, n=200) == [1.0] * 200


def test_retry_after_is_a_floor_inside_the_range() -> None:
    """A retry-after below the ceiling lifts the short draws to it and keeps the longer ones."""
    policy = RetryPolicy(attempts=3, base_delay_s=1.0, max_delay_s=1.0)
    drawn = samples(policy, 1, retry_after=0.5)
    assert all(0.5 <= d <= 1.0 for d in drawn)
    at_floor = sum(d == 0.5 for d in drawn)
    assert 0.4 * SAMPLES < at_floor < 0.6 * SAMPLES
    assert max(drawn) > 0.99


def test_retry_after_is_not_capped_by_max_delay() -> None:
    """The upstream said when a retry can pass; waiting less would only earn another 429."""
    policy = RetryPolicy(attempts=3, base_delay_s=0.1, max_delay_s=0.5)
    assert policy.backoff(3, 2.0) == 2.0


@pytest.mark.parametrize("retry_after", [None, 0.0])
def test_no_or_zero_retry_after_leaves_the_jitter_alone(retry_after: float | None) -> None:
    policy = RetryPolicy(attempts=3, base_delay_s=0.1, max_delay_s=1.0)
    drawn = samples(policy, 1, retry_after)
    assert min(drawn) < 0.001
    assert statistics.fmean(drawn) == pytest.approx(0.05, rel=0.05)


def test_zero_base_delay_retries_at_once() -> None:
    policy = RetryPolicy.from_config(RetryConfig(attempts=3, base_delay_ms=0, max_delay_ms=5000))
    assert set(samples(policy, 1, n=100) + samples(policy, 5, n=100)) == {0.0}


def test_zero_max_delay_caps_everything_but_retry_after() -> None:
    policy = RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=0.0)
    assert set(samples(policy, 3, n=100)) == {0.0}
    assert policy.backoff(3, 0.3) == 0.3
