"""The benchmark's CPU placement helpers, on real processes and sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from loadtest import bench_pin

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sched_setaffinity and /proc")


def test_the_process_holding_a_listening_port_is_found() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        assert bench_pin.listening_pids(port) == []  # bound, not listening yet
        listener.listen()
        assert bench_pin.listening_pids(port) == [os.getpid()]


def test_every_thread_of_a_process_is_placed() -> None:
    cpu = max(os.sched_getaffinity(0))
    script = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        tasks = f"/proc/{child.pid}/task"
        deadline = time.monotonic() + 10
        while len(os.listdir(tasks)) < 2:
            assert time.monotonic() < deadline, "the child's thread did not start"
        bench_pin.pin(child.pid, cpu)
        assert {os.sched_getaffinity(int(tid)) == {cpu} for tid in os.listdir(tasks)} == {True}
    finally:
        child.kill()
        child.wait()
