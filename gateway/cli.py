"""The ``modelgate`` command: serve the gateway, check a config, run the mock upstream."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.config import Config, ConfigError, load_config

EXIT_CONFIG = 1
EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelgate", description="OpenAI-compatible model gateway")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway (dev mode without a config)")
    serve.add_argument("--config", default=os.environ.get("MODELGATE_CONFIG"), help="config file (TOML)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--workers", type=int, default=1)
    serve.set_defaults(run=_serve)

    check = commands.add_parser("check-config", help="validate a config file")
    check.add_argument("file")
    check.set_defaults(run=_check_config)

    mock = commands.add_parser("mock-upstream", help="a fast fake OpenAI-compatible provider")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=int, default=9000)
    mock.add_argument("--latency-ms", type=float, default=0.0)
    mock.add_argument("--error-rate", type=float, default=0.0)
    mock.add_argument("--rate-429", type=float, default=0.0)
    mock.add_argument("--chunks", type=int, default=12)
    mock.set_defaults(run=_mock_upstream)

    from client.cli import add_commands  # worker and tasks verbs live with the queue client

    add_commands(commands)
    return parser


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return EXIT_CONFIG
    print(
        f"{args.file}: ok ({len(config.providers)} providers, {len(config.models)} models, "
        f"{len(config.tenants)} tenants)"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from gateway import server, tracing
    from gateway.app import create_app
    from gateway.devmode import dev_config
    from gateway.logs import configure_logging

    if args.workers < 1:
        print("modelgate serve: --workers must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if args.config is None:
        if args.workers > 1:
            print(
                "modelgate serve: --workers > 1 needs a config with [redis]; dev mode is one process",
                file=sys.stderr,
            )
            return EXIT_USAGE
        config, lines = dev_config(os.environ)
        for line in lines:
            print(line, flush=True)
    else:
        config_or_code = _load_for_serve(args.config)
        if isinstance(config_or_code, int):
            return config_or_code
        config = config_or_code
        if args.workers > 1 and config.redis is None:
            print(
                "modelgate serve: --workers > 1 needs [redis] in the config to share state", file=sys.stderr
            )
            return EXIT_USAGE
    configure_logging(config.server.log_level)
    options = server.server_options(args.host, args.port, config.server)
    if args.workers > 1:
        return _serve_workers(args.config, args.workers, options)
    tracing.configure_from_env()
    return server.run(create_app(config), options)


def _serve_workers(config_path: str, workers: int, options: dict[str, Any]) -> int:
    """Worker processes that each build the app from the config file and share metrics in files."""
    from gateway import server

    os.environ["MODELGATE_CONFIG"] = str(Path(config_path).resolve())
    os.environ["MODELGATE_WORKERS"] = str(workers)
    with tempfile.TemporaryDirectory(prefix="modelgate-metrics-") as directory:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        return server.run("gateway.asgi:app_from_env", options, workers=workers)


def _load_for_serve(path: str) -> Config | int:
    try:
        return load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"modelgate serve: {problem}", file=sys.stderr)
        return EXIT_CONFIG


def _mock_upstream(args: argparse.Namespace) -> int:
    from loadtest.mock_upstream import MockSettings, serve

    settings = MockSettings(
        latency_ms=args.latency_ms, error_rate=args.error_rate, rate_429=args.rate_429, chunks=args.chunks
    )
    serve(args.host, args.port, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
