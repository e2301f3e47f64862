"""Side-by-side benchmark: the mock upstream directly, through modelgate, and through another gateway.

One command starts its own ``redis-server``, ``modelgate mock-upstream`` and a gateway
(``modelgate serve --workers 1`` with a generated config: admission in Redis for one tenant with
generous limits, one model whose one target is the mock), then drives each target at several
concurrencies, with the upstream answering at once and after 50 ms, streamed and not, and prints
one table with every non-direct row compared to the direct row measured in the same run::

    python -m loadtest.bench [--quick] [--seconds N] [--memory N]
                             [--other-gateway URL --other-key K --other-model M [--mock-port P]]

Direct and gateway runs of each setting are interleaved (``--rounds`` slices each, alternating
which goes first), so noise from other work on the machine hits both. The load generator is
:mod:`loadtest.bench_client`; :mod:`loadtest.bench_wrk` (wrk, when installed) measures the
non-stream settings again as a cross-check. The gateway worker's resident memory is read after
warm-up and at the end; ``--memory N`` instead sends N requests and prints the memory at
checkpoints (the "RSS grows < 5% between 50k and 250k requests" check is ``--memory 250000``).

``--other-gateway`` measures another OpenAI-compatible gateway the same way. It is never a
dependency: install it elsewhere (e.g. a LiteLLM proxy in a throwaway venv), point its model at
the mock upstream (``--mock-port`` fixes the mock's port: ``http://127.0.0.1:<port>/v1``, any
API key), and pass its URL, key and model name. Without it the benchmark says it was not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import uvloop

from loadtest import bench_pin, bench_wrk
from loadtest.bench_client import build_request, chat_body, run_load
from loadtest.bench_procs import (
    BENCH_KEY,
    MODEL,
    Process,
    mock_config,
    reset_breaker,
    set_mock_latency,
    start_gateway,
    start_mock,
    start_redis,
    steal_s,
)
from loadtest.bench_report import DIRECT, LEGEND, STEAL, Cell, machine, table


@dataclass(frozen=True, slots=True)
class Target:
    """Something to send chat completions to."""

    name: str
    url: str
    """The full ``/chat/completions`` URL."""
    key: str | None
    model: str

    def request(self, stream: bool) -> bytes:
        return build_request(self.url, chat_body(self.model, stream), self.key)


@dataclass(frozen=True, slots=True)
class Plan:
    latencies: tuple[float, ...]
    streams: tuple[bool, ...]
    concurrencies: tuple[int, ...]
    seconds: float
    """Per target and setting, split over ``rounds``."""
    rounds: int
    warmup: float
    wrk_seconds: float


_MODES = {"whole": False, "stream": True}


def _latencies(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(ms) for ms in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated milliseconds: {text!r}") from None
    if any(ms < 0 for ms in values):
        raise argparse.ArgumentTypeError("upstream latencies are 0 ms or more")
    return values


def _modes(text: str) -> tuple[bool, ...]:
    names = text.split(",")
    unknown = [name for name in names if name not in _MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"modes are whole and stream, not {', '.join(unknown)}")
    return tuple(_MODES[name] for name in names)


def _plan(args: argparse.Namespace) -> Plan:
    concurrencies = tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None
    latencies: tuple[float, ...] = args.latencies or (0.0, 50.0)
    streams: tuple[bool, ...] = args.modes or (False, True)
    if args.quick:
        return Plan(
            latencies,
            streams,
            concurrencies or (16,),
            args.seconds or 2.0,
            2,
            0.3,
            1.0 if args.wrk else 0,
        )
    seconds = args.seconds or 8.0
    return Plan(
        latencies,
        streams,
        concurrencies or (1, 16, 64),
        seconds,
        args.rounds,
        0.5,
        max(1.0, seconds / 2) if args.wrk else 0,
    )


class Stack:
    """The processes of one benchmark run; stopped on exit whatever happens."""

    def __init__(self, tmp: Path, mock_port: int | None, log_level: str) -> None:
        self.procs: list[Process] = []
        try:
            self.redis, redis_url = self._keep(start_redis(tmp))
            self.mock, self.mock_url = self._keep(start_mock(tmp, mock_port))
            self.gateway, self.gateway_url = self._keep(
                start_gateway(tmp, self.mock_url, redis_url, log_level)
            )
        except BaseException:
            self.stop()
            raise

    def _keep(self, started: tuple[Process, str]) -> tuple[Process, str]:
        self.procs.append(started[0])
        return started

    def cpu(self) -> dict[str, float]:
        used = {p.name: p.cpu_s() for p in self.procs}
        used["bench"] = time.process_time()
        used[STEAL] = steal_s()
        return used

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def _say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


async def _segment(stack: Stack, target: Target, cell: Cell, seconds: float, warmup: float) -> None:
    """One bench_client run of ``target`` in ``cell``'s setting, added to the cell."""
    before, started = stack.cpu(), time.monotonic()
    result = await run_load(target.url, target.request(cell.stream), cell.concurrency, seconds, warmup)
    after, wall = stack.cpu(), time.monotonic() - started
    cell.load.merge(result)
    cell.wall_s += wall
    for name, value in after.items():
        cell.cpu_s[name] = cell.cpu_s.get(name, 0.0) + value - before[name]


