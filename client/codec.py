"""Step outputs and results as JSON: how they are stored, replayed and what usage they carry.

msgspec encodes builtins, dataclasses and structs; pydantic models (every openai SDK response) go
through ``model_dump(mode="json")``. Anything else cannot be checkpointed and fails the task
(``Fatal``): retrying would fail the same way.
"""

from __future__ import annotations

from typing import Any

import msgspec

from client.errors import Fatal


def _enc_hook(obj: Any) -> Any:
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        return dump(mode="json")
    raise NotImplementedError(f"cannot store {type(obj).__name__} as JSON")


def encode(what: str, value: Any) -> str:
    try:
        return msgspec.json.encode(value, enc_hook=_enc_hook).decode()
    except (TypeError, NotImplementedError, msgspec.EncodeError) as exc:
        raise Fatal(f"{what} cannot be stored as JSON: {exc}") from exc


def decode(stored: str, returns: type[Any] | None = None) -> Any:
    """A stored value: plain JSON data, or ``returns`` built from it (pydantic or msgspec)."""
    data = msgspec.json.decode(stored)
    if returns is None:
        return data
    validate = getattr(returns, "model_validate", None)
    if callable(validate):
        return validate(data)
    return msgspec.convert(data, returns)


def usage(value: Any) -> tuple[int, int, int]:
    """``(requests, prompt_tokens, completion_tokens)`` of a chat completion (object or dict)."""
    found = value.get("usage") if isinstance(value, dict) else getattr(value, "usage", None)
    if isinstance(found, dict):
        prompt, completion = found.get("prompt_tokens"), found.get("completion_tokens")
    else:
        prompt = getattr(found, "prompt_tokens", None)
        completion = getattr(found, "completion_tokens", None)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return (0, 0, 0)
    return (1, prompt, completion)
