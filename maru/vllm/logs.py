"""The connector's logger and its one announcement that comes and goes: the server is unreachable.

In vLLM's in-process mode the scheduler-side and worker-side connectors share one process; a
dead server must produce one warning there, not one per side nor one per step (``maru.announce``).
"""

from __future__ import annotations

import logging

from maru.announce import announce_once, forget

logger = logging.getLogger("maru.vllm")

UNREACHABLE_MSG = (
    "Maru: cannot reach maru server at %s (%s); vLLM computes every prompt itself (no loads, no stores) "
    "until it is reachable again (retrying every %.0f s). Start it with `maru server` or fix maru_server_url."
)


def _key(url: str) -> str:
    return f"vllm.unreachable:{url}"


def warn_unreachable(url: str, why: str, retry_s: float) -> None:
    """Warn once (per process, until ``reconnected``) that the server at ``url`` cannot be reached."""
    announce_once(logger, _key(url), logging.WARNING, UNREACHABLE_MSG, url, why, retry_s)


def reconnected(url: str) -> None:
    """The server at ``url`` answers again: say so if it had been announced unreachable."""
    if forget(_key(url)):
        logger.warning("Maru: reconnected to maru server at %s", url)
