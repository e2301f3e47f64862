"""How exactly the shared rate limits admit under overload, across instances and workers.

One command starts its own ``redis-server``, ``mock-upstream`` and two gateway instances with
``--workers 2`` each (all sharing the one Redis), then drives two tenants at once at 4x their
limits: one limited by ``rpm``, one by ``tpm``. Each run first drains its bucket by a burst (a
bucket holds a whole minute of quota), then sends at a steady 4x the refill rate for ``--seconds``.
It prints what was admitted against what the buckets allow, tokens counted from the
``usage.total_tokens`` of admitted responses (the reservation is larger than the actual usage,
so settlement is part of what is measured)::

    python -m loadtest.admission_accuracy [--seconds 60] [--rpm 600] [--tpm 60000]

A token bucket of capacity C (one minute's quota) refilled at C/60 per second admits, from its
first admission at t0 to time t under constant overload, exactly C + C/60 * (t - t0) minus what is
left in the bucket at t (less than one request's cost). That is the figure compared here, both as
a total and as the steady rate once the initial burst allowance is taken off.

The load generator (:func:`flood`) is also used by the end-to-end tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench_procs import free_port

RPM_KEY = "loadtest-key-rpm-0123456789abcdef"
TPM_KEY = "loadtest-key-tpm-0123456789abcdef"
ADMIN_KEY = "loadtest-admin-0123456789abcdef"
PROMPT = "x" * 1596
MAX_TOKENS = 40
MOCK_WORDS = 12
"""Each request reserves its prompt estimate (3 + 4 + 1596/4 = 406) + 40 tokens; the mock answers 12
words, so 418 are used. A large prompt drains a token bucket in few requests."""
BURST_CONCURRENCY = 16


@dataclass(slots=True)
class Outcome:
    """One request: when it was sent and answered (monotonic seconds), its status and usage."""

    sent: float
    done: float
    status: int
    tokens: int = 0
    code: str | None = None
    message: str = ""


@dataclass(slots=True)
class Run:
    """One tenant's run: the burst that drained its bucket, then the paced overload."""

    limit: int
    tokens: bool
    started: float = 0.0
    paced_from: float = 0.0
    burst: list[Outcome] = field(default_factory=list)
    paced: list[Outcome] = field(default_factory=list)

    @property
    def outcomes(self) -> list[Outcome]:
        return [*self.burst, *self.paced]

    @property
    def ended(self) -> float:
        """About when the last request was decided (halfway through the last one sent)."""
        last = max(self.outcomes, key=lambda o: o.sent)
        return (last.sent + last.done) / 2

    @property
    def elapsed(self) -> float:
        """From the bucket's first admission to the last request decided."""
        return self.ended - self.started

    def admitted(self, outcomes: list[Outcome] | None = None) -> int:
        """Requests admitted, or for a token run the tokens they actually used."""
        chosen = self.outcomes if outcomes is None else outcomes
        return sum((o.tokens if self.tokens else 1) for o in chosen if o.status == 200)

    @property
    def allowed(self) -> float:
        """What the bucket lets through: a whole minute's quota, then quota/60 per second."""
        return self.limit + self.limit / 60 * self.elapsed

    def steady_rate_pct(self) -> float:
        """The admitted rate after the initial burst allowance, as a percentage of the configured one."""
        return 100 * (self.admitted() - self.limit) / (self.limit / 60 * self.elapsed)

    def window_rate_pct(self) -> float:
        """The admitted rate during the paced phase alone, as a percentage of the configured one."""
        window = self.ended - self.paced_from
        return 100 * self.admitted(self.paced) / (self.limit / 60 * window)

    def statuses(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for outcome in self.outcomes:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
        return counts


def chat_body(prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
    }


def reserved_tokens(prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> int:
    """What the gateway reserves for ``chat_body``: its prompt estimate (3 + 4 per message +
    characters / 4) plus ``max_tokens``."""
    return 3 + 4 + -(-len(prompt) // 4) + max_tokens


def used_tokens(prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> int:
    """What one request uses: the mock reports the same prompt estimate, and 12 words of reply."""
    return reserved_tokens(prompt, max_tokens) - max_tokens + min(MOCK_WORDS, max_tokens)


async def send(client: httpx.AsyncClient, url: str, key: str) -> Outcome:
    sent = time.monotonic()
    response = await client.post(
        f"{url}/v1/chat/completions", json=chat_body(), headers={"authorization": f"Bearer {key}"}
    )
    done = time.monotonic()
    payload = response.json()
    if response.status_code == 200:
        return Outcome(sent, done, 200, tokens=int(payload["usage"]["total_tokens"]))
    error = payload.get("error", {}) if isinstance(payload, dict) else {}
    return Outcome(sent, done, response.status_code, code=error.get("code"), message=error.get("message", ""))


async def flood(
    client: httpx.AsyncClient,
    urls: list[str],
    key: str,
    *,
    limit: int,
    tokens: bool,
    per_s: float,
    seconds: float,
    burst_deadline_s: float = 60.0,
) -> Run:
    """Drain the tenant's bucket by a burst, then send ``per_s`` requests a second for ``seconds``.

    Requests go round-robin to ``urls``. The burst stops at the first refusal (the bucket is empty
    then); its requests still in flight are awaited before the paced phase starts. A fresh bucket
    is assumed: its first admission is the first request here.
    """
    # The first request goes alone, so the time of the bucket's first admission is known closely.
    first = await send(client, urls[0], key)
    run = Run(limit=limit, tokens=tokens, started=(first.sent + first.done) / 2, burst=[first])
    drained = asyncio.Event()
    counter = iter(range(1, sys.maxsize))
    deadline = time.monotonic() + burst_deadline_s

    async def burst_worker() -> None:
        while not drained.is_set() and time.monotonic() < deadline:
            outcome = await send(client, urls[next(counter) % len(urls)], key)
            run.burst.append(outcome)
            if outcome.status != 200:
                drained.set()

    await asyncio.gather(*(burst_worker() for _ in range(BURST_CONCURRENCY)))
    if not drained.is_set():
        raise RuntimeError(f"the bucket was not drained within {burst_deadline_s} s: is the limit applied?")
    run.paced_from = time.monotonic()
    tasks: list[asyncio.Task[Outcome]] = []
    for i in range(max(1, round(per_s * seconds))):
        delay = run.paced_from + i / per_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # pacing the load, not waiting for state
        tasks.append(asyncio.create_task(send(client, urls[i % len(urls)], key)))
    run.paced = list(await asyncio.gather(*tasks))
    return run


# --- processes -------------------------------------------------------------------------------


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {url}")


@contextlib.contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(15)


def config_text(upstream_url: str, redis_url: str, rpm: int, tpm: int) -> str:
    return f"""
[server]
admin_key = "{ADMIN_KEY}"
request_timeout_s = 30

[redis]
url = "{redis_url}"
prefix = "accuracy"

[[providers]]
name = "up"
type = "openai"
base_url = "{upstream_url}/v1"
api_key = "sk-loadtest-upstream-0123456789"
read_timeout_s = 30

[[models]]
name = "gpt-4o-mini"
targets = [{{ provider = "up", model = "gpt-4o-mini" }}]

[[tenants]]
name = "by-rpm"
keys = ["{RPM_KEY}"]
rpm = {rpm}

[[tenants]]
name = "by-tpm"
keys = ["{TPM_KEY}"]
tpm = {tpm}
"""


# --- the command -----------------------------------------------------------------------------


def report(name: str, run: Run, unit: str) -> str:
    admitted, allowed = run.admitted(), run.allowed
    return "\n".join(
        [
            f"{name}: configured {run.limit} {unit}/min; {len(run.outcomes)} requests in {run.elapsed:.1f} s "
            f"(burst {len(run.burst)} in {run.paced_from - run.started:.1f} s; statuses {run.statuses()})",
            f"  admitted {admitted} {unit}, bucket allows {allowed:.1f} "
            f"({100 * admitted / allowed:.2f}%, off by {admitted - allowed:+.1f})",
            f"  steady rate after the burst allowance: {run.steady_rate_pct():.2f}% of configured",
            f"  rate in the paced phase alone:        {run.window_rate_pct():.2f}% of configured",
        ]
    )


async def measure(urls: list[str], rpm: int, tpm: int, seconds: float, factor: float) -> tuple[Run, Run]:
    limits = httpx.Limits(
        max_connections=4 * BURST_CONCURRENCY, max_keepalive_connections=4 * BURST_CONCURRENCY
    )
    async with httpx.AsyncClient(limits=limits, timeout=30.0) as client:
        by_rpm, by_tpm = await asyncio.gather(
            flood(client, urls, RPM_KEY, limit=rpm, tokens=False, per_s=factor * rpm / 60, seconds=seconds),
            flood(
                client,
                urls,
                TPM_KEY,
                limit=tpm,
                tokens=True,
                per_s=factor * tpm / 60 / used_tokens(),
                seconds=seconds,
            ),
        )
    return by_rpm, by_tpm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the paced overload")
    parser.add_argument("--rpm", type=int, default=600)
    parser.add_argument("--tpm", type=int, default=60_000)
    parser.add_argument("--factor", type=float, default=4.0, help="offered load, as a multiple of the limit")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        print("redis-server is not on PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="modelgate-accuracy-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        redis_port, upstream_port = free_port(), free_port()
        redis_args = [redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--dir", tmp]
        redis_args += ["--save", "", "--appendonly", "no"]
        stack.enter_context(process(redis_args, work / "redis.log"))
        cli = [sys.executable, "-m", "gateway.cli"]
        upstream = stack.enter_context(
            process([*cli, "mock-upstream", "--port", str(upstream_port)], work / "upstream.log")
        )
        upstream_url = f"http://127.0.0.1:{upstream_port}"
        wait_http(f"{upstream_url}/v1/models", upstream, work / "upstream.log")
        config = work / "gateway.toml"
        config.write_text(config_text(upstream_url, f"redis://127.0.0.1:{redis_port}/0", args.rpm, args.tpm))
        gateways = []
        for i in range(args.instances):
            port = free_port()
            serve = [
                *cli,
                "serve",
                "--config",
                str(config),
                "--port",
                str(port),
                "--workers",
                str(args.workers),
            ]
            log = work / f"gateway-{i}.log"
            gateways.append((f"http://127.0.0.1:{port}", stack.enter_context(process(serve, log)), log))
        for url, proc, log in gateways:
            wait_http(f"{url}/readyz", proc, log)
        urls = [url for url, _, _ in gateways]
        print(
            f"{args.instances} instances x {args.workers} workers, one Redis; {args.factor:g}x the limits "
            f"for {args.seconds:g} s after draining the buckets",
            flush=True,
        )
        by_rpm, by_tpm = asyncio.run(measure(urls, args.rpm, args.tpm, args.seconds, args.factor))
    print(report("rpm", by_rpm, "requests"))
    print(report("tpm", by_tpm, "tokens"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
