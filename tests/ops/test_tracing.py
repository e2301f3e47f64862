"""Spans of a request, collected in memory from the app in process, in front of a scripted upstream."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway import tracing
from gateway.app import create_app
from gateway.config import (
    Config,
    ModelConfig,
    ProviderConfig,
    RetryConfig,
    TargetConfig,
    TenantConfig,
)
from gateway.secret import Secret, key_hash
from tests.scripted_upstream import Reply, ScriptedUpstream

KEY = "unit-test-key-tracing-0123"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
COMPLETION = {
    "id": "c1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
HEADERS = {"authorization": f"Bearer {KEY}", "traceparent": TRACEPARENT}


def config(upstream_url: str = "http://127.0.0.1:9/v1") -> Config:
    return Config(
        retry=RetryConfig(attempts=2, base_delay_ms=0, max_delay_ms=0),
        providers=[
            ProviderConfig(
                name="up",
                type="openai",
                base_url=upstream_url,
                api_key=Secret("sk-upstream-x"),
                read_timeout_s=5.0,
            ),
            ProviderConfig(name="local", type="mock"),
        ],
        models=[
            ModelConfig(name="m", targets=[TargetConfig(provider="up", model="m")]),
            ModelConfig(name="mock", targets=[TargetConfig(provider="local", model="mock")]),
        ],
        tenants=[TenantConfig(name="t", keys=[Secret(f"sha256:{key_hash(KEY)}")])],
    )


@pytest.fixture
def upstream() -> Iterator[ScriptedUpstream]:
    """The upstream on its own loop in a thread: the test client runs the app behind a blocking portal,
    which blocks the test's own loop while a request is in flight."""
    with ScriptedUpstream() as server:
        yield server
    assert not server.errors, server.errors


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Spans of the app made in the test; tracing goes back to the (unset) global provider after."""
    yield InMemorySpanExporter()
    tracing.use_provider()


def traced_app(exporter: InMemorySpanExporter, upstream_url: str | None = None) -> Litestar:
    app = create_app(config() if upstream_url is None else config(upstream_url))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert tracing.use_provider(provider)
    return app


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return format(span.context.span_id, "016x")


async def test_retried_request_span_tree(
    exporter: InMemorySpanExporter, upstream: ScriptedUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.script(Reply(500, json={"error": {"message": "boom"}}), Reply(200, json=COMPLETION))
    app = traced_app(exporter, upstream.url + "/v1")
    caplog.set_level(logging.INFO, logger="modelgate.request")
    async with AsyncTestClient(app) as client:
        response = await client.post("/v1/chat/completions", json=BODY, headers=HEADERS)
    assert response.status_code == 200
    assert response.headers["x-modelgate-attempts"] == "2"

    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/chat/completions")
    assert server.kind is SpanKind.SERVER
    assert server.context is not None and format(server.context.trace_id, "032x") == CLIENT_TRACE
    assert server.parent is not None and format(server.parent.span_id, "016x") == CLIENT_SPAN
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["modelgate.attempts"] == 2
    assert server.attributes["modelgate.tenant"] == "t"
    assert server.attributes["gen_ai.usage.output_tokens"] == 1

    children = [s for s in spans if s.parent is not None and s.parent.span_id == server.context.span_id]
    assert [s.name for s in sorted(children, key=lambda s: s.start_time or 0)] == [
        "admission",
        "upstream attempt",
        "upstream attempt",
        "settlement",
    ]
    first, second = sorted(by_name(spans, "upstream attempt"), key=lambda s: s.start_time or 0)
    assert first.kind is SpanKind.CLIENT and second.kind is SpanKind.CLIENT
    assert dict(first.attributes or {}) == {
        "modelgate.target": "up/m",
        "modelgate.attempt": 1,
        "modelgate.outcome": "error",
        "error.type": "upstream_unavailable",
    }
    assert first.status.status_code is StatusCode.ERROR
    assert dict(second.attributes or {}) == {
        "modelgate.target": "up/m",
        "modelgate.attempt": 2,
        "modelgate.outcome": "ok",
        "http.response.status_code": 200,
    }
    # Each upstream call is a child of its attempt's span, in the client's trace.
    assert [(r.method, r.path) for r in upstream.requests] == [("POST", "/v1/chat/completions")] * 2
    sent = [request.headers["traceparent"] for request in upstream.requests]
    assert sent == [f"00-{CLIENT_TRACE}-{span_id(first)}-01", f"00-{CLIENT_TRACE}-{span_id(second)}-01"]
    (line,) = [r for r in caplog.records if r.getMessage() == "request"]
    assert line.fields["trace_id"] == CLIENT_TRACE  # type: ignore[attr-defined]


async def test_a_stream_attempt_lasts_until_the_stream_ends(exporter: InMemorySpanExporter) -> None:
    app = traced_app(exporter)
    async with AsyncTestClient(app) as client:
        response = await client.post(
            "/v1/chat/completions", json={**BODY, "model": "mock", "stream": True}, headers=HEADERS
        )
    assert response.text.endswith("data: [DONE]\n\n")
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/chat/completions")
    (attempt,) = by_name(spans, "upstream attempt")
    (settlement,) = by_name(spans, "settlement")
    assert (attempt.attributes or {})["modelgate.outcome"] == "ok"
    assert attempt.end_time is not None and settlement.start_time is not None and server.end_time is not None
    assert attempt.end_time <= settlement.start_time <= server.end_time


async def test_health_is_not_traced_and_an_error_is_on_the_server_span(
    exporter: InMemorySpanExporter,
) -> None:
    app = traced_app(exporter)
    async with AsyncTestClient(app) as client:
        response = await client.post("/v1/chat/completions", json={**BODY, "model": "nope"}, headers=HEADERS)
        assert response.status_code == 404
        assert (await client.get("/healthz")).status_code == 200
    (server,) = exporter.get_finished_spans()  # no admission (the model is unknown), no health span
    assert (server.attributes or {})["error.type"] == "model_not_found"
    assert (server.attributes or {})["http.response.status_code"] == 404


@pytest.mark.parametrize("sampled_out", [False, True], ids=["no-provider", "sampled-out"])
async def test_without_recording_no_span_is_made_and_the_trace_passes_through(
    exporter: InMemorySpanExporter, upstream: ScriptedUpstream, sampled_out: bool
) -> None:
    upstream.respond(200, json=COMPLETION)
    app = create_app(config(upstream.url + "/v1"))
    assert not tracing.enabled()
    if sampled_out:
        provider = TracerProvider(sampler=sampling.ALWAYS_OFF)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracing.use_provider(provider)
    async with AsyncTestClient(app) as client:
        response = await client.post("/v1/chat/completions", json=BODY, headers=HEADERS)
    assert response.status_code == 200
    assert len(upstream.requests) == 1
    assert upstream.last.headers["traceparent"] == TRACEPARENT
    assert "tracestate" not in upstream.last.headers
    assert exporter.get_finished_spans() == ()
