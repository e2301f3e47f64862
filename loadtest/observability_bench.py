"""What observability costs per request: the app driven in process over ASGI (no sockets), with the
built-in mock provider, so the gateway's own work is all that is timed.

    python -m loadtest.observability_bench [--requests 3000]

Modes: ``off`` (no tracer provider: the default), ``spans`` (an SDK provider with a batch
processor whose exporter drops everything: the cost of making spans), ``unsampled`` (the same
provider sampling nothing: non-recording spans, context still propagated) and ``asgi-instr``
(``spans`` plus opentelemetry-instrumentation-asgi around the app, when that package is importable).
Times are CPU time of this process, exporter thread included.
A second table times the metrics hooks alone, in one process and in multiprocess mode.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from litestar import Litestar

from gateway import tracing
from gateway.app import create_app
from gateway.config import Config, ModelConfig, ProviderConfig, TargetConfig, TenantConfig
from gateway.secret import Secret, key_hash

KEY = "bench-key-0123456789abcdef"
ROUNDS = 20
BODY = b'{"model":"mock","messages":[{"role":"user","content":"hello"}]}'
STREAM_BODY = b'{"model":"mock","messages":[{"role":"user","content":"hello"}],"stream":true}'


def bench_config() -> Config:
    return Config(
        providers=[ProviderConfig(name="local", type="mock")],
        models=[ModelConfig(name="mock", targets=[TargetConfig(provider="local", model="mock")])],
        tenants=[TenantConfig(name="bench", keys=[Secret(f"sha256:{key_hash(KEY)}")])],
    )


def chat_scope(body: bytes, key: str, extra: Sequence[tuple[bytes, bytes]] = ()) -> dict[str, Any]:
    """The ASGI scope of a ``POST /v1/chat/completions`` of ``body`` with ``key``, as a server
    would hand it to the app (for calling the app in process, without a server)."""
    headers = [
        (b"authorization", f"Bearer {key}".encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "state": {},
    }


async def _call(app: Any, body: bytes) -> int:
    """One request; like uvicorn, ``receive`` says the client left once the response is complete."""
    status = 0
    sent = False
    complete = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif not message.get("more_body", False):
            complete.set()

    trace = (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    await app(chat_scope(body, KEY, [(b"host", b"bench"), trace]), receive, send)
    return status


async def _round(app: Any, provider: Any, body: bytes, requests: int) -> float:
    """CPU microseconds per request: process time, so that a busy machine skews less and the span
    export thread counts too (flushed inside the round, so no mode pays for another's spans)."""
    start = time.process_time()
    for _ in range(requests):
        await _call(app, body)
    if provider is not None:
        provider.force_flush()
    return (time.process_time() - start) / requests * 1e6


async def _compare(apps: dict[str, tuple[Any, Any]], body: bytes, requests: int) -> dict[str, float]:
    """Median microseconds per request of each mode, rounds interleaved so drift hits all alike."""
    times: dict[str, list[float]] = {mode: [] for mode in apps}
    for app, provider in apps.values():
        tracing.use_provider(provider)
        await _round(app, provider, body, 200)
    for _ in range(ROUNDS):
        for mode, (app, provider) in apps.items():
            tracing.use_provider(provider)
            times[mode].append(await _round(app, provider, body, requests // ROUNDS))
    tracing.use_provider()
    return {mode: statistics.median(values) for mode, values in times.items()}


def _provider(sampled: bool = True) -> Any:
    from opentelemetry.sdk.trace import TracerProvider, sampling
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=sampling.ALWAYS_ON if sampled else sampling.ALWAYS_OFF)
    provider.add_span_processor(BatchSpanProcessor(Drop(), max_queue_size=65536))
    return provider


def _apps() -> dict[str, tuple[Any, Any]]:
    """Each mode's ASGI app and tracer provider (None: tracing off)."""
    app: Litestar = create_app(bench_config())
    apps: dict[str, tuple[Any, Any]] = {
        "off": (app, None),
        "spans": (app, _provider()),
        "unsampled": (app, _provider(sampled=False)),
    }
    try:
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware  # type: ignore[import-not-found]
    except ImportError:
        return apps
    apps["asgi-instr"] = (OpenTelemetryMiddleware(app, exclude_spans=["receive", "send"]), _provider())
    return apps


async def run_modes(requests: int) -> None:
    apps = _apps()
    whole = await _compare(apps, BODY, requests)
    stream = await _compare(apps, STREAM_BODY, requests)
    print(f"{'mode':<12}{'non-stream µs/req':>20}{'stream µs/req':>16}")
    for mode in apps:
        print(f"{mode:<12}{whole[mode]:>20.1f}{stream[mode]:>16.1f}")


_METRICS_HOOKS = """
import time
from gateway import metrics
from gateway.record import RequestRecord
from providers.base import Usage
n = {n}
start = time.process_time()
for _ in range(n):
    metrics.INFLIGHT.inc()
    record = RequestRecord("r", tenant="bench", model="mock", target="local/mock", attempts=1)
    record.usage = Usage(8, 12)
    metrics.upstream_attempt("local/mock", "ok", 0.001)
    metrics.first_token("local/mock", 0.0005)
    metrics.request_done(record, 0.002)
    metrics.INFLIGHT.dec()
print((time.process_time() - start) / n * 1e6)
"""


def run_metrics(requests: int) -> None:
    print(f"\n{'metrics hooks':<28}{'µs/req':>10}")
    for label, multiproc in (("one process", False), ("multiprocess (mmap files)", True)):
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        with tempfile.TemporaryDirectory() as directory:
            if multiproc:
                env["PROMETHEUS_MULTIPROC_DIR"] = directory
            out = subprocess.run(
                [sys.executable, "-c", _METRICS_HOOKS.format(n=requests * 10)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
        print(f"{label:<28}{float(out.stdout):>10.1f}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args(argv)
    asyncio.run(run_modes(args.requests))
    run_metrics(args.requests)


if __name__ == "__main__":
    main()
