"""``modelgate_tasks_total{queue,status}``: the status transitions a worker made, for Prometheus.

The counter lives in its own registry so that importing the client next to the gateway (which has
its own metrics) never collides; ``serve`` exposes it on ``127.0.0.1:<port>`` when a worker is
started with ``metrics_port``.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)
TASKS = Counter(
    "modelgate_tasks",
    "Task status transitions made by this worker",
    ["queue", "status"],
    registry=REGISTRY,
)


def record(queue: str, status: str) -> None:
    TASKS.labels(queue=queue, status=status).inc()


def serve(port: int, host: str = "127.0.0.1") -> WSGIServer:
    """Serve ``/metrics`` from a background thread; ``shutdown()`` the returned server to stop."""
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return server
