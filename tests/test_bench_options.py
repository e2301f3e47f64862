"""The benchmark's choice of settings: ``--latencies``, ``--modes`` and ``--concurrency``."""

from __future__ import annotations

import pytest

from loadtest.bench import _parser, _plan


def test_one_setting_can_be_picked() -> None:
    plan = _plan(_parser().parse_args(["--latencies", "50", "--modes", "stream", "--concurrency", "64"]))
    assert (plan.latencies, plan.streams, plan.concurrencies) == ((50.0,), (True,), (64,))


def test_the_full_matrix_is_the_default() -> None:
    plan = _plan(_parser().parse_args([]))
    assert (plan.latencies, plan.streams, plan.concurrencies) == ((0.0, 50.0), (False, True), (1, 16, 64))


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--modes", "wole", "modes are whole and stream, not wole"),
        ("--latencies", "5,x", "not comma-separated milliseconds"),
        ("--latencies", "-1", "0 ms or more"),
    ],
)
def test_a_bad_setting_is_refused_with_a_clear_message(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args([option, value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
