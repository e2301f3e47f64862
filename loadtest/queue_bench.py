"""No-op task throughput of the queue client, side by side with arq and a raw Redis list.

Run ``python -m loadtest.queue_bench [--tasks 5000] [--concurrency 10] [--procs 1,4]``. It starts
its own ``redis-server`` on a free port, then for each worker-process count measures, in the same
minute and on the same Redis:

* ``raw``: ``LPUSH`` by the producer, ``BRPOP`` by ``concurrency`` coroutines per process -- the
  floor: no record, no lease, no acknowledgement;
* ``arq``: arq (installed into a throwaway venv under ``/tmp``; skipped with a message when that
  fails), ``max_jobs=concurrency``, ``poll_delay=0.01`` (its default 0.5 s would cap it far lower);
* ``modelgate``: ``modelgate worker`` processes with ``--concurrency`` slots each.

Each run starts the workers, waits until they are all up, then times one producer enqueueing every
task (pipelined) until the last one is finished, and reports tasks per second and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

ARQ_VENV = Path("/tmp/modelgate-bench-arq-venv")
BATCH = 500


async def noop(ctx: Any, payload: Any) -> None:
    """The task every system runs: nothing."""


handlers = {"noop": noop}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Processes:
    """Worker processes of one run, each in its own process group, output in a temp file."""

    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, command: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        log = self.logs / f"proc-{uuid.uuid4().hex[:8]}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True
            )
        self.procs.append(proc)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def outputs(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in sorted(self.logs.glob("proc-*.log")))


async def _until(check: Callable[[], Awaitable[bool]], limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _batched(calls: Iterable[Awaitable[Any]]) -> None:
    pending = list(calls)
    for start in range(0, len(pending), BATCH):
        await asyncio.gather(*pending[start : start + BATCH])


class RedisProcess:
    """A private ``redis-server``, no persistence."""

    def __init__(self, directory: Path) -> None:
        if shutil.which("redis-server") is None:
            raise SystemExit("redis-server is not on PATH")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(directory)]
        self.proc = subprocess.Popen([*args, "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)

    async def ready(self) -> None:
        client = Redis.from_url(self.url)

        async def pong() -> bool:
            try:
                return bool(await client.ping())
            except OSError:
                return False
            except Exception:
                return False

        try:
            await _until(pong, 10, "redis-server")
        finally:
            await client.aclose()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    """One measurement setting."""

    redis_url: str
    procs: int
    tasks: int
    concurrency: int
    logs: Path


async def bench_modelgate(run: Run) -> float:
    """Seconds for ``modelgate worker`` processes to finish ``run.tasks`` no-op tasks."""
    from client import Queue

    name = f"bench-{uuid.uuid4().hex[:8]}"
    command = [sys.executable, "-m", "client.cli", "worker", "loadtest.queue_bench:handlers"]
    command += ["--redis", run.redis_url, "--queue", name, "--concurrency", str(run.concurrency)]
    workers = Processes(run.logs)
    for _ in range(run.procs):
        workers.start(command, cwd=ROOT)
    try:
        async with Queue(run.redis_url, name, max_connections=BATCH) as queue:

            async def up() -> bool:
                return int(await queue.redis.scard(queue.keys.workers)) == run.procs

            async def finished() -> bool:
                return int(await queue.redis.zcard(queue.keys.status("done"))) == run.tasks

            await _until(up, 30, "modelgate workers")
            started = time.monotonic()
            await _batched(queue.enqueue("noop") for _ in range(run.tasks))
            await _until(finished, 600, "modelgate tasks")
            return time.monotonic() - started
    finally:
        workers.stop()


async def raw_consumer(url: str, key: str, concurrency: int) -> None:
    """``BRPOP`` in ``concurrency`` coroutines until SIGTERM."""
    redis = Redis.from_url(url, max_connections=concurrency + 2)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def pop() -> None:
        while not stop.is_set():
            await redis.brpop([key], timeout=1)

    await redis.incr(f"{key}:ready")
    await asyncio.gather(*(pop() for _ in range(concurrency)))
    await redis.aclose()


async def bench_raw(run: Run) -> float:
    """Seconds for ``BRPOP`` consumers to take ``run.tasks`` items pushed one by one."""
    key = f"raw-{uuid.uuid4().hex[:8]}"
    command = [sys.executable, "-m", "loadtest.queue_bench", "--raw-consumer", run.redis_url, key]
    consumers = Processes(run.logs)
    for _ in range(run.procs):
        consumers.start([*command, str(run.concurrency)], cwd=ROOT)
    redis = Redis.from_url(run.redis_url, max_connections=BATCH)
    try:

        async def up() -> bool:
            return int(await redis.get(f"{key}:ready") or 0) == run.procs

        async def drained() -> bool:
            return int(await redis.llen(key)) == 0

        await _until(up, 30, "raw consumers")
        started = time.monotonic()
        await _batched(redis.lpush(key, "x") for _ in range(run.tasks))
        await _until(drained, 600, "raw consumers to drain")
        return time.monotonic() - started
    finally:
        consumers.stop()
        await redis.aclose()


ARQ_WORKER = """
import os
from arq.connections import RedisSettings

async def noop(ctx):
    return None

