"""``modelgate serve`` as a process: worker count rules and multi-worker serving."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import openai

from tests.conftest import TENANT_KEY, gateway_config
from tests.harness import Gateway, MockUpstream, RedisServer


def test_several_workers_without_redis_exit_2_with_one_line(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[providers]]\nname = "m"\ntype = "mock"\n')
    for args in (["--workers", "2"], ["--workers", "2", "--config", str(config)]):
        result = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 2
        assert len(result.stderr.strip().splitlines()) == 1
        assert "redis" in result.stderr.lower()


def test_two_workers_serve(session_tmp: Path, upstream: MockUpstream, redis_server: RedisServer) -> None:
    config = gateway_config(upstream.url) + f'\n[redis]\nurl = "{redis_server.url}"\n'
    process = Gateway(session_tmp, config, workers=2).start()
    try:
        client = openai.OpenAI(base_url=f"{process.url}/v1", api_key=TENANT_KEY, max_retries=0)
        for _ in range(10):
            reply = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "x"}])
            assert reply.choices[0].message.content
    finally:
        assert process.stop() == 0
