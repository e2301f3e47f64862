"""Prometheus metrics: the names, types and label sets of the contract, and the ``/metrics`` text.

Every metric below is written by the process that served the request. With ``--workers N`` the
instance answers ``/metrics`` from whichever worker the scrape reaches, so values must cover all
of them: ``modelgate serve`` points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory before the
workers start, and prometheus_client's multiprocess mode keeps each worker's values in its own
mmap file there; a scrape sums the files (the in-flight gauge only over live workers). Without the
variable, one process keeps its values in memory.

``modelgate_breaker_state`` is not kept per process at all: it is read from the shared breaker
store at scrape time, so it shows the one state every worker obeys, once.

Label values come only from config and admin data: a model the routes do not know is ``unknown``,
a request without an authenticated tenant has tenant ``unknown``.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from policies.breakers import Breakers

if TYPE_CHECKING:
    from gateway.record import RequestRecord
    from gateway.runtime import Gateway
    from policies.routing import ModelRoute

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4"
"""Prometheus text format 0.0.4 (Litestar adds the charset)."""
UNKNOWN = "unknown"
RATE_LIMIT_REASONS = frozenset({"rpm", "tpm", "concurrency", "budget", "task_budget", "provider"})
BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}
BREAKER_READ_TIMEOUT_S = 2.0

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)

REGISTRY = CollectorRegistry(auto_describe=True)
"""The metrics of this process; in multiprocess mode only a place to create them, never scraped."""

REQUESTS = Counter(
    "modelgate_requests",
    "Chat completion requests, by final status",
    ["tenant", "model", "status"],
    registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "modelgate_request_duration_seconds",
    "Whole request time, streams until their last event",
    ["model"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
RATE_LIMITED = Counter(
    "modelgate_rate_limited",
    "Requests refused with 429, by the limit that refused them",
    ["tenant", "reason"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "modelgate_tokens",
    "Tokens used (upstream usage, else the gateway's estimate)",
    ["tenant", "model", "type"],
    registry=REGISTRY,
)
COST = Counter(
    "modelgate_cost_usd", "Spend at the model's configured prices", ["tenant", "model"], registry=REGISTRY
)
UPSTREAM_REQUESTS = Counter(
    "modelgate_upstream_requests",
    "Upstream attempts by outcome; breaker_open: a target skipped by its breaker",
    ["target", "outcome"],
    registry=REGISTRY,
)
UPSTREAM_DURATION = Histogram(
    "modelgate_upstream_duration_seconds",
    "One upstream attempt, streams until their end",
    ["target"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "modelgate_time_to_first_token_seconds",
    "From the start of a stream attempt to its first chunk",
    ["target"],
    buckets=TTFT_BUCKETS,
    registry=REGISTRY,
)
RETRIES = Counter(
    "modelgate_retries",
    "Attempts made again after a failed one, by the failed target and outcome",
    ["target", "reason"],
    registry=REGISTRY,
)
BREAKER_TRANSITIONS = Counter(
    "modelgate_breaker_transitions",
    "Breaker transitions made by this instance",
    ["target", "state"],
    registry=REGISTRY,
)
INFLIGHT = Gauge(
    "modelgate_inflight_requests",
    "Chat requests being served, summed over live workers",
    multiprocess_mode="livesum",
    registry=REGISTRY,
)


# Labelled children, looked up once per label set: ``labels()`` costs more than the increment itself.
# Label values are bounded by config and admin data, and the metrics keep every child anyway.
_requests = functools.cache(REQUESTS.labels)
_request_duration = functools.cache(REQUEST_DURATION.labels)
_rate_limited = functools.cache(RATE_LIMITED.labels)
_tokens = functools.cache(TOKENS.labels)
_cost = functools.cache(COST.labels)
_upstream_requests = functools.cache(UPSTREAM_REQUESTS.labels)
_upstream_duration = functools.cache(UPSTREAM_DURATION.labels)
_time_to_first_token = functools.cache(TIME_TO_FIRST_TOKEN.labels)
_retries = functools.cache(RETRIES.labels)
_breaker_transitions = functools.cache(BREAKER_TRANSITIONS.labels)


class LabelSpace:
    """What label values may be: the configured models and their targets."""

    def __init__(self, routes: Mapping[str, ModelRoute]) -> None:
        self._routes = dict(routes)

    def model(self, name: str | None) -> str:
        return name if name is not None and name in self._routes else UNKNOWN

    def route_targets(self, model: str) -> list[str]:
        route = self._routes.get(model)
        return [t.name for t in route.targets] if route is not None else []


labels = LabelSpace({})
"""The label space of the gateway this process serves (set by :func:`bind`)."""


def bind(gateway: Gateway) -> None:
    """Take label values from ``gateway``'s routes and count its breakers' transitions."""
    global labels  # noqa: PLW0603 - metrics are per process, and so is the gateway they describe
    labels = LabelSpace(gateway.routes)
    listeners = gateway.limiter.breakers.listeners
    if breaker_transition not in listeners:
        listeners.append(breaker_transition)


def request_done(record: RequestRecord, seconds: float) -> None:
    """Count one finished chat request (called once, by its record)."""
    tenant = record.tenant or UNKNOWN
    model = labels.model(record.model)
    _requests(tenant, model, str(record.status)).inc()
    _request_duration(model).observe(seconds)
    usage = record.usage
    if usage is not None:
        _tokens(tenant, model, "prompt").inc(usage.prompt_tokens)
        _tokens(tenant, model, "completion").inc(usage.completion_tokens)
        _cost(tenant, model).inc(record.usd)
    if record.limit_reason in RATE_LIMIT_REASONS:
        _rate_limited(tenant, record.limit_reason).inc()
    if record.error_code == "upstream_unavailable" and record.attempts == 0:
        # Admission refused because every target's breaker is open: each target was skipped.
        for target in labels.route_targets(model):
            _upstream_requests(target, "breaker_open").inc()


def breaker_transition(target: str, state: str) -> None:
    _breaker_transitions(target, state).inc()


def upstream_attempt(target: str, outcome: str, seconds: float) -> None:
    _upstream_requests(target, outcome).inc()
    _upstream_duration(target).observe(seconds)


def first_token(target: str, seconds: float) -> None:
    _time_to_first_token(target).observe(seconds)


def retry(target: str, reason: str) -> None:
    _retries(target, reason).inc()


def multiprocess_dir() -> Path | None:
    value = os.environ.get(MULTIPROC_ENV)
    return Path(value) if value else None


async def exposition(gateway: Gateway) -> bytes:
    """The ``/metrics`` text: this instance's metrics plus the shared breaker states."""
    states = await breaker_states(gateway)
    registry = CollectorRegistry(auto_describe=False)
    directory = multiprocess_dir()
    if directory is None:
        registry.register(_WithoutCreated(REGISTRY))
    else:
        _forget_dead_workers(directory)
        MultiProcessCollector(registry, str(directory))  # type: ignore[no-untyped-call]
    if states is not None:
        registry.register(_BreakerStates(states))
    return generate_latest(registry)


