"""The config file: TOML read into one frozen tree of msgspec structs, validated once at start.

Reading goes in three steps, each reporting every problem it finds with its field path
(``models[1].targets[0].provider: unknown provider 'x'``):

1. ``${NAME}`` / ``${NAME:-default}`` references in string values are filled from the environment;
2. each section is converted into its struct (unknown keys are errors, types and bounds checked);
3. cross-references are checked (targets name known providers, tenants name known models, ...).

A :class:`ConfigError` carries the whole list, so ``modelgate check-config`` can print them all.
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from gateway.config_fields import check_table, check_value, decode_secret, join
from gateway.secret import Secret

PositiveInt = Annotated[int, Meta(gt=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
"""Names of tenants, providers and the Redis prefix: they go into keys, metrics and logs."""
Name = Annotated[str, Meta(pattern=NAME_PATTERN)]

PROVIDER_TYPES = ("openai", "anthropic", "mock")


class ServerConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    admin_key: Secret | None = None
    max_body_bytes: PositiveInt = 4 * 1024 * 1024
    request_timeout_s: PositiveFloat = 300.0
    metrics_public: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    default_max_tokens: PositiveInt = 4096
    invalid_keys_per_minute: PositiveInt = 30
    shutdown_grace_s: PositiveFloat = 30.0
    max_messages: PositiveInt = 10_000
    max_header_bytes: Annotated[int, Meta(ge=1024)] = 32 * 1024
    client_timeout_s: PositiveFloat = 30.0
    idle_timeout_s: PositiveFloat = 5.0
    max_connections: PositiveInt = 4096


class RedisConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    url: Secret
    prefix: Name = "mg"
    on_failure: Literal["closed", "open"] = "closed"
    slot_lease_s: Annotated[float, Meta(ge=1, le=300)] = 15.0


class RetryConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    attempts: Annotated[int, Meta(ge=1, le=20)] = 3
    base_delay_ms: Annotated[int, Meta(ge=0)] = 200
    max_delay_ms: Annotated[int, Meta(ge=0)] = 5000


class BreakerConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    failure_threshold: PositiveInt = 5
    reset_timeout_s: PositiveFloat = 30.0
    half_open_max_calls: PositiveInt = 1


class ProviderConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Name
    type: str
    base_url: str | None = None
    api_key: Secret | None = None
    connect_timeout_s: PositiveFloat = 5.0
    read_timeout_s: PositiveFloat = 60.0
    rpm: PositiveInt | None = None
    tpm: PositiveInt | None = None
    max_concurrency: PositiveInt | None = None
    max_connections: PositiveInt = 512


class TargetConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    provider: str
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    weight: NonNegativeFloat = 1.0


class ModelConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    targets: Annotated[list[TargetConfig], Meta(min_length=1)]
    routing: Literal["fallback", "weighted"] = "fallback"
    input_usd_per_mtok: NonNegativeFloat = 0.0
    output_usd_per_mtok: NonNegativeFloat = 0.0


class BudgetConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    usd: NonNegativeFloat | None = None
    tokens: Annotated[int, Meta(ge=0)] | None = None
    period: Literal["day", "month", "total"] = "month"


class TenantConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Name
    keys: list[Secret] = msgspec.field(default_factory=list)
    rpm: PositiveInt | None = None
    tpm: PositiveInt | None = None
    max_concurrency: PositiveInt | None = None
    budget: BudgetConfig | None = None
    task_max_tokens: PositiveInt | None = None
    models: list[str] | None = None


class Config(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    server: ServerConfig = ServerConfig()
    redis: RedisConfig | None = None
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    providers: list[ProviderConfig] = msgspec.field(default_factory=list)
    models: list[ModelConfig] = msgspec.field(default_factory=list)
    tenants: list[TenantConfig] = msgspec.field(default_factory=list)


class ConfigError(Exception):
    """Every problem found in a config, each as ``path: message``."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def load_config(path: str | Path, env: dict[str, str] | None = None) -> Config:
    """Read, interpolate and validate the config file at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read: {exc.__class__.__name__}"]) from exc
    return parse_config(text, os.environ if env is None else env)


def parse_config(text: str, env: os._Environ[str] | dict[str, str]) -> Config:
    """Validate config text; raises :class:`ConfigError` listing every problem."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"<toml>: {exc}"]) from exc
    unset: list[str] = []
    raw = _interpolate(raw, "", env, unset)
    problems: list[str] = []
    valid = not unset
    config = _convert(raw, problems)
    valid = valid and not problems
    if config is not None:
        problems.extend(_cross_check(config, _names(raw, "providers"), _names(raw, "models")))
    if problems or not valid:
        unset_paths = tuple(p.partition(": ")[0] for p in unset)
        raise ConfigError(unset + [p for p in problems if not p.startswith(unset_paths)])
    assert config is not None
    return config


