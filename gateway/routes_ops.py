"""Operational routes: liveness and readiness."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import MediaType, Request, Response, get

from gateway.http import gateway_of

_encode = msgspec.json.encode


@get("/healthz")
async def healthz() -> dict[str, str]:
    """200 while the process serves; checks nothing else."""
    return {"status": "ok"}


@get("/readyz")
async def readyz(request: Request[Any, Any, Any]) -> Response[bytes]:
    """200 when the config is loaded and Redis (if configured) answers; else 503 with the reason."""
    if not await gateway_of(request).limiter.ping():
        body = _encode({"status": "unavailable", "reason": "redis is unreachable"})
        return Response(content=body, status_code=503, media_type=MediaType.JSON)
    return Response(content=_encode({"status": "ready"}), media_type=MediaType.JSON)


ROUTES = [healthz, readyz]
