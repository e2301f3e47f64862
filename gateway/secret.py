"""A string that must never be printed: upstream keys, tenant keys, the admin key, Redis URLs.

Wrapping secrets in their own type means a ``repr`` of the config, a log line or an error message
cannot leak them by accident; code that really needs the value calls :meth:`Secret.reveal`.
"""

from __future__ import annotations

import hashlib
import hmac


class Secret:
    """An opaque secret string; its repr and str are redacted."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash(self._value)


def key_hash(key: str) -> str:
    """The stored form of an API key: lowercase hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def stored_key_hash(configured: str) -> str:
    """Hash of a configured key, which may already be given as ``sha256:<hex>``."""
    if configured.startswith("sha256:"):
        return configured.removeprefix("sha256:").lower()
    return key_hash(configured)
