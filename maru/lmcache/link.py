"""The backend's link to ``maru server``: connect lazily, warn once while it is unreachable.

Invariant: no method raises into LMCache. While the server is down every call answers as if the
pool were empty (nothing contained, nothing found, puts dropped and counted); LMCache keeps
serving from its other tiers. One warning when the link goes down (``maru.announce``), one line
when it comes back; reconnects are tried at most every ``retry_s`` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from maru.announce import announce_once, forget

logger = logging.getLogger("maru.lmcache")

_UNREACHABLE = (
    "Maru (LMCache backend): cannot reach maru server at %s (%s); LMCache keeps serving without "
    "Maru (no Maru hits, puts dropped) and retries every %.0f s. Start `maru server` or fix "
    "maru_server_url in LMCache's extra_config."
)


class ServerLink:
    """One ``MaruHandler`` shared by the backend's threads, made on first use and dropped on error."""

    def __init__(self, url: str, timeout_s: float, retry_s: float, on_connect: Any = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._on_connect = on_connect
        self._client: Any = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def _announce_key(self) -> str:
        return f"lmcache.unreachable:{self.url}"

    def client(self) -> Any:
        """The connected handler, or None while the server is unreachable (or after ``close``)."""
        with self._lock:
            if self._client is not None or self._closed:
                return self._client
            now = time.monotonic()
            if now < self._next_try:
                return None
            try:
                from maru.client import MaruHandler

                self._client = MaruHandler(self.url, timeout_s=self.timeout_s)
            except Exception as e:  # never raise into LMCache
                self._next_try = now + self.retry_s
                self._warn(e)
                return None
            if forget(self._announce_key):
                logger.warning("Maru (LMCache backend): reconnected to maru server at %s", self.url)
            client = self._client
        if self._on_connect is not None:
            try:
                self._on_connect(client)
            except Exception as e:  # describing ourselves or registering with CUDA is not vital
                logger.warning("Maru (LMCache backend): after connecting: %s: %s", type(e).__name__, e)
        return client

    def failed(self, client: Any, error: BaseException) -> None:
        """``client`` failed a call with ``error``: drop it (if still current) and warn once."""
        with self._lock:
            if self._client is not client or client is None:
                return
            self._client = None
            self._next_try = time.monotonic() + self.retry_s
        self._warn(error)
        try:
            client.close()
        except Exception:
            pass

    def _warn(self, error: BaseException) -> None:
        why = f"{type(error).__name__}: {error}"
        announce_once(logger, self._announce_key, logging.WARNING, _UNREACHABLE, self.url, why, self.retry_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