async def _setting(
    stack: Stack, targets: list[Target], plan: Plan, key: tuple[float, bool, int]
) -> list[Cell]:
    latency, stream, concurrency = key
    cells = [Cell(latency, stream, concurrency, t.name) for t in targets]
    pairs = list(zip(targets, cells, strict=True))
    for r in range(plan.rounds):
        for target, cell in pairs if r % 2 == 0 else reversed(pairs):
            await _segment(stack, target, cell, plan.seconds / plan.rounds, plan.warmup)
    if plan.wrk_seconds and not stream:
        for target, cell in pairs:
            cell.wrk = await bench_wrk.run_wrk(
                target.url, chat_body(target.model, False), target.key, concurrency, plan.wrk_seconds
            )
    for cell in cells:
        wrk = f", wrk {cell.wrk.rate:,.0f} req/s" if cell.wrk else ""
        _say(
            f"  {latency:g} ms {'stream' if stream else 'whole'} c={concurrency} {cell.target}: "
            f"{cell.load.rate:,.0f} req/s, p50 {cell.ms(50):.2f} ms, errors {cell.load.errors}{wrk}"
        )
    return cells


async def _warm_up(gateway: Target, seconds: float, concurrency: int = 16) -> int:
    """Traffic through the gateway before anything is measured: pools, caches, code paths.

    At the highest concurrency to come, so that connection pools and buffers have reached their
    size before the first RSS reading, and the growth reported is what requests leave behind."""
    done = 0
    for stream in (False, True):
        result = await run_load(gateway.url, gateway.request(stream), concurrency, seconds, warmup=0)
        done += result.requests
        if result.errors:
            raise RuntimeError(f"warm-up through the gateway failed: {dict(result.statuses)}")
    return done


async def _matrix(stack: Stack, targets: list[Target], plan: Plan) -> tuple[list[Cell], int]:
    cells: list[Cell] = []
    for latency in plan.latencies:
        set_mock_latency(stack.mock_url, latency)
        for stream in plan.streams:
            for concurrency in plan.concurrencies:
                cells += await _setting(stack, targets, plan, (latency, stream, concurrency))
    set_mock_latency(stack.mock_url, 0)
    gateway_requests = sum(c.load.requests for c in cells if c.target == "gateway")
    return cells, gateway_requests


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


async def _benchmark(
    stack: Stack, targets: list[Target], plan: Plan, args: argparse.Namespace
) -> tuple[str, list[Cell]]:
    gateway = next(t for t in targets if t.name == "gateway")
    warm = await _warm_up(gateway, 2.0 if not args.quick else 1.0, max(plan.concurrencies))
    rss_warm = stack.gateway.rss_kib()
    load_before = os.getloadavg()
    started = time.monotonic()
    cells, sent = await _matrix(stack, targets, plan)
    took = time.monotonic() - started
    breaker = await _breaker_open(stack, gateway, 2.0 if args.quick else 5.0)
    rss_end = stack.gateway.rss_kib()
    other = (
        f"other gateway: {args.other_gateway} (model {args.other_model})"
        if args.other_gateway
        else "other gateway: not measured (pass --other-gateway URL --other-key K --other-model M)"
    )
    growth = rss_end - rss_warm
    lines = [
        f"modelgate benchmark ({'quick' if args.quick else 'full'}): {machine()}",
        f"{plan.seconds:g} s per target and setting in {plan.rounds} interleaved rounds "
        f"(+{plan.warmup:g} s unrecorded warm-up each); wrk {plan.wrk_seconds:g} s; "
        f"matrix took {took:.0f} s; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after",
        f"gateway: 1 worker, admission in Redis, log level {args.log_level}; {other}"
        + (f"; upstream latency jitter +-{args.jitter_ms:g} ms" if args.jitter_ms else ""),
        "CPU placement: " + (args.placement or "left to the scheduler"),
        "",
        table(cells),
        "",
        LEGEND,
        "",
        f"gateway worker RSS (VmRSS): {_mib(rss_warm)} after warm-up ({warm:,} requests), "
        f"{_mib(rss_end)} at the end ({warm + sent:,} requests): {growth / 1024:+.1f} MiB "
        f"({100 * growth / rss_warm:+.1f}%)",
        "",
        breaker,
    ]
    return "\n".join(lines), cells


