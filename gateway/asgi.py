"""Entry point for server worker processes: builds the app from ``MODELGATE_CONFIG``.

With ``--workers N`` the server imports this factory in each worker process, so every worker
reads the same validated config file itself, sets up its own tracing from the ``OTEL_*``
variables, and marks its drain on SIGTERM for ``/readyz``.
"""

from __future__ import annotations

import os

from litestar import Litestar

from gateway import shutdown, tracing
from gateway.app import create_app
from gateway.config import load_config
from gateway.logs import configure_logging


def app_from_env() -> Litestar:
    config = load_config(os.environ["MODELGATE_CONFIG"])
    configure_logging(config.server.log_level)
    tracing.configure_from_env()
    shutdown.mark_on_signals()
    return create_app(config, workers=int(os.environ.get("MODELGATE_WORKERS", "1")))
