"""OpenTelemetry traces: a server span per request, children for admission, attempts and settlement.

Tracing is off unless a tracer provider is configured: by the standard ``OTEL_*`` variables when
``modelgate serve`` starts (:func:`configure_from_env`), or by a program that embeds the app and
sets the global provider itself. Off, no span is created anywhere: each hook is one ``None`` check.

The client's W3C ``traceparent``/``tracestate`` make the request's server span a child of the
caller's span. Each upstream attempt is a client span, and its own context is what the upstream
receives, so the upstream's spans hang under the attempt that called it.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Awaitable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from gateway.errors import UpstreamFailure

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from gateway.record import RequestRecord

T = TypeVar("T")
log = logging.getLogger("modelgate.tracing")

SCOPE_NAME = "modelgate"
DEFAULT_SERVICE_NAME = "modelgate"
FLUSH_TIMEOUT_MS = 5000
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
_OTLP_MODULES = {
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
}

_tracer: Tracer | None = None
_provider: trace.TracerProvider | None = None


def use_provider(provider: trace.TracerProvider | None = None) -> bool:
    """Trace with ``provider``, else with the global provider if one is set; otherwise turn tracing off."""
    global _tracer, _provider  # per process, like OpenTelemetry's own provider
    provider = provider or trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        _tracer, _provider = None, None
    else:
        _tracer, _provider = provider.get_tracer(SCOPE_NAME), provider
    return _tracer is not None


def enabled() -> bool:
    return _tracer is not None


def current_span() -> Span | None:
    """The span of the code running now, when tracing is on and it records.

    A request the sampler left out gets no child spans at all (under the usual parent-based
    sampler they would not record either), and its upstream calls carry the client's trace
    context as given.
    """
    if _tracer is None:
        return None
    span = trace.get_current_span()
    return span if span.is_recording() else None


def start_server_span(method: str, route: str, path: str, headers: Iterable[tuple[bytes, bytes]]) -> Span:
    """The span of one HTTP request, a child of the caller's span when it sent a trace context."""
    assert _tracer is not None
    carrier = {name.decode(): value.decode("latin-1") for name, value in headers if name in _TRACE_HEADERS}
    parent = _PROPAGATOR.extract(carrier) if carrier else None
    attributes = {"http.request.method": method, "http.route": route, "url.path": path}
    return _tracer.start_span(
        f"{method} {route}", context=parent, kind=SpanKind.SERVER, attributes=attributes
    )


def end_server_span(span: Span, status: int | None) -> None:
    if status is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
    span.end()


def start_attempt(parent: Span, target: str, number: int) -> Span:
    """The client span of one upstream attempt."""
    assert _tracer is not None
    attributes: dict[str, AttributeValue] = {"modelgate.target": target, "modelgate.attempt": number}
    context = trace.set_span_in_context(parent)
    return _tracer.start_span(
        "upstream attempt", context=context, kind=SpanKind.CLIENT, attributes=attributes
    )


def headers_for(span: Span) -> dict[str, str]:
    """The W3C trace context headers that make a call a child of ``span``."""
    headers: dict[str, str] = {}
    _PROPAGATOR.inject(headers, trace.set_span_in_context(span))
    return headers


def end_attempt(span: Span, outcome: str, failure: UpstreamFailure | None) -> None:
    span.set_attribute("modelgate.outcome", outcome)
    status = 200 if outcome == "ok" else getattr(failure, "upstream_status", None)
    if isinstance(status, int):
        span.set_attribute("http.response.status_code", status)
    if outcome != "ok":
        span.set_attribute("error.type", failure.code if failure is not None else outcome)
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def annotate(span: Span, record: RequestRecord) -> str:
    """Put what the request did on its span; returns its trace id for the log line."""
    attributes: dict[str, AttributeValue] = {
        "modelgate.request_id": record.request_id,
        "modelgate.attempts": record.attempts,
        "modelgate.status": record.status,
    }
    optional = {
        "modelgate.tenant": record.tenant,
        "gen_ai.request.model": record.model,
        "modelgate.target": record.target,
        "modelgate.task_id": record.task_id,
        "error.type": record.error_code,
    }
    attributes.update({k: v for k, v in optional.items() if v is not None})
    if record.usage is not None:
        attributes["gen_ai.usage.input_tokens"] = record.usage.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = record.usage.completion_tokens
    span.set_attributes(attributes)
    return format(span.get_span_context().trace_id, "032x")


async def traced(name: str, work: Awaitable[T]) -> T:
    """Await ``work`` inside a span named ``name``, a child of the current span if that records."""
    if _tracer is None or not trace.get_current_span().is_recording():
        return await work
    with _tracer.start_as_current_span(name):
        return await work


def flush() -> None:
    """Export the spans still buffered (at shutdown: worker processes may not run exit hooks)."""
    force_flush = getattr(_provider, "force_flush", None)
    if force_flush is not None:
        force_flush(FLUSH_TIMEOUT_MS)


def configure_from_env(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Install a tracer provider when the ``OTEL_*`` variables ask for an exporter; their names.

    ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, ``none``; comma-separated) decides; unset, it
    is ``otlp`` when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set, else none.
    The sampler, batching, endpoint and headers follow the SDK's own ``OTEL_*`` variables.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    exporters = {
        name: exporter for name in _exporter_names(environ) if (exporter := _exporter(name, environ))
    }
    if not exporters:
        return []
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters.values():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing on", extra={"fields": {"exporters": sorted(exporters)}})
    return sorted(exporters)


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    names = environ.get("OTEL_TRACES_EXPORTER")
    if names is None:
        endpoints = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if any(environ.get(name) for name in endpoints) else []
    return [n.strip().lower() for n in names.split(",") if n.strip() and n.strip().lower() != "none"]


def _exporter(name: str, environ: Mapping[str, str]) -> SpanExporter | None:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        log.warning("unknown trace exporter ignored", extra={"fields": {"exporter": name}})
        return None
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    module_name = _OTLP_MODULES.get(protocol.strip().lower(), _OTLP_MODULES["http/protobuf"])
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        message = "tracing off: OTLP export needs the otlp extra (pip install 'modelgate[otlp]')"
        log.warning(message, extra={"fields": {"module": module_name}})
        return None
    exporter: SpanExporter = module.OTLPSpanExporter()
    return exporter