async def breaker_states(gateway: Gateway) -> dict[str, str] | None:
    """State per configured target, read from the shared store (None when it cannot be read)."""
    targets = sorted({t.name for route in gateway.routes.values() for t in route.targets})
    breakers: Breakers = gateway.limiter.breakers
    try:
        async with asyncio.timeout(BREAKER_READ_TIMEOUT_S):
            views = await breakers.views(gateway.limiter.store, targets)
    except (RedisError, OSError, TimeoutError) as exc:
        gateway.limiter.health.mark(False, exc)
        return None
    return {view.target: view.state for view in views}


class _BreakerStates(Collector):
    def __init__(self, states: Mapping[str, str]) -> None:
        self._states = states

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(
            "modelgate_breaker_state",
            "Breaker state per target: 0 closed, 1 half-open, 2 open",
            labels=["target"],
        )
        for target, state in self._states.items():
            family.add_metric([target], BREAKER_VALUES[state])
        yield family


class _WithoutCreated(Collector):
    """A registry's metrics without the ``_created`` series (multiprocess mode has none either)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def _forget_dead_workers(directory: Path) -> None:
    """Drop the live-gauge files of workers that died without saying so (their in-flight count)."""
    for path in directory.glob("gauge_live*_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        if not _alive(pid):
            mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
