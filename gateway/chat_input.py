"""Reading a chat request: only the fields the gateway needs, with a 400 that names what is wrong."""

from __future__ import annotations

import re

import msgspec

from gateway.errors import InvalidRequest
from providers.base import ChatHead

ID_PATTERN = r"[A-Za-z0-9._:-]{1,128}"
"""Client-chosen ids (``X-Task-Id``, ``X-Request-Id``): safe in keys, metrics and log lines."""
TASK_ID = re.compile(ID_PATTERN)
TRACE_HEADERS = ("traceparent", "tracestate")
_decode_head = msgspec.json.Decoder(ChatHead).decode
_MISSING_FIELD = re.compile(r"Object missing required field `([^`]+)`")
_HEADROOM_FRAMES = 64
"""Stack frames kept free while the body is first decoded (see :func:`_decode`)."""


def parse_head(body: bytes) -> ChatHead:
    """The fields the gateway reads, or a 400 naming what is wrong."""
    try:
        return _decode(body)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `$")
        param = where.rstrip("`").lstrip(".") or None
        missing = _MISSING_FIELD.match(message)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        detail = message[:1].lower() + message[1:]
        raise InvalidRequest(f"invalid request body: {detail}", param=param) from None
    except msgspec.DecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None
    except RecursionError:
        # msgspec recurses once per level of nesting, even while skipping a field it does not
        # decode, so a body of ~1,000 nested arrays or objects (anywhere) exhausts the stack. It
        # used to escape as a 500; no real request nests that deep.
        raise InvalidRequest("the request body is nested too deeply") from None


def _decode(body: bytes, headroom: int = _HEADROOM_FRAMES) -> ChatHead:
    """``_decode_head(body)``, run ``headroom`` frames deeper than needed.

    msgspec's nesting limit is whatever is left of the interpreter's recursion limit (Python 3.11:
    Python frames and msgspec's nesting share one budget). The adapters decode the same body again
    a few frames deeper (to rename the model, to translate it for Anthropic), so a body nested just
    under the limit here would pass this check and fail there, after admission. Decoding it here
    with frames to spare refuses it before admission instead; the spare frames cost about two
    microseconds. (The adapters still turn a RecursionError into a 400 of their own.)
    """
    return _decode(body, headroom - 1) if headroom else _decode_head(body)


def task_id_of(value: str | None) -> str | None:
    """A valid ``X-Task-Id`` or None; 400 for anything else."""
    if value is None:
        return None
    if not TASK_ID.fullmatch(value):
        raise InvalidRequest("X-Task-Id must be 1-128 characters of [A-Za-z0-9._:-]", param="X-Task-Id")
    return value