class WorkerSettings:
    functions = [noop]
    redis_settings = RedisSettings.from_dsn(os.environ["BENCH_REDIS"])
    queue_name = os.environ["BENCH_QUEUE"]
    max_jobs = int(os.environ["BENCH_CONCURRENCY"])
    poll_delay = 0.01
"""

ARQ_PRODUCER = """
import asyncio, os, sys, time
from arq import create_pool
from arq.connections import RedisSettings

async def main():
    queue, tasks = os.environ["BENCH_QUEUE"], int(sys.argv[1])
    redis = await create_pool(RedisSettings.from_dsn(os.environ["BENCH_REDIS"]), default_queue_name=queue)
    started = time.monotonic()
    for start in range(0, tasks, 500):
        await asyncio.gather(*(redis.enqueue_job("noop") for _ in range(min(500, tasks - start))))
    while await redis.zcard(queue) > 0:
        await asyncio.sleep(0.01)
    print(time.monotonic() - started)
    await redis.aclose()

asyncio.run(main())
"""


def arq_python() -> Path | None:
    """The throwaway venv's python with arq installed, or ``None`` (with the reason printed)."""
    python = ARQ_VENV / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import arq"], check=False).returncode == 0:
        return python
    try:
        subprocess.run([sys.executable, "-m", "venv", str(ARQ_VENV)], check=True, timeout=120)
        subprocess.run([python, "-m", "pip", "install", "-q", "arq"], check=True, timeout=300)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"arq baseline skipped: could not install arq into {ARQ_VENV}: {exc}")
        return None
    return python


async def bench_arq(run: Run, python: Path) -> float:
    """Seconds for arq workers to finish ``run.tasks`` no-op jobs."""
    code = run.logs / f"arq-{uuid.uuid4().hex[:8]}"
    code.mkdir()
    (code / "arq_bench_worker.py").write_text(textwrap.dedent(ARQ_WORKER))
    (code / "arq_bench_produce.py").write_text(textwrap.dedent(ARQ_PRODUCER))
    env = {**os.environ, "BENCH_REDIS": run.redis_url, "BENCH_QUEUE": f"arq:{code.name}"}
    env["BENCH_CONCURRENCY"] = str(run.concurrency)
    workers = Processes(run.logs)
    for _ in range(run.procs):
        workers.start([str(python.parent / "arq"), "arq_bench_worker.WorkerSettings"], cwd=code, env=env)
    try:

        async def up() -> bool:
            return workers.outputs().count("Starting worker") >= run.procs

        await _until(up, 30, "arq workers")
        producer = await asyncio.create_subprocess_exec(
            str(python), "arq_bench_produce.py", str(run.tasks), cwd=code, env=env, stdout=subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(producer.communicate(), 600)
        if producer.returncode != 0:
            raise RuntimeError(f"arq producer failed:\n{workers.outputs()}")
        return float(out.decode().strip().splitlines()[-1])
    finally:
        workers.stop()


def _cell(tasks: int, seconds: float | None) -> str:
    return "-" if seconds is None else f"{tasks / seconds:,.0f}/s"


def _ratio(ours: float | None, theirs: float | None) -> str:
    # throughput ratio = their time / our time
    return "-" if ours is None or theirs is None else f"{theirs / ours:.2f}x"


def report(tasks: int, results: dict[int, dict[str, float | None]]) -> str:
    counts = sorted(results)
    lines = [f"{'':<24}" + "".join(f"{f'{n} process(es)':>18}" for n in counts)]
    for name in ("raw", "arq", "modelgate"):
        lines.append(
            f"{name + ' tasks/s':<24}" + "".join(f"{_cell(tasks, results[n][name]):>18}" for n in counts)
        )
    for other in ("arq", "raw"):
        row = "".join(f"{_ratio(results[n]['modelgate'], results[n][other]):>18}" for n in counts)
        lines.append(f"{'modelgate / ' + other:<24}" + row)
    return "\n".join(lines)


async def bench(args: argparse.Namespace) -> None:
    python = None if args.skip_arq else arq_python()
    with tempfile.TemporaryDirectory(prefix="modelgate-bench-") as tmp:
        server = RedisProcess(Path(tmp))
        try:
            await server.ready()
            results: dict[int, dict[str, float | None]] = {}
            for procs in args.procs:
                run = Run(server.url, procs, args.tasks, args.concurrency, Path(tmp))
                print(f"{procs} process(es): raw ...", flush=True)
                results[procs] = {"raw": await bench_raw(run), "arq": None}
                if python is not None:
                    print(f"{procs} process(es): arq ...", flush=True)
                    results[procs]["arq"] = await bench_arq(run, python)
                print(f"{procs} process(es): modelgate ...", flush=True)
                results[procs]["modelgate"] = await bench_modelgate(run)
        finally:
            server.stop()
    print(f"\nno-op tasks: {args.tasks} per run, concurrency {args.concurrency} per worker process")
    print(report(args.tasks, results))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--procs", type=lambda s: [int(p) for p in s.split(",")], default=[1, 4])
    parser.add_argument("--skip-arq", action="store_true")
    parser.add_argument("--raw-consumer", nargs=3, metavar=("URL", "KEY", "CONCURRENCY"))
    args = parser.parse_args(argv)
    if args.raw_consumer:
        url, key, concurrency = args.raw_consumer
        asyncio.run(raw_consumer(url, key, int(concurrency)))
        return
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
