"""Reading a ``/metrics`` scrape in tests: parsed families, sample values and the contract's label sets."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

SPEC = {
    "modelgate_requests_total": ("counter", {"tenant", "model", "status"}),
    "modelgate_request_duration_seconds": ("histogram", {"model"}),
    "modelgate_rate_limited_total": ("counter", {"tenant", "reason"}),
    "modelgate_tokens_total": ("counter", {"tenant", "model", "type"}),
    "modelgate_cost_usd_total": ("counter", {"tenant", "model"}),
    "modelgate_upstream_requests_total": ("counter", {"target", "outcome"}),
    "modelgate_upstream_duration_seconds": ("histogram", {"target"}),
    "modelgate_time_to_first_token_seconds": ("histogram", {"target"}),
    "modelgate_retries_total": ("counter", {"target", "reason"}),
    "modelgate_breaker_state": ("gauge", {"target"}),
    "modelgate_breaker_transitions_total": ("counter", {"target", "state"}),
    "modelgate_inflight_requests": ("gauge", set()),
    "modelgate_tasks_total": ("counter", {"queue", "status"}),
}
"""SPEC.md's metrics table: name, type, label set."""

GATEWAY_METRICS = {name for name in SPEC if name != "modelgate_tasks_total"}
"""What the gateway itself exposes (tasks are counted by queue workers)."""


def family_name(metric: str) -> str:
    """The name the parser gives a metric's family (counters lose ``_total``)."""
    return metric.removesuffix("_total") if SPEC[metric][0] == "counter" else metric


@dataclass
class Scrape:
    text: str

    def __post_init__(self) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in self.families.values():
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                assert key not in self.samples, f"duplicate series {key}"
                self.samples[key] = sample.value

    def value(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, frozenset(labels.items())))

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name`` over every series whose labels include ``labels``."""
        wanted = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and wanted <= ls)

    def check_contract(self, names: set[str]) -> None:
        """Each of ``names`` is present with the spec's type and exactly its label set."""
        for metric in names:
            kind, label_set = SPEC[metric]
            family = self.families.get(family_name(metric))
            assert family is not None, f"{metric} is missing"
            assert family.type == kind, (metric, family.type)
            assert family.samples, f"{metric} has no series"
            for sample in family.samples:
                assert set(sample.labels) - {"le"} == label_set, (metric, sample)


def scrape(base_url: str, headers: dict[str, str] | None = None) -> Scrape:
    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return Scrape(response.text)
