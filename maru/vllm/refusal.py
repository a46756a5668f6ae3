"""An off connector tells the server why it is off, so ``maru doctor`` shows it.

The connector turns itself off, announced in vLLM's log, where it cannot run safely (pipeline
parallelism, vLLM's sleep mode with ``maru_allow_sleep_mode=false``). The log alone is not enough: an
operator who asks ``maru doctor`` would see no serving client at all, or only the engines that
work, and take the silence for health. ``RefusalReport`` gives the refused engine a seat there: a
client that never maps the pool (``MaruHandler(map_pool=False)``) reports
``{"role": "vllm-scheduler", "paths": {"connector": "off"}, "slow": [reason and fix, ...]}``, and its
heartbeats keep the report listed while vLLM runs.

Invariants: vLLM's start never waits on the server (the connection is made on a daemon thread,
retried until it answers or the report is closed); a failure to report is logged at INFO and
never raised; ``close`` ends the thread and the connection (the server drops the report with the
lease).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from maru.vllm.logs import logger

RETRY_S = 10.0  # between tries while the server does not answer


def refusal_info(fallbacks: tuple[str, ...] | list[str], role: str = "vllm-scheduler") -> dict[str, Any]:
    """The client info of a connector that is off: each replaced setting with its reason and fix."""
    return {"role": role, "paths": {"connector": "off"}, "slow": list(fallbacks)}


def report_only_client(server_url: str, timeout_s: float) -> Any:
    """A client of the server at ``server_url`` that only reports (it never maps the pool)."""
    from maru.client import MaruHandler

    return MaruHandler(server_url, timeout_s=timeout_s, map_pool=False)


class RefusalReport:
    """Reports ``info`` to the server of ``connect()`` (a report-only ``MaruHandler``) on a
    daemon thread, and holds that connection until ``close``."""

    def __init__(self, connect: Callable[[], Any], info: dict[str, Any], retry_s: float = RETRY_S) -> None:
        self._connect = connect
        self._info = info
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._client: Any = None
        self.reported = threading.Event()  # set once the server holds the report
        self._thread = threading.Thread(target=self._run, name="maru-refusal-report", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tries = 0
        while not self._stop.is_set():
            try:
                client = self._connect()
            except Exception as e:  # an unreachable server: try again, never raise into vLLM
                tries += 1  # said once at INFO; the retries at DEBUG (the server may stay down)
                level = logging.INFO if tries == 1 else logging.DEBUG
                logger.log(level, "Maru: could not report the connector's refusal to the server yet: %s", e)
                self._stop.wait(self._retry_s)
                continue
            with self._lock:
                if self._stop.is_set():
                    client.close()
                    return
                self._client = client
            try:
                client.set_client_info(self._info)
                self.reported.set()
            except Exception as e:  # a refused info: logged, the connector stays off as announced
                logger.info("Maru: the server refused the connector's refusal report: %s", e)
            return

    def close(self) -> None:
        """Stop trying and close the connection (the server forgets the report with its lease)."""
        self._stop.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as e:  # closing is best effort at shutdown
                logger.info("Maru: closing the refusal report's connection failed: %s", e)
        self._thread.join(timeout=5.0)
