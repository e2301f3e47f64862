"""The mock upstream's behaviour knobs, and their validation for the CLI and the control API.

One dataclass holds everything the mock can be told (latency, random error rates, reply size and
the fault mode). Command-line values and ``POST /_mock/config`` patches go through the same
msgspec-checked shape, so an unknown field or an out-of-range value is refused the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import UNSET, Meta, UnsetType

Mode = Literal["ok", "status", "hang", "garbage", "stall", "close_mid_body"]
MODES: tuple[str, ...] = get_args(Mode)


@dataclass
class MockSettings:
    """How the mock upstream answers. ``chunk_delay_ms`` > 0 is the "pause" fault."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    """A non-zero latency gets a uniform draw from [-jitter_ms, +jitter_ms] added (at least 0 in all)."""
    error_rate: float = 0.0
    rate_429: float = 0.0
    chunks: int = 12
    chunk_delay_ms: float = 0.0
    mode: str = "ok"
    status: int = 500
    stall_after: int = 2


_NonNegative = Annotated[float, Meta(ge=0)]
_Fraction = Annotated[float, Meta(ge=0, le=1)]


class SettingsPatch(msgspec.Struct, forbid_unknown_fields=True):
    """Any subset of :class:`MockSettings`, each field type- and range-checked."""

    latency_ms: _NonNegative | UnsetType = UNSET
    jitter_ms: _NonNegative | UnsetType = UNSET
    error_rate: _Fraction | UnsetType = UNSET
    rate_429: _Fraction | UnsetType = UNSET
    chunks: Annotated[int, Meta(ge=1)] | UnsetType = UNSET
    chunk_delay_ms: _NonNegative | UnsetType = UNSET
    mode: Mode | UnsetType = UNSET
    status: Annotated[int, Meta(ge=400, le=599)] | UnsetType = UNSET
    stall_after: Annotated[int, Meta(ge=0)] | UnsetType = UNSET


class SettingsError(ValueError):
    """Settings or a settings patch that the mock refuses."""


def _apply(settings: MockSettings, patch: SettingsPatch) -> MockSettings:
    changes = {f: getattr(patch, f) for f in patch.__struct_fields__ if getattr(patch, f) is not UNSET}
    result = dataclasses.replace(settings, **changes)
    if result.error_rate + result.rate_429 > 1:
        raise SettingsError("error_rate + rate_429 must not exceed 1")
    return result


def validate(settings: MockSettings) -> MockSettings:
    """``settings`` if every field is acceptable, else :class:`SettingsError`."""
    try:
        patch = msgspec.convert(dataclasses.asdict(settings), SettingsPatch)
    except msgspec.ValidationError as exc:
        raise SettingsError(str(exc)) from exc
    return _apply(settings, patch)


def patched(settings: MockSettings, body: bytes) -> MockSettings:
    """``settings`` with the JSON object ``body`` applied, or :class:`SettingsError`."""
    try:
        patch = msgspec.json.decode(body or b"{}", type=SettingsPatch)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SettingsError(str(exc)) from exc
    return _apply(settings, patch)


def as_dict(settings: MockSettings) -> dict[str, Any]:
    return dataclasses.asdict(settings)
