"""Operational routes: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import MediaType, Request, Response, get

from gateway import metrics, shutdown
from gateway.http import gateway_of, require_admin

_encode = msgspec.json.encode


@get("/healthz")
async def healthz() -> dict[str, str]:
    """200 while the process serves; checks nothing else."""
    return {"status": "ok"}


@get("/readyz")
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


@get("/metrics")
async def metrics_text(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Prometheus text for every worker of the instance; needs the admin key unless metrics_public."""
    gateway = gateway_of(request)
    if not gateway.config.server.metrics_public:
        await require_admin(request)
    return Response(content=await metrics.exposition(gateway), media_type=metrics.CONTENT_TYPE)


ROUTES = [healthz, readyz, metrics_text]
