"""The scheduler side's server connection (a mixin of ``MaruSchedulerConnector``): connecting,
reconnecting after a back-off, dropping a lost client, and reporting how this side's probes
reach the pool (``maru stats``, ``maru doctor``).

Nothing here raises into vLLM's scheduler: an unreachable server is warned about once a back-off
and the probes find nothing meanwhile (vLLM computes every prompt).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from maru.client.gil_io import slow_note
from maru.vllm import thread_census
from maru.vllm.config import MaruConnectorConfig, reply_wait_mode
from maru.vllm.keys import ChunkKeyer
from maru.vllm.logs import reconnected, warn_unreachable
from maru.vllm.sampled_profile import slow_note as profiling_note

logger = logging.getLogger("maru.vllm")

_RECONNECT_S = 10.0


class SchedulerClient:
    """``connect_now``, ``probe_view`` and the client's life (``_get_client``, ``_drop_client``)."""

    # Set by MaruSchedulerConnector.__init__ (or its other mixins).
    cfg: MaruConnectorConfig
    keyer: ChunkKeyer
    load_sharing: str
    offer_pins_mode: str
    at_offer_note: str | None
    _client: Any
    _client_factory: Any
    _next_connect: float
    _reported_path: str | None
    _unshared: str | None
    _share_timeout_note: str | None
    _withheld_note: str | None
    _skip_notes: list[str]

    def probe_view(self) -> dict[str, Any]:
        """How prefix probes reach the pool (the key index, or a server round trip, and why)."""
        local = getattr(self._client, "local_exists", None)
        if local is None:
            return {"probe_path": "no server connection"}
        n = local.counts()
        return {
            "probe_path": local.path,
            "probes_local": n["exists_local"],
            "probes_remote": n["exists_remote"],
            # How this side's round trips waited (maru_scheduler_reply_spin_us): polled, or blocked.
            "reply_waits": getattr(self._client, "reply_waits", {}),
        }

    def connect_now(self) -> bool:
        """Connect at engine start rather than in the first request's probe (a handshake and the
        report of this side's paths: 2.2-2.8 ms measured in real vLLM, paid before the engine
        serves; ``maru stats`` lists the scheduler from then on). An unreachable server is warned
        about once, as at a probe, and tried again at the first probe after the back-off."""
        try:
            return self._get_client() is not None
        except Exception:  # never take the engine down for Maru
            logger.exception("Maru: connecting the scheduler side at start failed")
            return False

    def _get_client(self) -> Any:
        if self._client is not None:
            return self._client
        now = time.monotonic()
        if now < self._next_connect or self._client_factory is None:
            return None
        try:
            self._client = self._client_factory()
        except Exception as e:  # never raise into vLLM's scheduler
            self._next_connect = now + _RECONNECT_S
            warn_unreachable(self.cfg.server_url, _describe(e), _RECONNECT_S)
            return None
        reconnected(self.cfg.server_url)
        self._reported_path = None
        self._report_path()
        return self._client

    def _report_path(self) -> None:
        """Tell the server (``maru stats``, ``maru doctor``) how this scheduler's probes reach the
        pool, again whenever that changes (a handshake with a restarted server may change it)."""
        local = getattr(self._client, "local_exists", None)
        report = getattr(self._client, "set_client_info", None)
        if local is None or report is None or local.path == self._reported_path:
            return
        self._reported_path = local.path
        try:
            report(
                {
                    "role": "vllm-scheduler",
                    "paths": {
                        "exists": local.path,
                        "async_load_sharing": self.load_sharing,
                        "offer_pins": self.offer_pins_mode,
                        "reply_wait": reply_wait_mode(getattr(self._client, "reply_waits", {})),
                        # After vLLM reset the connector's cache: shares only with itself.
                        "key_epoch": self.keyer.space.epoch or "none (never reset)",
                    },
                    "slow": local.slow()
                    + [
                        n
                        for n in (
                            self._unshared,
                            self._share_timeout_note,
                            self.at_offer_note,
                            self._withheld_note,
                            *self._skip_notes,  # kinds of requests left to vLLM (``RequestScopes``)
                            slow_note("vLLM's scheduling thread"),
                            profiling_note(),
                            thread_census.slow_note() if self.cfg.log_timing else None,
                        )
                        if n
                    ],
                }
            )
        except Exception as e:  # informative only: never costs the probe or the connection
            logger.info("Maru: could not report the scheduler's probe path to the server: %s", e)

    def _drop_client(self, why: Exception) -> None:
        client, self._client = self._client, None
        self._next_connect = time.monotonic() + _RECONNECT_S
        warn_unreachable(self.cfg.server_url, _describe(why), _RECONNECT_S)
        try:
            client.close()
        except Exception:
            pass


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
