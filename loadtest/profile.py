"""Profile the gateway worker under load: the measuring step before any hot-path change.

Starts the benchmark's stack (private Redis, mock upstream, one gateway worker with Redis
admission), drives it with the benchmark's load generator and records the worker with py-spy
(``pip install py-spy``; it needs ptrace, which root has). Prints the functions with the most
samples, by own time and by total time, and keeps the raw profile for a flame graph::

    python -m loadtest.profile --seconds 15 --concurrency 16 [--stream] [--out /tmp/gw.txt]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import tempfile
from pathlib import Path

from loadtest.bench_client import build_request, chat_body, run_load
from loadtest.bench_procs import BENCH_KEY, MODEL, start_gateway, start_mock, start_redis


def _function(frame: str) -> str:
    """``name (path/to/file.py:123)`` -> ``name (file.py)``: totals per function, not per line."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':')[0]})"


def summarize(raw: Path, top: int) -> None:
    """Own and total samples per function from py-spy's raw (collapsed stacks) output."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = [_function(frame) for frame in stack.split(";")]
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    print(f"{samples} samples")
    for title, counter in (("own", own), ("total", total)):
        print(f"\n-- top {top} by {title} samples --")
        for frame, count in counter.most_common(top):
            print(f"{100 * count / samples:6.1f}%  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("/tmp/modelgate-profile.txt"))
    args = parser.parse_args()
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("py-spy is not on PATH: pip install py-spy")
    with tempfile.TemporaryDirectory(prefix="mgprof-") as tmp_name:
        tmp = Path(tmp_name)
        redis, redis_url = start_redis(tmp)
        mock, mock_url = start_mock(tmp, latency_ms=args.latency_ms)
        gateway, url = start_gateway(tmp, mock_url, redis_url, "warning")
        try:
            chat = f"{url}/v1/chat/completions"
            request = build_request(chat, chat_body(MODEL, args.stream), BENCH_KEY)
            asyncio.run(run_load(chat, request, args.concurrency, 1.0))  # warm up
            record = [py_spy, "record", "-p", str(gateway.pid), "-r", "500", "-f", "raw"]
            record += ["-o", str(args.out), "-d", str(int(args.seconds) + 1), "--nonblocking"]
            spy = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            result = asyncio.run(run_load(chat, request, args.concurrency, args.seconds))
            spy.wait(timeout=60)
            print(f"{result.ok} ok, {result.errors} errors, {result.rate:,.0f} req/s")
        finally:
            for process in (gateway, mock, redis):
                process.stop()
    summarize(args.out, args.top)
    print(f"\nraw profile: {args.out}")


if __name__ == "__main__":
    main()