def _quantile_ms(latencies: list[float], q: float) -> float:
    ordered = sorted(latencies)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _breaker_open(stack: Stack, gateway: Target, seconds: float) -> str:
    """How fast the gateway refuses while its only target's breaker is open (503, no upstream call).

    The mock answers 500 until the breaker opens (5 consecutive failures by default; its reset
    timeout, 30 s, outlasts the measurement), then the fast failures are timed; at the end the mock
    is healed and the breaker reset through the admin API."""
    mock_config(stack.mock_url, mode="status", status=500)
    try:
        # Failing requests until the breaker opens (each makes up to retry.attempts calls).
        await run_load(gateway.url, gateway.request(False), 1, max_requests=6, warmup=0, ok_status=503)
        rows = []
        for concurrency in (1, 16):
            result = await run_load(
                gateway.url, gateway.request(False), concurrency, seconds, 0.3, ok_status=503
            )
            p50, p99 = _quantile_ms(result.latencies, 0.5), _quantile_ms(result.latencies, 0.99)
            rows.append(
                f"  c={concurrency}: {result.rate:,.0f} req/s, p50 {p50:.2f} ms, p99 {p99:.2f} ms "
                f"({result.ok:,} fast 503s, {result.errors} other answers)"
            )
    finally:
        mock_config(stack.mock_url, mode="ok")
        reset_breaker(stack.gateway_url)
    return "open breaker, fast failures (whole replies, 0 ms upstream):\n" + "\n".join(rows)


