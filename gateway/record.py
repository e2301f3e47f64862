"""What one request did: the source of its response headers, its metrics, spans and one JSON log line.

The record also times each upstream attempt: the chat flow says when one begins
(:meth:`RequestRecord.began`) and how it ended (:meth:`attempt_failed`, :meth:`attempt_succeeded`),
and the record turns that into the per-target metrics and the attempt's span.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from gateway import metrics, tracing
from gateway.errors import GatewayError, UpstreamFailure
from providers.base import Usage

log = logging.getLogger("modelgate.request")


@dataclass(slots=True)
class Attempt:
    """The upstream attempt under way."""

    target: str
    started: float
    span: Span | None


@dataclass(slots=True)
class RequestRecord:
    """Filled in as the request goes; emitted once when it ends."""

    request_id: str
    started: float = field(default_factory=time.perf_counter)
    tenant: str | None = None
    model: str | None = None
    task_id: str | None = None
    target: str | None = None
    attempts: int = 0
    status: int = 200
    error_code: str | None = None
    ttft_ms: float | None = None
    usage: Usage | None = None
    usd: float = 0.0
    estimated: bool = False
    rate_headers: dict[str, str] = field(default_factory=dict)
    failures: list[tuple[str, str]] = field(default_factory=list)
    """(target, error code) of each failed attempt, in order."""
    limit_reason: str | None = None
    """Which limit refused the request with 429 (``rpm``, ``budget``, ...)."""
    span: Span | None = field(default_factory=tracing.current_span)
    """The request's server span (None: tracing is off)."""
    attempt: Attempt | None = None
    retry_cause: tuple[str, str] | None = None
    """(target, outcome) of the failed attempt the next one retries."""
    emitted: bool = False

    def headers(self) -> dict[str, str]:
        headers = {**self.rate_headers, "x-modelgate-attempts": str(self.attempts)}
        if self.target is not None:
            headers["x-modelgate-target"] = self.target
        return headers

    def failed(self, error: GatewayError, status: int) -> None:
        self.status = status
        self.error_code = error.code
        self.limit_reason = getattr(error, "reason", None) if status == 429 else None
        if isinstance(error, UpstreamFailure):
            self._end_attempt(error.outcome, error)

    def began(self, target: str, trace: dict[str, str]) -> dict[str, str]:
        """Time (and trace) an upstream attempt at ``target``; returns the trace headers to send.

        ``trace`` is the client's W3C trace context; when the gateway traces, the upstream gets the
        attempt span's context instead, so the upstream's spans are its children.
        """
        self._end_attempt("error")
        if self.retry_cause is not None:
            metrics.retry(*self.retry_cause)
            self.retry_cause = None
        span = tracing.start_attempt(self.span, target, self.attempts) if self.span is not None else None
        self.attempt = Attempt(target, time.perf_counter(), span)
        return tracing.headers_for(span) if span is not None else trace

    def attempt_failed(self, target: str, failure: UpstreamFailure) -> None:
        self.failures.append((target, failure.code))
        self._end_attempt(failure.outcome, failure)

    def attempt_succeeded(self) -> None:
        """The attempt under way (if any) produced its answer."""
        self._end_attempt("ok")

    def first_byte(self) -> None:
        now = time.perf_counter()
        self.ttft_ms = round((now - self.started) * 1000, 3)
        if self.attempt is not None:
            metrics.first_token(self.attempt.target, now - self.attempt.started)

    def _end_attempt(self, outcome: str, failure: UpstreamFailure | None = None) -> None:
        attempt, self.attempt = self.attempt, None
        if attempt is None:
            return
        metrics.upstream_attempt(attempt.target, outcome, time.perf_counter() - attempt.started)
        if attempt.span is not None:
            tracing.end_attempt(attempt.span, outcome, failure)
        if outcome != "ok":
            self.retry_cause = (attempt.target, outcome)

    def emit(self) -> None:
        """Count the request in the metrics, finish its span's attributes and write its log line."""
        if self.emitted:
            return
        self.emitted = True
        self._end_attempt("ok" if self.status < 400 else "error")
        seconds = time.perf_counter() - self.started
        metrics.request_done(self, seconds)
        fields = {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "target": self.target,
            "attempts": self.attempts,
            "status": self.status,
            "latency_ms": round(seconds * 1000, 3),
            "ttft_ms": self.ttft_ms,
            "prompt_tokens": self.usage.prompt_tokens if self.usage else None,
            "completion_tokens": self.usage.completion_tokens if self.usage else None,
            "usage_estimated": self.estimated,
            "cost_usd": self.usd,
            "task_id": self.task_id,
            "error": self.error_code,
        }
        if self.span is not None:
            fields["trace_id"] = tracing.annotate(self.span, self)
        log.info("request", extra={"fields": fields})
