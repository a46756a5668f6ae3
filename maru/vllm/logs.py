"""The connector's logger, and announcements made once per process.

In vLLM's in-process mode the scheduler-side and worker-side connectors share one process; a
dead server must still produce one warning there, not one per side (nor one per step).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger("maru.vllm")

_lock = threading.Lock()
_announced: set[str] = set()


def warn_once(key: str, msg: str, *args: Any) -> bool:
    """Log ``msg`` as a warning unless ``key`` was announced already (until ``forget(key)``)."""
    with _lock:
        if key in _announced:
            return False
        _announced.add(key)
    logger.warning(msg, *args)
    return True


def forget(key: str) -> bool:
    """Allow ``key`` to be announced again (the condition ended). True if it had been announced."""
    with _lock:
        if key in _announced:
            _announced.discard(key)
            return True
        return False


def unreachable_key(url: str) -> str:
    return f"unreachable:{url}"


UNREACHABLE_MSG = (
    "Maru: cannot reach maru server at %s (%s); vLLM computes every prompt itself (no loads, no stores) "
    "until it is reachable again (retrying every %.0f s). Start it with `maru server` or fix maru_server_url."
)
