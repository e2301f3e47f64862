"""JSON logs: one object per line on stderr, so operators can follow a request by its id.

Callers pass structured fields (``log.info("request", extra={"fields": {...}})``); the formatter
writes them beside the time, level and message. Secrets never reach a log line: the code logs
names, hashes and codes, never keys or upstream bodies.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import msgspec

_encode = msgspec.json.Encoder(decimal_format="number").encode


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info and record.exc_info[0] is not None:
            entry["exc_type"] = record.exc_info[0].__name__
            # Only unexpected errors are logged with exc_info; their traceback (code locations,
            # no local values) is what an operator needs to report them.
            entry["traceback"] = self.formatException(record.exc_info)[-4000:]
        return _encode(entry).decode()


def configure_logging(level: str) -> None:
    """Send every logger's records, ours and the server's, as JSON to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
