"""The Grafana dashboard's queries, checked against real scrapes: every metric and grouping label exists."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import start_http_server

from client import metrics as worker_metrics
from tests.harness import free_port
from tests.ops.promtext import Scrape

DASHBOARD = Path(__file__).resolve().parents[2] / "loadtest" / "grafana" / "modelgate.json"
_METRIC = re.compile(r"\bmodelgate_[a-z0-9_]+")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_MATCHER = re.compile(r"([a-z_]+)\s*(?:=~|!~|!=|=)")


def queries(dashboard: dict[str, Any]) -> Iterator[str]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]
    for variable in dashboard["templating"]["list"]:
        yield variable["definition"]


def check_dashboard(path: Path, scrapes: list[Scrape]) -> list[str]:
    """What is wrong with the dashboard's queries (empty when nothing is)."""
    series: dict[str, set[str]] = {}
    for scrape in scrapes:
        for name, labels in scrape.samples:
            series.setdefault(name, set()).update(label for label, _ in labels)
    problems = []
    for expr in queries(json.loads(path.read_text())):
        names = set(_METRIC.findall(expr))
        if not names:
            problems.append(f"no modelgate metric in {expr!r}")
        for name in names - set(series):
            problems.append(f"{name} (in {expr!r}) is in no scrape")
        known = set().union(*(series.get(n, set()) for n in names))
        used = {label.strip() for group in _BY.findall(expr) for label in group.split(",")} | set(
            _MATCHER.findall(expr)
        )
        problems += [f"label {label!r} (in {expr!r}) is on none of its metrics" for label in used - known]
    return problems


def worker_exposition() -> str:
    """A real scrape of a queue worker's metrics server after it counted a transition."""
    worker_metrics.record("research", "done")
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=worker_metrics.REGISTRY)
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
