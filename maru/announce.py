"""Messages logged once per process: how a slower path, a fallback or an outage says so.

Every layer may import this module (it imports only the standard library). A key is announced
once until ``forget(key)`` says the condition ended, so a dead server or a slow path produces one
line, not one per step nor one per component sharing the process.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

_lock = threading.Lock()
_announced: set[str] = set()


def first_time(key: str) -> bool:
    """True the first time ``key`` is seen (until ``forget(key)``): for announcements of several lines."""
    with _lock:
        if key in _announced:
            return False
        _announced.add(key)
        return True


def announce_once(logger: logging.Logger, key: str, level: int, msg: str, *args: Any) -> bool:
    """Log ``msg % args`` at ``level`` on ``logger`` unless ``key`` was announced; True if logged."""
    if not first_time(key):
        return False
    logger.log(level, msg, *args)
    return True


def forget(key: str) -> bool:
    """Let ``key`` be announced again (its condition ended). True if it had been announced."""
    with _lock:
        if key in _announced:
            _announced.discard(key)
            return True
        return False


def announced(key: str) -> bool:
    """Whether ``key`` was announced (and not forgotten) in this process."""
    with _lock:
        return key in _announced
