"""The gateway's errors, and the one place they become OpenAI error bodies.

Every failure a client can see is one of these classes. Each carries its HTTP status, OpenAI
error ``type`` and ``code``; :func:`render` turns any of them into the wire form
``{"error": {"message", "type", "param", "code"}}`` with ``x-should-retry: false``, because the
gateway owns retries and SDKs must not add a second layer.

    GatewayError
    ├── InvalidRequest          400 invalid_request
    │   ├── RequestTimedOut     408 request_timeout       (the client took too long to send it)
    │   └── HeadersTooLarge     431 headers_too_large
    ├── InvalidApiKey           401 invalid_api_key
    ├── ModelNotAllowed         403 model_not_allowed
    ├── ModelNotFound           404 model_not_found
    ├── RequestTooLarge         413 request_too_large
    ├── RateLimited             429 rate_limit_exceeded   (retry-after from the bucket)
    ├── QuotaExceeded           429 insufficient_quota
    ├── StateUnavailable        503 state_unavailable
    ├── NotFound                404 not_found             (no such route)
    ├── MethodNotAllowed        405 method_not_allowed
    └── UpstreamFailure         one failed upstream attempt, translated at the adapter edge
        ├── UpstreamError       502 upstream_error        (unusable answer, non-retryable error)
        ├── UpstreamUnavailable 503 upstream_unavailable  (connect errors, 5xx, 429, open breakers)
        ├── UpstreamTimeout     504 upstream_timeout
        └── UpstreamRejected    the upstream's own 4xx, passed back as it came

Upstream failures also say whether another attempt may help (``retryable``), whether they count
against the target's circuit breaker (``breaker_failure``) and which metric outcome they are.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

Outcome = Literal["ok", "error", "timeout", "rate_limited", "breaker_open"]


class ErrorBody(msgspec.Struct, omit_defaults=False):
    message: str
    type: str
    param: str | None
    code: str


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class GatewayError(Exception):
    """Base of every error the gateway answers with."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] = headers or {}

    def body(self) -> bytes:
        """The OpenAI error body for this error."""
        return _encode(ErrorEnvelope(ErrorBody(self.message, self.error_type, self.param, self.code)))


class InvalidRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class RequestTimedOut(InvalidRequest):
    status = 408
    code = "request_timeout"


class HeadersTooLarge(InvalidRequest):
    status = 431
    code = "headers_too_large"


class InvalidApiKey(GatewayError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotAllowed(GatewayError):
    status = 403
    error_type = "permission_error"
    code = "model_not_allowed"


class ModelNotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class RequestTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, reason: str = "rpm", headers: dict[str, str] | None = None) -> None:
        super().__init__(message, headers=headers)
        self.reason = reason
        """Which limit: ``rpm``, ``tpm``, ``concurrency``, ``provider`` (or ``auth``: key guessing)."""


class QuotaExceeded(GatewayError):
    status = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"

    def __init__(
        self, message: str, *, reason: str = "budget", headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message, headers=headers)
        self.reason = reason
        """Which limit: ``budget`` or ``task_budget``."""


class StateUnavailable(GatewayError):
    status = 503
    error_type = "server_error"
    code = "state_unavailable"


class NotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class UpstreamFailure(GatewayError):
    """One upstream attempt that did not produce a usable answer."""

    outcome: ClassVar[Outcome] = "error"

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = False,
        breaker_failure: bool = False,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, headers=headers)
        self.retryable = retryable
        self.breaker_failure = breaker_failure
        self.retry_after_s = retry_after_s


class UpstreamError(UpstreamFailure):
    status = 502
    error_type = "server_error"
    code = "upstream_error"


class UpstreamUnavailable(UpstreamFailure):
    status = 503
    error_type = "server_error"
    code = "upstream_unavailable"


class UpstreamRateLimited(UpstreamUnavailable):
    """The upstream answered 429: rate limiting, not breakage."""

    outcome = "rate_limited"


class UpstreamTimeout(UpstreamFailure):
    status = 504
    error_type = "server_error"
    code = "upstream_timeout"
    outcome = "timeout"


class UpstreamRejected(UpstreamFailure):
    """An upstream 4xx (other than 408/409/429), passed back with its own status and body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"upstream rejected the request with status {status}")
        self.upstream_status = status
        self.upstream_body = body

    def body(self) -> bytes:
        return self.upstream_body


_encode = msgspec.json.Encoder().encode

SHOULD_NOT_RETRY = {"x-should-retry": "false"}


def render(error: GatewayError) -> tuple[int, bytes, dict[str, str]]:
    """Status, body and headers of the response that reports ``error``."""
    status = error.upstream_status if isinstance(error, UpstreamRejected) else error.status
    return status, error.body(), {**error.headers, **SHOULD_NOT_RETRY}


def stream_error_event(error: GatewayError) -> bytes:
    """The SSE events that end a stream the gateway had to cut."""
    return b"data: " + error.body() + b"\n\ndata: [DONE]\n\n"
