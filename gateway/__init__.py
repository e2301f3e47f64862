"""The modelgate gateway: an OpenAI-compatible boundary between agent workers and model providers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # Imported lazily so that light CLI verbs (check-config) do not load the web framework.
    if name == "create_app":
        from gateway.app import create_app

        return create_app
    raise AttributeError(name)
