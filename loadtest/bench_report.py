"""The benchmark's results and the one table it prints.

A :class:`Cell` is one target (direct to the mock upstream, the gateway, another gateway)
measured in one setting (upstream latency, stream or not, concurrency). Every non-direct row is
compared with the direct row of the same setting, measured in the same run, interleaved with it:
throughput as a ratio, latency as milliseconds added.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.bench_client import LoadResult, percentile
from loadtest.bench_wrk import WrkResult

DIRECT = "direct"
CPU_NAMES = ("gateway", "redis-server", "mock-upstream", "bench")
"""Whose CPU use the table shows, in its order; ``bench`` is this process (the load generator)."""
STEAL = "steal"
"""The machine's CPU time taken by the hypervisor for other guests (:func:`bench_procs.steal_s`)."""


@dataclass(slots=True)
class Cell:
    latency_ms: float
    stream: bool
    concurrency: int
    target: str
    load: LoadResult = field(default_factory=LoadResult)
    wall_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    wrk: WrkResult | None = None

    @property
    def key(self) -> tuple[float, bool, int]:
        return (self.latency_ms, self.stream, self.concurrency)

    def ms(self, q: float) -> float:
        return percentile(self.load.latencies, q) * 1000

    def ttft_ms(self, q: float) -> float:
        return percentile(self.load.ttfts, q) * 1000

    def cpu_percent(self, name: str) -> float | None:
        used = self.cpu_s.get(name)
        return None if used is None or self.wall_s <= 0 else 100 * used / self.wall_s

    def steal_percent(self) -> float | None:
        """Share of the machine's CPU time (all CPUs) stolen by the hypervisor during the runs."""
        stolen = self.cpu_s.get(STEAL)
        cpus = os.cpu_count() or 1
        return None if stolen is None or self.wall_s <= 0 else 100 * stolen / (self.wall_s * cpus)

    def server_cpu_ms(self) -> float | None:
        """CPU milliseconds per request of the server under test: the mock for the direct row, the
        gateway worker for the gateway row (its Redis and upstream are in the CPU% column)."""
        name = {DIRECT: "mock-upstream", "gateway": "gateway"}.get(self.target)
        used = self.cpu_s.get(name) if name else None
        return None if used is None or not self.load.requests else 1000 * used / self.load.requests

    def as_dict(self) -> dict[str, Any]:
        return {
            "upstream_latency_ms": self.latency_ms,
            "stream": self.stream,
            "concurrency": self.concurrency,
            "target": self.target,
            "requests": self.load.requests,
            "requests_per_s": self.load.rate,
            "errors": self.load.errors,
            "statuses": dict(self.load.statuses),
            "latency_ms": {f"p{q}": self.ms(q) for q in (50, 90, 99)},
            "ttft_ms": {f"p{q}": self.ttft_ms(q) for q in (50, 90, 99)} if self.stream else None,
            "cpu_percent": {name: self.cpu_percent(name) for name in CPU_NAMES},
            "server_cpu_ms_per_request": self.server_cpu_ms(),
            "steal_percent": self.steal_percent(),
            "wrk": None
            if self.wrk is None
            else {
                "requests_per_s": self.wrk.rate,
                "errors": self.wrk.errors,
                "latency_ms": {"p50": self.wrk.p50_ms, "p90": self.wrk.p90_ms, "p99": self.wrk.p99_ms},
            },
        }


def _ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _with_added(value: float, base: float | None) -> str:
    if base is None or math.isnan(value) or math.isnan(base):
        return _ms(value)
    return (
        f"{_ms(value)} ({value - base:+.2f})"
        if abs(value - base) < 100
        else f"{_ms(value)} ({value - base:+.0f})"
    )


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}" if base else "-"


def _cpu(cell: Cell) -> str:
    parts = []
    for name in CPU_NAMES:
        pct = cell.cpu_percent(name)
        parts.append("-" if pct is None else f"{pct:.0f}")
    return "/".join(parts)


