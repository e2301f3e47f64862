"""The soak's judgement, without its processes: the mock's token tally and the checks' logic.

The soak itself (``python -m loadtest.soak``) needs about a minute even at ``--minutes 0.25``
(starting the fleet, draining the queue, letting a slot lease lapse), too long for the suite; these
tests pin what its verdicts rest on: what the mock upstream counts as served, which failures a
fault explains, and that the checks fail when they should.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from loadtest.mock_upstream import MockSettings, MockUpstream
from loadtest.mock_wire import OPENAI
from loadtest.soak_chaos import Fault
from loadtest.soak_checks import Evidence, Failure, explained, run_checks, table
from loadtest.soak_traffic import Outcome

CHAT: dict[str, Any] = {"model": "mock", "messages": [{"role": "user", "content": "hello there"}]}
PROMPT_TOKENS = 3 + 4 + 3  # priming, one message, 11 characters


@pytest.fixture
async def mock() -> AsyncIterator[tuple[MockUpstream, httpx.AsyncClient]]:
    app = MockUpstream(MockSettings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://mock") as client:
        yield app, client


async def test_the_mock_tallies_the_usage_of_whole_replies_and_streams(
    mock: tuple[MockUpstream, httpx.AsyncClient],
) -> None:
    _, client = mock
    await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
    await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    (await client.post("/_mock/config", json={"mode": "status", "status": 500})).raise_for_status()
    await client.post("/v1/chat/completions", json=CHAT)
    tokens = (await client.get("/_mock/stats")).json()["tokens"]
    assert tokens == {
        "replies": 2,
        "prompt_tokens": 2 * PROMPT_TOKENS,
        "completion_tokens": 5 + 12,
        "cut_streams": 0,
        "cut_prompt_tokens": 0,
        "cut_events": 0,
    }


def test_a_stalled_stream_counts_its_prompt_and_the_events_sent() -> None:
    app = MockUpstream(MockSettings())
    stream = OPENAI.reply(json.dumps({**CHAT, "stream": True}).encode(), 12)
    app.stats.served(MockSettings(mode="stall", stall_after=2), stream)
    app.stats.served(MockSettings(mode="stall", stall_after=0), stream)  # nothing sent: nothing used
    app.stats.served(MockSettings(mode="stall"), OPENAI.reply(json.dumps(CHAT).encode(), 12))  # not a stream
    assert dict(app.stats.tokens) == {"cut_streams": 1, "cut_prompt_tokens": PROMPT_TOKENS, "cut_events": 2}


def test_a_failure_is_explained_only_by_its_own_cause_on_its_own_instance() -> None:
    kill = Fault("gateway_kill", 100.0, 105.0, instance=1)
    redis = Fault("redis_restart", 200.0, 201.0)
    cut = Failure("x", "transport", 104.0, 104.1, instance=1)
    assert explained(cut, [kill])
    assert not explained(Failure("x", "transport", 104.0, 104.1, instance=0), [kill])
    assert not explained(Failure("x", "transport", 120.0, 120.1, instance=1), [kill]), "past the grace"
    assert explained(Failure("x", "state_unavailable", 203.0, 203.1, None), [redis])
    assert not explained(Failure("x", "upstream_unavailable", 200.5, 200.6, None), [redis, kill])
    assert not explained(Failure("x", "internal_error", 104.0, 104.1, 1), [kill, redis])


def _outcome(tenant: str, sent: float, status: int = 200, code: str | None = None, **kw: Any) -> Outcome:
    return Outcome(tenant, 0, False, sent, most_tokens=50, done=sent + 0.01, status=status, code=code, **kw)


def _evidence(outcomes: list[Outcome], **changes: Any) -> Evidence:
    fields: dict[str, Any] = {
        "outcomes": outcomes,
        "faults": [Fault("upstream_500", 0.0, 1.0)],
        "mock_tokens": dict.fromkeys(
            ("prompt_tokens", "completion_tokens", "cut_prompt_tokens", "cut_events", "cut_streams"), 0
        ),
        "usage": {"budgeted": {"usd": 0.5, "tokens": 0}},
        "budget_usd": 1.0,
        "budget_reserved_usd": 0.0,
        "limited_rpm": 30,
        "narrow_limit": 2,
        "narrow_max_live": 2,
        "live_slots": 0,
        "expired_slots": 0,
        "tasks": {},
        "task_most_tokens": {},
        "worker_instance": {},
        "effect_keys": set(),
        "effect_applications": 0,
        "effect_runs": 0,
        "enqueue_failures": 0,
        "rss": [("w", 1000, 1100)],
    }
    return Evidence(**{**fields, **changes})


def _verdicts(evidence: Evidence) -> dict[str, bool]:
    rows, _ = run_checks(evidence)
    assert table(rows).count("\n") >= len(rows)
    return {row.check.split()[0]: row.ok for row in rows}


def test_the_checks_catch_over_admission_over_spend_surplus_tokens_and_leaks() -> None:
    limited = [_outcome("limited", float(i)) for i in range(40)]  # 30 + 0.5/s x 39 s allows 49.5
    refusals = [
        _outcome("limited", 40.0, 429, "rate_limit_exceeded"),
        _outcome("budgeted", 1.0, 429, "insufficient_quota"),
        _outcome("narrow", 1.0, 429, "rate_limit_exceeded"),
    ]
    calm = _verdicts(_evidence([*limited, *refusals]))
    assert calm["3"] and calm["2"] and calm["2b"] and calm["3b"] and calm["4"] and calm["1"]
    assert not calm["6"], "no task enqueued: the queue check proved nothing"
    over = [_outcome("limited", i / 10) for i in range(60)]  # 60 in 6 s, bucket allows 33
    assert not _verdicts(_evidence([*over, *refusals]))["3"]
    surplus = {"budgeted": {"usd": 0.5, "tokens": 10}}
    assert not _verdicts(_evidence([*limited, *refusals], usage=surplus))["1"], "accounted more than served"
    assert not _verdicts(_evidence([*limited, *refusals], usage={"budgeted": {"usd": 1.01}}))["2"]
    assert not _verdicts(_evidence([*limited, *refusals], budget_reserved_usd=0.001))["2b"]
    assert not _verdicts(_evidence([*limited, *refusals], live_slots=1))["4"]
    assert not _verdicts(_evidence([*limited, *refusals], rss=[("w", 1000, 1300)]))["7"]
    unexplained = _outcome("steady", 50.0, 503, "upstream_unavailable")
    assert not _verdicts(_evidence([*limited, *refusals, unexplained]))["5"]
