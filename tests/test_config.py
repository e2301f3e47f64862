"""The config file: a full valid config, one file per validation error, secrets, and ``check-config``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import (
    BudgetConfig,
    Config,
    ConfigError,
    ProviderConfig,
    TenantConfig,
    load_config,
    parse_config,
)
from gateway.secret import Secret

REPO = Path(__file__).resolve().parent.parent
CONFIGS = Path(__file__).resolve().parent / "configs"
VALID = CONFIGS / "valid.toml"
BAD = CONFIGS / "bad"

ADMIN_KEY = "admin-SECRET-4f1c2a9e7b3d"
OPENAI_KEY = "sk-openai-SECRET-8d7c6b5a4f3e"
ANTHROPIC_KEY = "sk-ant-SECRET-1a2b3c4d5e6f"
ACME_KEY = "acme-SECRET-key-0123456789abcdef"
REDIS_PASSWORD = "redis-SECRET-pw-9e8d7c"

VALID_ENV = {
    "MODELGATE_ADMIN_KEY": ADMIN_KEY,
    "OPENAI_API_KEY": OPENAI_KEY,
    "ANTHROPIC_API_KEY": ANTHROPIC_KEY,
    "ACME_KEY": ACME_KEY,
}
MULTI_ENV = {
    "ADMIN_KEY": ADMIN_KEY,
    "REDIS_PASSWORD": REDIS_PASSWORD,
    "OPENAI_API_KEY": OPENAI_KEY,
    "ACME_KEY": ACME_KEY,
}
SECRETS = (ADMIN_KEY, OPENAI_KEY, ANTHROPIC_KEY, ACME_KEY, REDIS_PASSWORD)

# Every variable any fixture references, so a subprocess never inherits one from the outer shell.
REFERENCED = (
    "MODELGATE_ADMIN_KEY",
    "REDIS_URL",
    "OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "ACME_KEY",
    "BATCH_KEY",
    "ADMIN_KEY",
    "REDIS_PASSWORD",
)


def load_valid(**extra: str) -> Config:
    return load_config(VALID, {**VALID_ENV, **extra})


def problems_of(name: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(BAD / f"{name}.toml", env or {})
    assert str(caught.value) == "\n".join(caught.value.problems)
    return caught.value.problems


def check_config(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in REFERENCED}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        env={**base, **env},
        cwd=REPO,
        timeout=60,
        check=False,
    )


# --- the valid config --------------------------------------------------------------------------


def test_valid_config_loads_every_section() -> None:
    config = load_valid()

    assert config.server.max_body_bytes == 4194304
    assert config.server.request_timeout_s == 300.0
    assert config.server.metrics_public is False
    assert config.server.log_level == "warning"
    assert config.server.default_max_tokens == 2048

    assert config.redis is not None
    assert config.redis.prefix == "mg"
    assert config.redis.on_failure == "open"

    assert (config.retry.attempts, config.retry.base_delay_ms, config.retry.max_delay_ms) == (4, 100, 4000)
    assert config.breaker.failure_threshold == 3
    assert config.breaker.reset_timeout_s == 15.0
    assert config.breaker.half_open_max_calls == 2

    assert [(p.name, p.type) for p in config.providers] == [
        ("openai", "openai"),
        ("claude", "anthropic"),
        ("local", "mock"),
    ]
    openai = config.providers[0]
    assert (openai.rpm, openai.tpm, openai.max_concurrency) == (10000, 2000000, 512)
    assert config.providers[1].read_timeout_s == 120.0
    assert config.providers[2].base_url is None
    assert config.providers[2].api_key is None

    fallback, weighted = config.models
    assert (fallback.name, fallback.routing) == ("gpt-4o-mini", "fallback")
    assert (fallback.input_usd_per_mtok, fallback.output_usd_per_mtok) == (0.15, 0.60)
    assert [(t.provider, t.model, t.weight) for t in fallback.targets] == [
        ("openai", "gpt-4o-mini", 1.0),
        ("local", "mock", 1.0),
    ]
    assert (weighted.name, weighted.routing) == ("smart", "weighted")
    assert [t.weight for t in weighted.targets] == [3.0, 1.0, 0.0]

    acme, batch = config.tenants
    assert acme.name == "acme"
    assert (acme.rpm, acme.tpm, acme.max_concurrency, acme.task_max_tokens) == (600, 200000, 20, 200000)
    assert acme.budget == BudgetConfig(usd=50.0, tokens=None, period="month")
    assert acme.models == ["gpt-4o-mini"]
    assert batch.name == "batch.jobs"
    assert batch.budget == BudgetConfig(usd=None, tokens=5000000, period="day")
    assert batch.models is None


def test_environment_references_are_filled() -> None:
    config = load_valid()
    assert config.server.admin_key is not None
    assert config.server.admin_key.reveal() == ADMIN_KEY
    openai, claude, _ = config.providers
    assert openai.api_key is not None
    assert openai.api_key.reveal() == OPENAI_KEY
    assert claude.api_key is not None
    assert claude.api_key.reveal() == ANTHROPIC_KEY
    assert config.tenants[0].keys[0].reveal() == ACME_KEY


def test_defaults_fill_unset_references() -> None:
    config = load_valid()
    assert config.redis is not None
    assert config.redis.url.reveal() == "redis://127.0.0.1:6379/0"
    assert config.providers[0].base_url == "https://api.openai.com/v1"
    assert config.tenants[1].keys[0].reveal() == "batch-key-default-0123456789"


def test_set_variables_win_over_defaults() -> None:
    config = load_valid(
        REDIS_URL="rediss://cache.internal:6380/2",
        OPENAI_BASE_URL="http://127.0.0.1:9000/v1",
        BATCH_KEY="batch-key-from-env-0123456789",
    )
    assert config.redis is not None
    assert config.redis.url.reveal() == "rediss://cache.internal:6380/2"
    assert config.providers[0].base_url == "http://127.0.0.1:9000/v1"
    assert config.tenants[1].keys[0].reveal() == "batch-key-from-env-0123456789"


def test_references_inside_strings_empty_defaults_and_no_recursion() -> None:
    text = """