HEADER = (
    "up ms",
    "mode",
    "conc",
    "target",
    "req/s",
    "x direct",
    "p50 ms (+added)",
    "p90 ms (+added)",
    "p99 ms (+added)",
    "TTFT p50 (+added)",
    "TTFT p99 (+added)",
    "err",
    "wrk req/s",
    "wrk x dir",
    "wrk p50/p99 ms",
    "CPU% gw/redis/mock/gen",
    "srv CPU ms/req",
    "steal%",
)


def _row(cell: Cell, base: Cell | None) -> tuple[str, ...]:
    own = base is None or base is cell
    ref = None if own else base
    wrk, ref_wrk = cell.wrk, (ref.wrk if ref is not None else None)
    return (
        f"{cell.latency_ms:g}",
        "stream" if cell.stream else "whole",
        str(cell.concurrency),
        cell.target,
        f"{cell.load.rate:,.0f}",
        "" if own else _ratio(cell.load.rate, base.load.rate if base else None),
        *(_with_added(cell.ms(q), ref.ms(q) if ref else None) for q in (50, 90, 99)),
        *(
            _with_added(cell.ttft_ms(q), ref.ttft_ms(q) if ref else None) if cell.stream else "-"
            for q in (50, 99)
        ),
        str(cell.load.errors),
        f"{wrk.rate:,.0f}" if wrk else "-",
        ("" if own else _ratio(wrk.rate, ref_wrk.rate if ref_wrk else None)) if wrk else "-",
        f"{_ms(wrk.p50_ms)}/{_ms(wrk.p99_ms)}" if wrk else "-",
        _cpu(cell),
        "-" if (cpu_ms := cell.server_cpu_ms()) is None else f"{cpu_ms:.2f}",
        "-" if (steal := cell.steal_percent()) is None else f"{steal:.0f}",
    )


def table(cells: list[Cell]) -> str:
    """One aligned text table, a blank line between settings, direct first in each."""
    direct = {c.key: c for c in cells if c.target == DIRECT}
    rows: list[tuple[str, ...] | None] = []
    last: tuple[float, bool, int] | None = None
    for cell in cells:
        if last is not None and cell.key != last:
            rows.append(None)
        last = cell.key
        rows.append(_row(cell, direct.get(cell.key)))
    widths = [max(len(h), *(len(r[i]) for r in rows if r)) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append(
            "" if row is None else "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
        )
    return "\n".join(lines)


def machine() -> str:
    """nproc, CPU model, memory, OS and Python: the line the README quotes."""
    model = "unknown CPU"
    with_model = [ln for ln in _read("/proc/cpuinfo").splitlines() if ln.startswith("model name")]
    if with_model:
        model = with_model[0].split(":", 1)[1].strip()
    mem = next(
        (ln.split()[1] for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), "0"
    )
    return (
        f"{os.cpu_count()} CPUs ({model}), {int(mem) / 1024 / 1024:.1f} GiB RAM, "
        f"Linux {platform.release()}, Python {platform.python_version()}"
    )


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


LEGEND = """\
Columns: up ms = mock upstream latency; mode = whole reply or SSE stream; conc = concurrent
keep-alive connections (closed loop); target = direct (client -> mock upstream), gateway (client
-> modelgate -> mock upstream), other (client -> --other-gateway -> its upstream).
req/s, p50/p90/p99, TTFT (time to the first body byte = first SSE event), err: measured by
loadtest/bench_client.py (uvloop, raw sockets). wrk columns: wrk (C, 1 thread), non-stream only.
x direct = req/s ratio to the direct row of the same setting; (+added) = ms over the direct row.
CPU% = share of one core used during the bench_client runs by the gateway worker, redis-server,
the mock upstream and the load generator (this process); 100 = one full core. srv CPU ms/req =
CPU time per request of the server under test (direct: the mock; gateway: the gateway worker),
which other work on the machine disturbs much less than req/s and latency. steal% = share of the
machine's CPU time (all CPUs) the hypervisor gave to other guests during the runs: a shared
virtual machine's noise, which no ratio can correct for."""
