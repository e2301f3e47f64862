"""Dev mode: the config used when ``modelgate serve`` is given none.

One process, in-process state, the built-in mock provider serving model ``mock`` and one tenant
``dev``. Keys come from ``MODELGATE_DEV_KEY`` / ``MODELGATE_ADMIN_KEY`` or are generated and
printed once, so a first command gives a working endpoint with no other service.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from gateway.config import Config, ModelConfig, ProviderConfig, ServerConfig, TargetConfig, TenantConfig
from gateway.secret import Secret

WARNING = (
    "warning: dev mode: state is in-process, neither shared between processes nor durable; "
    "give a config file with [redis] for production"
)


def dev_config(env: Mapping[str, str]) -> tuple[Config, list[str]]:
    """The dev-mode config and the lines to print at start (the warning, then each generated key)."""
    lines = [WARNING]
    tenant_key = env.get("MODELGATE_DEV_KEY") or _generated("dev tenant key", lines)
    admin_key = env.get("MODELGATE_ADMIN_KEY") or _generated("admin key", lines)
    config = Config(
        server=ServerConfig(admin_key=Secret(admin_key)),
        providers=[ProviderConfig(name="mock", type="mock")],
        models=[ModelConfig(name="mock", targets=[TargetConfig(provider="mock", model="mock")])],
        tenants=[TenantConfig(name="dev", keys=[Secret(tenant_key)])],
    )
    return config, lines


def _generated(label: str, lines: list[str]) -> str:
    key = "mg-" + secrets.token_urlsafe(24)
    lines.append(f"{label}: {key}")
    return key
