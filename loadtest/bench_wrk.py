"""wrk (Debian: ``apt-get install -y wrk``) as a second load generator, for non-stream requests.

wrk is written in C and is the usual yardstick: its numbers next to the Python client's show
that the client is not what limits a run. A generated Lua script sets the POST body and headers
and, in ``done()``, prints one JSON line with the request count and the per-request latency
percentiles wrk recorded (microseconds). wrk has no notion of a first token, so it measures
whole responses only; streams are left to :mod:`loadtest.bench_client`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

_SCRIPT = """\
wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
{auth}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {{\\"requests\\": %d, \\"duration_us\\": %d, \\"errors\\": %d, \\"non2xx\\": %d, " ..
    "\\"p50\\": %d, \\"p90\\": %d, \\"p99\\": %d}}\\n",
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99)))
end
"""


@dataclass(slots=True)
class WrkResult:
    requests: int
    seconds: float
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0


def available() -> bool:
    return shutil.which("wrk") is not None


def script(body: bytes, key: str | None) -> str:
    auth = f'wrk.headers["Authorization"] = "Bearer {key}"' if key else ""
    return _SCRIPT.format(body=body.decode(), auth=auth)


def _write_script(text: str) -> Path:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(text)
        return Path(f.name)


async def run_wrk(url: str, body: bytes, key: str | None, concurrency: int, seconds: float) -> WrkResult:
    """One wrk run (one thread, ``concurrency`` keep-alive connections)."""
    path = await asyncio.to_thread(_write_script, script(body, key))
    try:
        proc = await asyncio.create_subprocess_exec(
            "wrk",
            "-t1",
            f"-c{concurrency}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "10s",
            "-s",
            str(path),
            url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
    finally:
        await asyncio.to_thread(path.unlink, missing_ok=True)
    text = out.decode(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result:\n{text}")
    data = json.loads(line[8:])
    return WrkResult(
        requests=data["requests"],
        seconds=data["duration_us"] / 1e6,
        errors=data["errors"] + data["non2xx"],
        p50_ms=data["p50"] / 1000,
        p90_ms=data["p90"] / 1000,
        p99_ms=data["p99"] / 1000,
    )