_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(value: Any, path: str, env: Any, problems: list[str]) -> Any:
    if isinstance(value, str):
        return _fill(value, path, env, problems)
    if isinstance(value, dict):
        return {k: _interpolate(v, join(path, k), env, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, f"{path}[{i}]", env, problems) for i, v in enumerate(value)]
    return value


def _fill(text: str, path: str, env: Any, problems: list[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return str(env[name])
        if default is not None:
            return default
        problems.append(f"{path}: environment variable {name} is not set")
        return ""

    return _REFERENCE.sub(replace, text)


_SECTIONS = ("server", "redis", "retry", "breaker", "providers", "models", "tenants")


def _convert(raw: dict[str, Any], problems: list[str]) -> Config | None:
    """The typed config; when some tables are invalid, a config of the valid ones only.

    The partial config lets the cross-reference checks run (and report) even when a table
    elsewhere is broken; the caller never returns it.
    """
    if check_table(raw, Config, "", problems):
        return msgspec.convert(raw, Config, dec_hook=decode_secret)
    if not isinstance(raw, dict):
        return None
    scratch: list[str] = []
    valid: dict[str, Any] = {}
    hints = typing.get_type_hints(Config, include_extras=True)
    for key in _SECTIONS:
        if key not in raw:
            continue
        value = raw[key]
        if isinstance(value, list):
            valid[key] = [v for v in value if check_value([v], hints[key], key, scratch)]
        elif check_value(value, hints[key], key, scratch):
            valid[key] = value
    try:
        return msgspec.convert(valid, Config, dec_hook=decode_secret)
    except msgspec.ValidationError:
        return None


def _names(raw: Any, section: str) -> set[str]:
    """Names of a section's entries as written, valid or not, so a broken entry is still known."""
    items = raw.get(section) if isinstance(raw, dict) else None
    if not isinstance(items, list):
        return set()
    return {item["name"] for item in items if isinstance(item, dict) and isinstance(item.get("name"), str)}


def _cross_check(config: Config, providers: set[str], models: set[str]) -> Iterator[str]:
    yield from _duplicates("providers", [p.name for p in config.providers])
    yield from _duplicates("models", [m.name for m in config.models])
    yield from _duplicates("tenants", [t.name for t in config.tenants])
    for i, provider in enumerate(config.providers):
        yield from _check_provider(provider, f"providers[{i}]")
    providers |= {p.name for p in config.providers}
    for i, model in enumerate(config.models):
        for j, target in enumerate(model.targets):
            if target.provider not in providers:
                yield f"models[{i}].targets[{j}].provider: unknown provider {target.provider!r}"
        if model.routing == "weighted" and not any(t.weight > 0 for t in model.targets):
            yield f"models[{i}].targets: weighted routing needs a target with weight > 0"
    models |= {m.name for m in config.models}
    for i, tenant in enumerate(config.tenants):
        yield from _check_tenant(tenant, f"tenants[{i}]", models)
    if config.retry.max_delay_ms < config.retry.base_delay_ms:
        yield "retry.max_delay_ms: must not be less than retry.base_delay_ms"
    if config.redis is not None and not config.redis.url.reveal().startswith(
        ("redis://", "rediss://", "unix://")
    ):
        yield "redis.url: must start with redis://, rediss:// or unix://"


def _duplicates(section: str, names: list[str]) -> Iterator[str]:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            yield f"{section}[{i}].name: duplicate name {name!r}"
        seen.add(name)


def _check_provider(provider: ProviderConfig, path: str) -> Iterator[str]:
    if provider.type not in PROVIDER_TYPES:
        expected = ", ".join(PROVIDER_TYPES)
        yield f"{path}.type: unknown provider type {provider.type!r} (expected one of {expected})"
        return
    if provider.type == "mock":
        return
    if not provider.base_url:
        yield f"{path}.base_url: required for a provider of type {provider.type!r}"
    elif not provider.base_url.startswith(("http://", "https://")):
        yield f"{path}.base_url: must start with http:// or https://"


def _check_tenant(tenant: TenantConfig, path: str, models: set[str]) -> Iterator[str]:
    for k, key in enumerate(tenant.keys):
        value = key.reveal()
        if value.startswith("sha256:"):
            if not re.fullmatch(r"[0-9a-fA-F]{64}", value.removeprefix("sha256:")):
                yield f"{path}.keys[{k}]: a sha256: key needs 64 hex digits"
        elif len(value) < 16:
            yield f"{path}.keys[{k}]: keys must be at least 16 characters"
    if tenant.budget is not None and (tenant.budget.usd is None) == (tenant.budget.tokens is None):
        yield f"{path}.budget: give exactly one of usd or tokens"
    for m, name in enumerate(tenant.models or []):
        if name not in models:
            yield f"{path}.models[{m}]: unknown model {name!r}"
