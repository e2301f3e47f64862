"""What one request did: the source of its response headers and of its one JSON log line."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from gateway.errors import GatewayError
from providers.base import Usage

log = logging.getLogger("modelgate.request")


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

    def headers(self) -> dict[str, str]:
        headers = {**self.rate_headers, "x-modelgate-attempts": str(self.attempts)}
        if self.target is not None:
            headers["x-modelgate-target"] = self.target
        return headers

    def failed(self, error: GatewayError, status: int) -> None:
        self.status = status
        self.error_code = error.code

    def first_byte(self) -> None:
        self.ttft_ms = round((time.perf_counter() - self.started) * 1000, 3)

    def emit(self) -> None:
        """Write the request's log line."""
        fields = {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "model": self.model,
            "target": self.target,
            "attempts": self.attempts,
            "status": self.status,
            "latency_ms": round((time.perf_counter() - self.started) * 1000, 3),
            "ttft_ms": self.ttft_ms,
            "prompt_tokens": self.usage.prompt_tokens if self.usage else None,
            "completion_tokens": self.usage.completion_tokens if self.usage else None,
            "usage_estimated": self.estimated,
            "task_id": self.task_id,
            "error": self.error_code,
        }
        log.info("request", extra={"fields": fields})
