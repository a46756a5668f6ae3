"""On/off switches read from the environment (the A/Bs and diagnostics a user turns on by hand).

One reading for every ``MARU_*`` switch, so that none is misread silently: ``1``, ``true``,
``yes``, ``on`` (any case) turn it on; unset, empty, ``0``, ``false``, ``no``, ``off`` leave it
off; anything else leaves it off and is announced once at warning with what is accepted (a
``MARU_FUSED_LOAD_CHECKSUM=enabled`` that did nothing, unsaid, would be a measurement of the
wrong thing).
"""

from __future__ import annotations

import logging
import os

from maru.announce import announce_once

log = logging.getLogger("maru")

ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"", "0", "false", "no", "off"})
_MISREAD: dict[str, str] = {}  # switch -> the value it was read with that is not a switch value


def flag(name: str) -> bool:
    """Whether switch ``name`` is on (see the module docstring; an unknown value: off, announced)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in ON:
        return True
    if value not in OFF:
        _MISREAD[name] = raw
        announce_once(log, f"env-flag.{name}", logging.WARNING, "maru: %s", _note(name, raw))
    else:
        _MISREAD.pop(name, None)
    return False


def _note(name: str, raw: str) -> str:
    return (
        f"{name}={raw!r} is not a switch value (on: 1, true, yes, on; off: 0, false, no, off): it is "
        f"left off. Fix: set {name}=1 or unset it"
    )


def misread() -> list[str]:
    """Each switch read so far with a value that is not a switch value, as a slow-path note (what
    happened, what to do): the worker reports them to ``maru doctor`` and ``maru stats``."""
    return [_note(name, raw) for name, raw in sorted(_MISREAD.items())]
