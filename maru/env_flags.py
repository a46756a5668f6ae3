"""On/off switches read from the environment (the A/Bs and diagnostics a user turns on by hand).

One reading for every ``MARU_*`` switch, so that none is misread silently: ``1``, ``true``,
``yes``, ``on`` (any case) turn it on; ``0``, ``false``, ``no``, ``off`` turn it off; unset or
empty leaves the switch's default (off for the A/Bs and diagnostics, on for the few measured ways
that are the default and can be turned off, e.g. ``MARU_FUSED_LOAD_CHECKSUM``); anything else
leaves the default and is announced once at warning with what is accepted (a
``MARU_THREAD_CENSUS=enabled`` that did nothing, unsaid, would be a measurement of the wrong
thing).
"""

from __future__ import annotations

import logging
import os

from maru.announce import announce_once

log = logging.getLogger("maru")

ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"0", "false", "no", "off"})
# switch -> (the value it was read with that is not a switch value, the default it was left at)
_MISREAD: dict[str, tuple[str, bool]] = {}
# Switches that did something once and no longer do, and why: one still set is said (``retired``).
RETIRED = {
    "MARU_NATIVE_STORE_ISSUE": (
        "the compiled store issue was removed (measured no faster in real vLLM, bench/RESULTS.md "
        "fifty-ninth pass; write-behind stores now queue two libcudart calls a chunk from Python)"
    ),
}


def flag(name: str, default: bool = False) -> bool:
    """Whether switch ``name`` is on: its value, ``default`` when unset or empty (see the module
    docstring; an unknown value: the default, announced)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in ON or value in OFF or not value:
        _MISREAD.pop(name, None)
        return value in ON or (not value and default)
    _MISREAD[name] = (raw, default)
    announce_once(log, f"env-flag.{name}", logging.WARNING, "maru: %s", _note(name, raw, default))
    return default


def _note(name: str, raw: str, default: bool = False) -> str:
    state, fix = ("on", f"{name}=0") if default else ("off", f"{name}=1")
    return (
        f"{name}={raw!r} is not a switch value (on: 1, true, yes, on; off: 0, false, no, off): it is "
        f"left {state}, its default. Fix: set {fix} or unset it"
    )


def misread() -> list[str]:
    """Each switch read so far with a value that is not a switch value, and each retired switch
    still set (``retired``), as a slow-path note (what happened, what to do): the worker reports
    them to ``maru doctor`` and ``maru stats``."""
    return [_note(name, raw, default) for name, (raw, default) in sorted(_MISREAD.items())] + retired()


def retired() -> list[str]:
    """A note for each switch of ``RETIRED`` set in the environment (announced once at warning):
    a setting that silently did nothing would be a measurement of the wrong thing."""
    out = []
    for name, why in RETIRED.items():
        if os.environ.get(name, "").strip():
            note = f"{name} is set but no longer does anything: {why}. Fix: unset it"
            announce_once(log, f"env-flag-retired.{name}", logging.WARNING, "maru: %s", note)
            out.append(note)
    return out
