"""``/metrics`` of a real two-worker instance: exact totals across workers, every metric of the contract."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import TENANT_KEY, gateway_config
from tests.harness import Gateway, MockUpstream, RedisServer, wait_for
from tests.ops.dashboard import DASHBOARD, check_dashboard, worker_exposition
from tests.ops.promtext import GATEWAY_METRICS, Scrape, family_name, scrape

TIGHT_KEY = "tenant-key-tight-0123456789"
MESSAGES = [{"role": "user", "content": "Say hello"}]
EXTRA = f"""
[[models]]
name = "fallback"
input_usd_per_mtok = 1.0
output_usd_per_mtok = 2.0
targets = [{{ provider = "up", model = "flaky" }}, {{ provider = "local", model = "mock" }}]

[[tenants]]
name = "tight"
keys = ["{TIGHT_KEY}"]
rpm = 1
"""


@pytest.fixture(scope="module")
def two_workers(
    session_tmp: Path, mock_upstream_process: MockUpstream, redis_server: RedisServer
) -> Iterator[Gateway]:
    config = gateway_config(
        mock_upstream_process.url,
        retry={"attempts": 2, "base_delay_ms": 0, "max_delay_ms": 0},
        breaker={"failure_threshold": 1, "reset_timeout_s": 120},
    )
    prefix = f"ops{redis_server.port}"
    process = Gateway(
        session_tmp, config + EXTRA + f'\n[redis]\nurl = "{redis_server.url}"\nprefix = "{prefix}"\n', 2
    )
    process.start()
    yield process
    assert process.stop() == 0


def chat(url: str, model: str = "mock", key: str = TENANT_KEY, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


async def _many(url: str, count: int, concurrency: int = 10) -> list[int]:
    statuses: list[int] = []

    async def worker(n: int) -> None:
        # One client per worker coroutine: separate connections, so both processes get requests.
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for _ in range(n):
                response = await client.post(
                    "/v1/chat/completions",
                    json={"model": "mock", "messages": MESSAGES},
                    headers={"authorization": f"Bearer {TENANT_KEY}"},
                )
                statuses.append(response.status_code)

    await asyncio.gather(*(worker(count // concurrency) for _ in range(concurrency)))
    return statuses


def test_requests_total_sums_over_workers_exactly(two_workers: Gateway, upstream: MockUpstream) -> None:
    before = scrape(two_workers.url)  # 0 on a fresh instance; other tests may have run first
    statuses = asyncio.run(_many(two_workers.url, 200))
    assert statuses == [200] * 200
    # Several scrapes on fresh connections land on either worker; each must see all 200.
    for _ in range(8):
        result = scrape(two_workers.url)
        assert result.total("modelgate_requests_total") - before.total("modelgate_requests_total") == 200
        completion = result.total("modelgate_tokens_total", type="completion")
        assert completion - before.total("modelgate_tokens_total", type="completion") == 200 * 12


def _traffic(url: str, upstream: MockUpstream) -> None:
    """One of everything the metrics count."""
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={"model": "mock", "messages": MESSAGES, "stream": True},
        headers={"authorization": f"Bearer {TENANT_KEY}"},
    ) as response:  # fmt: skip
        assert response.status_code == 200
        assert list(response.iter_lines())[-2:] == ["data: [DONE]", ""]
    assert chat(url, key=TIGHT_KEY).status_code == 200
    limited = chat(url, key=TIGHT_KEY)
    assert (limited.status_code, limited.json()["error"]["code"]) == (429, "rate_limit_exceeded")
    upstream.configure(mode="status", status=500)
    retried = chat(url, "fallback")  # up/flaky fails once (its breaker opens), local/mock serves
    assert (retried.status_code, retried.headers["x-modelgate-attempts"]) == (200, "2")
    failed = chat(url, "gpt-4o-mini")  # fails and opens up/gpt-4o-mini's breaker
    assert failed.status_code == 503
    refused = chat(url, "gpt-4o-mini")  # refused at admission: the breaker is open
    assert (refused.status_code, refused.headers["x-modelgate-attempts"]) == (503, "0")
    assert chat(url, "no-such-model").status_code == 404
    upstream.reset()


@pytest.fixture(scope="module")
def exercised(two_workers: Gateway, mock_upstream_process: MockUpstream) -> Scrape:
    """The scrape after one of everything (once per module: the tight tenant's minute is used up)."""
    before = scrape(two_workers.url).total("modelgate_requests_total")
    mock_upstream_process.reset()
    _traffic(two_workers.url, mock_upstream_process)

    def settled() -> bool:
        return scrape(two_workers.url).total("modelgate_requests_total") == before + 7

    wait_for(settled, 10, "every request to be counted")
    return scrape(two_workers.url)


def test_every_metric_appears_with_the_contract_label_sets(exercised: Scrape) -> None:
    exercised.check_contract(GATEWAY_METRICS)
    assert set(exercised.families) == {family_name(name) for name in GATEWAY_METRICS}
    _check_values(exercised)


def _check_values(result: Scrape) -> None:
    assert result.value("modelgate_requests_total", tenant="tight", model="mock", status="429") == 1
    assert result.value("modelgate_requests_total", tenant="acme", model="unknown", status="404") == 1
    assert result.value("modelgate_rate_limited_total", tenant="tight", reason="rpm") == 1
    assert result.value("modelgate_retries_total", target="up/flaky", reason="error") == 1
    assert result.value("modelgate_upstream_requests_total", target="up/flaky", outcome="error") == 1
    assert result.value("modelgate_upstream_requests_total", target="up/gpt-4o-mini", outcome="error") == 1
    assert (
        result.value("modelgate_upstream_requests_total", target="up/gpt-4o-mini", outcome="breaker_open")
        == 1
    )
    assert result.value("modelgate_breaker_transitions_total", target="up/flaky", state="open") == 1
    assert result.value("modelgate_breaker_state", target="up/gpt-4o-mini") == 2
    assert result.value("modelgate_breaker_state", target="up/flaky") == 2
    assert result.value("modelgate_breaker_state", target="local/mock") == 0
    assert result.value("modelgate_time_to_first_token_seconds_count", target="local/mock") == 1
    assert (result.value("modelgate_cost_usd_total", tenant="acme", model="fallback") or 0) > 0
    assert result.value("modelgate_inflight_requests") == 0


def test_each_request_logs_one_json_line(two_workers: Gateway, upstream: MockUpstream) -> None:
    request_id = "ops-log-line-1"
    response = httpx.post(
        f"{two_workers.url}/v1/chat/completions",
        json={"model": "mock", "messages": MESSAGES},
        headers={"authorization": f"Bearer {TENANT_KEY}", "x-request-id": request_id, "x-task-id": "task-7"},
    )
    assert response.status_code == 200

    def logged() -> list[dict[str, object]]:
        entries = [json.loads(line) for line in two_workers.output().splitlines() if request_id in line]
        return [e for e in entries if e.get("msg") == "request"]

    wait_for(lambda: len(logged()) == 1, 10, "the request's log line")
    (entry,) = logged()
    fields = {
        "request_id", "tenant", "model", "target", "attempts", "status", "latency_ms", "ttft_ms",
        "prompt_tokens", "completion_tokens", "task_id", "error",
    }  # fmt: skip
    assert fields <= set(entry)
    assert entry["request_id"] == request_id
    assert (entry["tenant"], entry["model"], entry["target"]) == ("acme", "mock", "local/mock")
    assert (entry["attempts"], entry["status"], entry["task_id"], entry["error"]) == (1, 200, "task-7", None)
    assert entry["completion_tokens"] == 12
    assert TENANT_KEY not in two_workers.output()


def test_the_dashboard_queries_only_metrics_a_scrape_has(exercised: Scrape) -> None:
    worker = Scrape(worker_exposition())
    problems = check_dashboard(DASHBOARD, [exercised, worker])
    assert not problems, "\n".join(problems)
