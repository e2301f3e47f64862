"""The operational routes in process: ``/metrics`` (one process, access), ``/readyz`` while draining,
and tracing configured from the environment (in a child process: it sets the global provider)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient

from gateway import metrics, shutdown
from gateway.app import create_app
from gateway.config import Config, ModelConfig, ProviderConfig, ServerConfig, TargetConfig, TenantConfig
from gateway.secret import Secret, key_hash
from tests.ops.dashboard import worker_exposition
from tests.ops.promtext import GATEWAY_METRICS, Scrape

KEY = "unit-test-key-ops-0123456789"
ADMIN = "unit-test-admin-key-0123456789"
BODY = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def config(**server: object) -> Config:
    return Config(
        server=ServerConfig(admin_key=Secret(ADMIN), **server),  # type: ignore[arg-type]
        providers=[ProviderConfig(name="local", type="mock")],
        models=[ModelConfig(name="mock", targets=[TargetConfig(provider="local", model="mock")])],
        tenants=[TenantConfig(name="t", keys=[Secret(f"sha256:{key_hash(KEY)}")])],
    )


async def test_one_process_metrics_follow_the_contract_without_created_series() -> None:
    async with AsyncTestClient(create_app(config())) as client:
        assert (await client.post("/v1/chat/completions", json=BODY, headers=_auth(KEY))).status_code == 200
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    scrape = Scrape(response.text)
    assert "_created" not in response.text
    exercised = {
        "modelgate_requests_total",
        "modelgate_request_duration_seconds",
        "modelgate_tokens_total",
        "modelgate_cost_usd_total",
        "modelgate_upstream_requests_total",
        "modelgate_upstream_duration_seconds",
        "modelgate_time_to_first_token_seconds",
        "modelgate_breaker_state",
        "modelgate_inflight_requests",
    }
    scrape.check_contract(exercised & GATEWAY_METRICS)
    assert scrape.value("modelgate_breaker_state", target="local/mock") == 0


async def test_private_metrics_need_the_admin_key() -> None:
    async with AsyncTestClient(create_app(config(metrics_public=False))) as client:
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers=_auth(KEY))).status_code == 401
        response = await client.get("/metrics", headers=_auth(ADMIN))
    assert response.status_code == 200
    assert "modelgate_inflight_requests" in response.text


async def test_readyz_is_503_once_shutdown_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    async with AsyncTestClient(create_app(config())) as client:
        assert (await client.get("/readyz")).status_code == 200
        monkeypatch.setattr(shutdown, "draining", lambda: True)
        response = await client.get("/readyz")
        assert (response.status_code, response.json()) == (
            503,
            {"status": "unavailable", "reason": "shutting down"},
        )
        assert (await client.get("/healthz")).status_code == 200


def test_queue_workers_count_tasks_under_the_contract_name_and_labels() -> None:
    scrape = Scrape(worker_exposition())
    scrape.check_contract({"modelgate_tasks_total"})
    assert (scrape.value("modelgate_tasks_total", queue="research", status="done") or 0) >= 1


def test_dead_workers_leave_the_inflight_sum(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    live, gone = (
        tmp_path / f"gauge_livesum_{os.getpid()}.db",
        tmp_path / f"gauge_livesum_{dead.stdout.strip()}.db",
    )
    live.write_bytes(b"")
    gone.write_bytes(b"")
    metrics._forget_dead_workers(tmp_path)
    assert live.exists() and not gone.exists()


def test_console_exporter_from_the_environment_prints_the_request_span(tmp_path: Path) -> None:
    script = (
        "import asyncio, sys\n"
        "from litestar.testing import AsyncTestClient\n"
        "from gateway import tracing\n"
        "from gateway.app import create_app\n"
        "from tests.ops.test_ops_routes import BODY, KEY, config, _auth\n"
        "assert tracing.configure_from_env() == ['console']\n"
        "async def main():\n"
        "    async with AsyncTestClient(create_app(config())) as client:\n"
        "        await client.post('/v1/chat/completions', json=BODY, headers=_auth(KEY))\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "gw-test"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    spans = [json.loads(chunk) for chunk in _json_objects(result.stdout)]
    names = {span["name"] for span in spans}
    assert {"POST /v1/chat/completions", "admission", "upstream attempt", "settlement"} <= names
    assert {span["resource"]["attributes"]["service.name"] for span in spans} == {"gw-test"}


def test_no_otel_variables_means_no_tracer_provider() -> None:
    from gateway import tracing

    assert tracing.configure_from_env({}) == []
    assert tracing.configure_from_env({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert tracing.configure_from_env({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}) == []


def test_an_otlp_endpoint_without_the_exporter_package_leaves_tracing_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gateway import tracing

    try:
        importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    except ImportError:
        pass
    else:
        pytest.skip("the otlp extra is installed")
    assert tracing.configure_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}) == []
    assert "modelgate[otlp]" in caplog.text


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _json_objects(text: str) -> list[str]:
    """The console exporter's output: pretty-printed JSON objects, one after another."""
    objects, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "{":
            depth, start = depth + 1, i if depth == 0 else start
        elif char == "}":
            depth -= 1
            if depth == 0:
                objects.append(text[start : i + 1])
    return objects
