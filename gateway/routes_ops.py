"""Operational routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import MediaType, Request, Response, get
from litestar.handlers import HTTPRouteHandler

from gateway import metrics, openapi, shutdown
from gateway.http import gateway_of, require_admin

_encode = msgspec.json.encode


@get("/healthz", responses={200: openapi.ok(openapi.Health, "The process serves.")})
async def healthz() -> dict[str, str]:
    """200 while the process serves; checks nothing else."""
    return {"status": "ok"}


@get(
    "/readyz",
    responses={
        200: openapi.ok(openapi.Ready, "Ready to serve."),
        503: openapi.ok(openapi.NotReady, "Not ready, and why: Redis does not answer, or shutting down."),
    },
)
async def readyz(request: Request[Any, Any, Any]) -> Response[bytes]:
    """200 when the config is loaded and Redis (if configured) answers and the process is not
    shutting down; else 503 with the reason."""
    if shutdown.draining():
        return _unavailable("shutting down")
    if not await gateway_of(request).limiter.ping():
        return _unavailable("redis is unreachable")
    return Response(content=_encode({"status": "ready"}), media_type=MediaType.JSON)


def _unavailable(reason: str) -> Response[bytes]:
    body = _encode({"status": "unavailable", "reason": reason})
    return Response(content=body, status_code=503, media_type=MediaType.JSON)


async def metrics_text(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Prometheus text for every worker of the instance; needs the admin key unless
    `server.metrics_public`."""
    gateway = gateway_of(request)
    if not gateway.config.server.metrics_public:
        await require_admin(request)
    return Response(content=await metrics.exposition(gateway), media_type=metrics.CONTENT_TYPE)


_EXPOSITION = openapi.ok(str, "Prometheus text format.", media_type=metrics.CONTENT_TYPE)
PUBLIC_METRICS = get("/metrics", media_type=metrics.CONTENT_TYPE, responses={200: _EXPOSITION})(metrics_text)
"""``/metrics`` as ``server.metrics_public = true`` serves it: to anyone."""
PRIVATE_METRICS = get(
    "/metrics",
    media_type=metrics.CONTENT_TYPE,
    security=openapi.ADMIN,
    responses={200: _EXPOSITION, 401: openapi.ADMIN_KEY_REFUSED, 429: openapi.KEY_GUESSING},
)(metrics_text)
"""``/metrics`` as ``server.metrics_public = false`` serves it: to the admin key only. The handler
is the same; only the document differs."""


def routes(metrics_public: bool) -> list[HTTPRouteHandler]:
    """The operational routes, ``/metrics`` documented as ``server.metrics_public`` says."""
    return [healthz, readyz, PUBLIC_METRICS if metrics_public else PRIVATE_METRICS]
