"""CPU placement for the benchmark: the servers under test on one core, everything else on another.

On a small machine the benchmark's own processes (load generator, mock upstream, Redis) compete
with the gateway for the same cores; in production the upstream is elsewhere and so, usually, is
Redis. Left to the scheduler, a burst of 64 requests finds all four processes wanting a core at
once, and the gateway's added latency then measures that contention as much as the gateway. With
``--pin`` (where there are at least two CPUs) the benchmark places the gateway worker
(and the other gateway's processes, when it can find them by their listening port) on the first
CPU it may use, and itself, the mock upstream and Redis on the second. The direct rows run with the
same placement of the mock and the generator, so every ratio still compares like with like.
Without ``--pin`` placement is the scheduler's. Linux only (``sched_setaffinity``, ``/proc``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_LISTEN = "0A"


def placement() -> tuple[int, int] | None:
    """(server CPU, everything-else CPU), or None where pinning is not possible."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


def pin(pid: int, cpu: int) -> None:
    """Put every thread of ``pid`` on ``cpu`` (threads and children it starts later inherit it)."""
    tasks = Path(f"/proc/{pid}/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.exists() else [pid]:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, {cpu})


def listening_pids(port: int) -> list[int]:
    """The processes holding a listening TCP socket on ``port`` (a server whose pid we were not
    told, e.g. another gateway started by hand), found through ``/proc``; [] if none is visible."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{inode}]")
    pids: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue  # gone, or not ours to look at
        if any(_link(fd) in inodes for fd in fds):
            pids.append(int(proc.name))
    return pids


def _link(fd: Path) -> str | None:
    try:
        return os.readlink(fd)
    except OSError:
        return None  # closed meanwhile (the listing's own descriptor, for one)