async def _memory(stack: Stack, gateway: Target, total: int, concurrency: int) -> str:
    """Send ``total`` requests (whole and stream alternately) and read the RSS at checkpoints.

    The warm-up runs at the same concurrency, so that pools and buffers have reached their size
    before the first reading: what grows after it is what requests leave behind."""
    await _warm_up(gateway, 2.0, concurrency)
    tenth = max(1, total // 10)
    done, errors, readings = 0, 0, [(0, stack.gateway.rss_kib())]
    _say(f"RSS after warm-up: {_mib(readings[0][1])}")
    started = time.monotonic()
    while done < total:
        step = min(tenth, total - done)
        for stream, n in ((False, step // 2), (True, step - step // 2)):
            if n:
                result = await run_load(
                    gateway.url, gateway.request(stream), concurrency, warmup=0, max_requests=n
                )
                errors += result.errors
        done += step
        readings.append((done, stack.gateway.rss_kib()))
        rate = done / (time.monotonic() - started)
        _say(f"  {done:>9,} requests: RSS {_mib(readings[-1][1])}, {rate:,.0f} req/s")
    lines = [
        f"modelgate memory check: {machine()}",
        f"{total:,} requests at concurrency {concurrency}, "
        f"half whole, half stream, upstream latency 0 ms; errors: {errors}",
        "",
    ]
    lines += [f"{n:>9,} requests  RSS {_mib(kib)}" for n, kib in readings]
    at = total // 5
    first = min(readings[1:], key=lambda r: abs(r[0] - at))
    last = readings[-1]
    growth = 100 * (last[1] - first[1]) / first[1]
    verdict = "under 5%: ok" if growth < 5 else "5% or more: FAILS the < 5% check"
    lines += ["", f"growth from {first[0]:,} to {last[0]:,} requests: {growth:+.2f}% ({verdict})"]
    return "\n".join(lines)


def _pin(stack: Stack, args: argparse.Namespace) -> str | None:
    """Place the processes (see :mod:`loadtest.bench_pin`); what was done, for the report."""
    cpus = bench_pin.placement()
    if cpus is None:
        _say("fewer than two CPUs (or not Linux): CPU placement left to the scheduler")
        return None
    server, rest = cpus
    servers = [stack.gateway.pid]
    other = ""
    if args.other_gateway:
        port = urlsplit(args.other_gateway).port
        found = bench_pin.listening_pids(port) if port else []
        servers += found
        other = f" and the other gateway ({len(found)} process(es))" if found else ""
        if not found:
            other = " (the other gateway's processes were not found: left unpinned)"
    for pid in servers:
        bench_pin.pin(pid, server)
    for pid in (stack.mock.pid, stack.redis.pid, os.getpid()):
        bench_pin.pin(pid, rest)
    return f"gateway worker{other} on CPU {server}; load generator, mock upstream and Redis on CPU {rest}"


def _targets(stack: Stack, args: argparse.Namespace) -> list[Target]:
    targets = [
        Target(DIRECT, f"{stack.mock_url}/v1/chat/completions", None, MODEL),
        Target("gateway", f"{stack.gateway_url}/v1/chat/completions", BENCH_KEY, MODEL),
    ]
    if args.other_gateway:
        base = args.other_gateway.rstrip("/")
        url = f"{base}/chat/completions" if base.endswith("/v1") else f"{base}/v1/chat/completions"
        targets.append(Target("other", url, args.other_key, args.other_model))
    return targets


async def _check(targets: list[Target]) -> None:
    """One request of each kind to each target: a target that does not answer 200 stops the run."""
    for target in targets:
        for stream in (False, True):
            try:
                async with asyncio.timeout(30):
                    result = await run_load(target.url, target.request(stream), 1, warmup=0, max_requests=3)
            except TimeoutError:
                raise SystemExit(f"{target.name} ({target.url}) does not answer within 30 s") from None
            if result.errors:
                raise SystemExit(f"{target.name} ({target.url}) does not answer 200: {dict(result.statuses)}")


@contextlib.contextmanager
def _workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="modelgate-bench-"))
    try:
        yield path
    finally:
        if not keep:
            for child in sorted(path.rglob("*"), reverse=True):
                child.rmdir() if child.is_dir() else child.unlink()
            path.rmdir()
        else:
            _say(f"logs kept in {path}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~30 s subset for smoke use")
    parser.add_argument(
        "--seconds", type=float, default=None, help="per target and setting (default 8; quick 2)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved slices per setting")
    parser.add_argument("--concurrency", default=None, help="comma-separated (default 1,16,64; quick 16)")
    parser.add_argument(
        "--latencies", type=_latencies, default=None, help="upstream ms, comma-separated (default 0,50)"
    )
    parser.add_argument(
        "--modes", type=_modes, default=None, help="whole,stream or one of them (default both)"
    )
    parser.add_argument("--no-wrk", dest="wrk", action="store_false", help="skip the wrk cross-check")
    parser.add_argument("--memory", type=int, default=None, metavar="N", help="memory check: N requests")
    parser.add_argument("--memory-concurrency", type=int, default=64)
    parser.add_argument("--other-gateway", default=None, metavar="URL")
    parser.add_argument("--other-key", default=None)
    parser.add_argument("--other-model", default=MODEL)
    parser.add_argument("--mock-port", type=int, default=None, help="fixed port for the mock upstream")
    parser.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="spread the mock's non-zero latency uniformly by +-this (default 0: every answer on time)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the servers under test on one CPU, the load generator, mock upstream and Redis on "
        "another (see loadtest/bench_pin.py); default: placement left to the scheduler",
    )
    parser.add_argument("--log-level", default="info", help="the gateway's (info writes one line a request)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every cell as JSON")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the processes' logs")
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so that SIGTERM too stops the processes this run started


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        _main(_parser().parse_args())
    except KeyboardInterrupt:
        _say("interrupted: the processes this run started are stopped")
        sys.exit(130)


def _main(args: argparse.Namespace) -> None:
    if args.wrk and not bench_wrk.available():
        _say("wrk not found (Debian: apt-get install -y wrk): the wrk columns are left empty")
        args.wrk = False
    plan = _plan(args)
    with _workdir(args.keep_logs) as tmp:
        stack = Stack(tmp, args.mock_port, args.log_level)
        try:
            _say(f"mock upstream {stack.mock_url}, gateway {stack.gateway_url} (pid {stack.gateway.pid})")
            targets = _targets(stack, args)
            args.placement = _pin(stack, args) if args.pin else None
            if args.jitter_ms:
                mock_config(stack.mock_url, jitter_ms=args.jitter_ms)
            uvloop.run(_check(targets))
            if args.memory:
                report = uvloop.run(_memory(stack, targets[1], args.memory, args.memory_concurrency))
            else:
                report, cells = uvloop.run(_benchmark(stack, targets, plan, args))
                if args.json:
                    Path(args.json).write_text(json.dumps([c.as_dict() for c in cells], indent=1))
        finally:
            stack.stop()
    print(report, flush=True)


if __name__ == "__main__":
    main()