[redis]
url = "redis://:${PW}@${HOST:-127.0.0.1}:6379/0"
prefix = "${PREFIX:-}mg"

[[tenants]]
name = "acme"
keys = ["${KEY}", "$PLAIN-not-a-reference-0123"]
"""
    config = parse_config(text, {"PW": "p@ss", "KEY": "${PW}-0123456789abcdef"})
    assert config.redis is not None
    assert config.redis.url.reveal() == "redis://:p@ss@127.0.0.1:6379/0"
    assert config.redis.prefix == "mg"
    # a value taken from the environment is not expanded a second time
    assert config.tenants[0].keys[0].reveal() == "${PW}-0123456789abcdef"
    assert config.tenants[0].keys[1].reveal() == "$PLAIN-not-a-reference-0123"


def test_load_config_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in VALID_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("REDIS_URL", "OPENAI_BASE_URL", "BATCH_KEY"):
        monkeypatch.delenv(name, raising=False)
    config = load_config(VALID)
    assert config.server.admin_key is not None
    assert config.server.admin_key.reveal() == ADMIN_KEY


def test_empty_config_takes_defaults() -> None:
    config = parse_config("", {})
    assert config.redis is None
    assert config.server.max_body_bytes == 4 * 1024 * 1024
    assert config.server.request_timeout_s == 300.0
    assert config.server.metrics_public is True
    assert (config.retry.attempts, config.retry.base_delay_ms, config.retry.max_delay_ms) == (3, 200, 5000)
    assert (config.breaker.failure_threshold, config.breaker.reset_timeout_s) == (5, 30.0)
    assert (config.providers, config.models, config.tenants) == ([], [], [])


def test_budget_period_defaults_to_month() -> None:
    text = '[[tenants]]\nname = "acme"\nbudget = { tokens = 1000 }\n'
    assert parse_config(text, {}).tenants[0].budget == BudgetConfig(tokens=1000, period="month")


# --- secrets -----------------------------------------------------------------------------------


def test_secrets_are_secret_instances() -> None:
    config = load_valid(REDIS_URL=f"redis://:{REDIS_PASSWORD}@127.0.0.1:6379/0")
    assert isinstance(config.server.admin_key, Secret)
    assert config.redis is not None
    assert isinstance(config.redis.url, Secret)
    assert all(isinstance(p.api_key, Secret) for p in config.providers[:2])
    assert all(isinstance(k, Secret) for t in config.tenants for k in t.keys)


def test_repr_of_config_does_not_contain_secrets() -> None:
    config = load_valid(REDIS_URL=f"redis://:{REDIS_PASSWORD}@127.0.0.1:6379/0")
    for text in (repr(config), str(config), repr(config.providers), repr(config.tenants[0])):
        for secret in SECRETS:
            assert secret not in text
    assert "Secret('**********')" in repr(config.providers[0])


def test_secret_reveals_only_on_request() -> None:
    secret = Secret(OPENAI_KEY)
    assert OPENAI_KEY not in repr(secret)
    assert OPENAI_KEY not in str(secret)
    assert OPENAI_KEY not in f"{secret}"
    assert secret.reveal() == OPENAI_KEY
    assert secret == Secret(OPENAI_KEY)
    assert secret != Secret(OPENAI_KEY + "x")


def test_config_structs_are_frozen() -> None:
    config = load_valid()
    with pytest.raises(AttributeError):
        config.server.max_body_bytes = 1  # type: ignore[misc]
    assert isinstance(config.providers[0], ProviderConfig)
    assert isinstance(config.tenants[0], TenantConfig)


# --- one bad file per validation error ---------------------------------------------------------

CASES = [
    ("unknown_top_level_key", ["logging: unknown field"]),
    ("unknown_section_key", ["server.bogus: unknown field"]),
    ("wrong_type", ["server.metrics_public: expected `bool`, got `str`"]),
    ("wrong_type_secret", ["providers[0].api_key: expected `str`, got `int`"]),
    ("negative_rpm", ["providers[0].rpm: expected `int` >= 1"]),
    ("missing_required", ["providers[1].name: required field is missing"]),
    (
        "unknown_provider_type",
        ["providers[0].type: unknown provider type 'azure-openai' (expected one of openai, anthropic, mock)"],
    ),
    ("openai_without_base_url", ["providers[1].base_url: required for a provider of type 'openai'"]),
    ("bad_base_url_scheme", ["providers[0].base_url: must start with http:// or https://"]),
    ("unknown_target_provider", ["models[0].targets[1].provider: unknown provider 'nope'"]),
    ("duplicate_provider", ["providers[1].name: duplicate name 'local'"]),
    ("duplicate_model", ["models[2].name: duplicate name 'mock'"]),
    ("duplicate_tenant", ["tenants[1].name: duplicate name 'acme'"]),
    ("tenant_unknown_model", ["tenants[0].models[1]: unknown model 'gpt-5'"]),
    ("short_tenant_key", ["tenants[0].keys[0]: keys must be at least 16 characters"]),
    ("malformed_sha256_key", ["tenants[0].keys[1]: a sha256: key needs 64 hex digits"]),
    ("budget_both", ["tenants[0].budget: give exactly one of usd or tokens"]),
    ("budget_neither", ["tenants[0].budget: give exactly one of usd or tokens"]),
    ("weighted_all_zero", ["models[0].targets: weighted routing needs a target with weight > 0"]),
    ("retry_delays", ["retry.max_delay_ms: must not be less than retry.base_delay_ms"]),
    ("redis_scheme", ["redis.url: must start with redis://, rediss:// or unix://"]),
    ("unset_env", ["providers[0].api_key: environment variable OPENAI_API_KEY is not set"]),
    # The unset variable is the one problem; its empty stand-in must not also be judged as a short key.
    ("unset_env_tenant_key", ["tenants[0].keys[0]: environment variable ACME_KEY is not set"]),
    (
        "toml_syntax",
        ["<toml>: Expected '=' after a key in a key/value pair (at line 3, column 16)"],
    ),
    # msgspec stops at the first error in a table; both problems of this one table should be reported.
    (
        "two_in_one_table",
        ["tenants[0].rpm: expected `int` >= 1", "tenants[0].budget.period: invalid enum value 'week'"],
    ),
]


@pytest.mark.parametrize(("name", "expected"), CASES, ids=[name for name, _ in CASES])
def test_bad_config_reports_exact_problems(name: str, expected: list[str]) -> None:
    assert sorted(problems_of(name)) == sorted(expected)


MULTI_PROBLEMS = [
    "server.bogus: unknown field",
    "retry.attempts: expected `int` >= 1",
    "providers[0].read_timeout_s: expected `float`, got `str`",
    "providers[1].name: required field is missing",
    "models[0].targets[0].wieght: unknown field",
    "tenants[0].rpm: expected `int` >= 1",
]


def test_problems_in_every_section_are_all_reported() -> None:
    assert sorted(problems_of("multi", MULTI_ENV)) == sorted(MULTI_PROBLEMS)


def test_structural_and_cross_reference_problems_are_reported_together() -> None:
    """A bad key in one section must not hide the broken references in the others."""
    assert sorted(problems_of("mixed")) == sorted(
        [
            "server.bogus: unknown field",
            "retry.max_delay_ms: must not be less than retry.base_delay_ms",
            "models[0].targets[0].provider: unknown provider 'nope'",
            "tenants[0].keys[0]: keys must be at least 16 characters",
            "tenants[0].models[0]: unknown model 'gpt-5'",
        ]
    )


def test_every_bad_fixture_has_a_test() -> None:
    covered = {name for name, _ in CASES} | {"multi", "mixed"}
    assert {path.stem for path in BAD.glob("*.toml")} == covered


def test_problems_do_not_contain_secret_values() -> None:
    problems = problems_of("multi", MULTI_ENV)
    text = "\n".join(problems)
    for secret in SECRETS:
        assert secret not in text


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(missing, {})
    assert caught.value.problems == [f"{missing}: cannot read: FileNotFoundError"]


def test_sections_of_the_wrong_shape() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config('providers = "openai"\nserver = 3\n', {})
    assert sorted(caught.value.problems) == sorted(
        ["providers: expected an array of tables, got a string", "server: expected a table, got int"]
    )


# --- modelgate check-config ------------------------------------------------------------------


def test_check_config_accepts_the_valid_file() -> None:
    result = check_config(VALID, VALID_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{VALID}: ok (3 providers, 2 models, 2 tenants)"
    assert result.stderr == ""
    for secret in SECRETS:
        assert secret not in result.stdout


def test_check_config_prints_every_problem_and_no_secret() -> None:
    result = check_config(BAD / "multi.toml", MULTI_ENV)
    assert result.returncode == 1
    assert result.stdout == ""
    assert sorted(result.stderr.splitlines()) == sorted(MULTI_PROBLEMS)
    for secret in SECRETS:
        assert secret not in result.stderr
        assert secret not in result.stdout


def test_check_config_reports_an_unset_variable() -> None:
    result = check_config(VALID, {k: v for k, v in VALID_ENV.items() if k != "OPENAI_API_KEY"})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "providers[0].api_key: environment variable OPENAI_API_KEY is not set"
    ]


def test_check_config_reports_a_non_string_secret_without_a_traceback() -> None:
    result = check_config(BAD / "wrong_type_secret.toml", {})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == ["providers[0].api_key: expected `str`, got `int`"]


def test_check_config_reports_a_syntax_error() -> None:
    result = check_config(BAD / "toml_syntax.toml", {})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "<toml>: Expected '=' after a key in a key/value pair (at line 3, column 16)"
    ]


def test_the_example_config_is_valid() -> None:
    example = Path(__file__).resolve().parent.parent / "modelgate.example.toml"
    config = parse_config(example.read_text(), {"MODELGATE_ADMIN_KEY": "admin-key-0123456789"})
    assert [p.name for p in config.providers] == ["openai", "anthropic", "local"]
    assert config.providers[0].api_key is not None and config.providers[0].api_key.reveal() == ""
