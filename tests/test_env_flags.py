"""``maru.env_flags.flag``: every ``MARU_*`` switch reads one way, and a value it does not know is
said, not guessed (the switches: the fused load checksum, the thread census and its GIL timing,
the raw calls' GIL release)."""

from __future__ import annotations

import logging

import pytest

from maru.announce import forget
from maru.env_flags import flag, misread

NAME = "MARU_TEST_SWITCH"


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "On", " on "])
def test_on_values(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(NAME, value)
    assert flag(NAME) is True


@pytest.mark.parametrize("value", [None, "", "0", "false", "No", "OFF"])
def test_off_values_are_off_and_quiet(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    forget(f"env-flag.{NAME}")
    with caplog.at_level(logging.WARNING, logger="maru"):
        assert flag(NAME) is False
    assert not caplog.records


def test_an_unknown_value_is_off_and_said_once_with_what_is_accepted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(NAME, "enabled")
    forget(f"env-flag.{NAME}")
    with caplog.at_level(logging.WARNING, logger="maru"):
        assert flag(NAME) is False
        assert flag(NAME) is False
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1
    assert NAME in said[0] and "'enabled'" in said[0] and "true" in said[0] and "left off" in said[0]
    # Reported to maru doctor / maru stats (the worker's slow paths) until it reads a real value.
    notes = [n for n in misread() if NAME in n]
    assert len(notes) == 1 and "'enabled'" in notes[0] and "Fix:" in notes[0]
    monkeypatch.setenv(NAME, "0")
    assert flag(NAME) is False and not [n for n in misread() if NAME in n]


def test_a_switch_on_by_default_reads_its_default_when_unset_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(NAME, raising=False)
    assert flag(NAME, default=True) is True
    monkeypatch.setenv(NAME, "")
    assert flag(NAME, default=True) is True
    monkeypatch.setenv(NAME, "0")
    assert flag(NAME, default=True) is False
    monkeypatch.setenv(NAME, "no")
    assert flag(NAME, default=True) is False
    monkeypatch.setenv(NAME, "1")
    assert flag(NAME, default=True) is True
    # An unknown value keeps the default, and the note says which and how to turn it off.
    monkeypatch.setenv(NAME, "disabled")
    forget(f"env-flag.{NAME}")
    with caplog.at_level(logging.WARNING, logger="maru"):
        assert flag(NAME, default=True) is True
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "left on" in said[0] and f"{NAME}=0" in said[0]
    notes = [n for n in misread() if NAME in n]
    assert len(notes) == 1 and "left on" in notes[0]
    monkeypatch.setenv(NAME, "off")
    assert flag(NAME, default=True) is False and not [n for n in misread() if NAME in n]


@pytest.mark.parametrize(
    "module, name, read",
    [
        ("maru.kv_ops.chunk_loads", "FUSED_ENV", "fused_checksums_wanted"),
        ("maru.gil_calls", "ENV", "enabled"),
    ],
)
def test_the_switches_read_through_it(
    monkeypatch: pytest.MonkeyPatch, module: str, name: str, read: str
) -> None:
    import importlib

    mod = importlib.import_module(module)
    env = getattr(mod, name)
    monkeypatch.setenv(env, "true")
    assert getattr(mod, read)() is True
    monkeypatch.setenv(env, "off")
    assert getattr(mod, read)() is False


def test_the_gil_release_note_follows_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from maru.kv_ops import cuda_sync

    monkeypatch.setenv(cuda_sync.RELEASE_GIL_ENV, "yes")
    assert cuda_sync.gil_note() is not None
    monkeypatch.setenv(cuda_sync.RELEASE_GIL_ENV, "false")
    assert cuda_sync.gil_note() is None


def test_a_retired_switch_still_set_is_said_once_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from maru import env_flags

    forget("env-flag-retired.MARU_NATIVE_STORE_ISSUE")
    monkeypatch.delenv("MARU_NATIVE_STORE_ISSUE", raising=False)
    assert env_flags.retired() == []
    monkeypatch.setenv("MARU_NATIVE_STORE_ISSUE", "1")
    with caplog.at_level("WARNING", logger="maru"):
        notes = env_flags.misread()
        env_flags.misread()
    [note] = [n for n in notes if "MARU_NATIVE_STORE_ISSUE" in n]
    assert "no longer does anything" in note and "Fix: unset it" in note
    said = [r.getMessage() for r in caplog.records if "MARU_NATIVE_STORE_ISSUE" in r.getMessage()]
    assert len(said) == 1
