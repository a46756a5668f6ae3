"""The background threads of a worker: the loader (``AsyncLoader``) and the drain (``BackgroundRunner``).

Neither ever blocks the calling thread on a transfer: ``poll`` returns what finished, ``drain``
waits (shutdown, tests).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from maru.transfer.loads import InflightLoad
from maru.transfer.records import LoadReport, RequestTransfer

if TYPE_CHECKING:
    from maru.transfer.engine import KVTransferEngine

logger = logging.getLogger("maru.transfer")


class AsyncLoader:
    """``maru_async_load`` without blocking on transfers: issue on a loader thread, poll completion.

    ``submit(tag, engine, requests)`` runs ``engine.start_load(requests)`` on one daemon thread: the
    lookup-and-pin round trip and the issue (CUDA caches: ``pipeline.load``, which returns at once;
    CPU caches: the placement itself, so the load comes back complete). ``poll()`` never waits for
    a transfer: it returns ``(tag, LoadReport)`` for every load whose transfers are ``done()`` and
    hands their unpin (a server round trip) back to the loader thread.

    Invariants: every tag comes back from ``poll``/``drain`` exactly once, with a report that
    either loads or fails each of its requests (an unexpected exception becomes a failure, never a
    lost tag: vLLM would wait for the request for ever); a load is reported only once complete;
    every load's pins are released exactly once, after completion (``InflightLoad.release``).
    """

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ready: list[tuple[Any, LoadReport]] = []  # failed without a lookup: due at the next poll
        self._issuing: list[tuple[Any, list[str], Future[InflightLoad]]] = []
        self._inflight: list[tuple[Any, list[str], InflightLoad]] = []
        self._unpins: list[Future[None]] = []

    def submit(self, tag: Any, engine: KVTransferEngine, requests: Sequence[RequestTransfer]) -> None:
        reqs = list(requests)
        self._issuing.append((tag, [r.req_id for r in reqs], self._pool.submit(engine.start_load, reqs)))

    def fail(self, tag: Any, req_id: str, why: str) -> None:
        """Report ``req_id`` failed at the next ``poll`` (nothing was looked up)."""
        self._ready.append((tag, LoadReport(failed={req_id: why})))

    def __len__(self) -> int:
        """Loads submitted and not yet reported."""
        return len(self._ready) + len(self._issuing) + len(self._inflight)

    def poll(self) -> list[tuple[Any, LoadReport]]:
        """(tag, report) of every load that completed or failed since the last call. Never blocks."""
        out, self._ready = self._ready, []
        issuing, self._issuing = self._issuing, []
        for tag, req_ids, fut in issuing:
            if not fut.done():
                self._issuing.append((tag, req_ids, fut))
                continue
            exc = fut.exception()
            if exc is not None:  # start_load released its pins before raising
                why = f"issuing the load failed: {type(exc).__name__}: {exc}"
                out.append((tag, LoadReport(failed=dict.fromkeys(req_ids, why))))
            else:
                self._inflight.append((tag, req_ids, fut.result()))
        inflight, self._inflight = self._inflight, []
        for tag, req_ids, load in inflight:
            if load.done():
                out.append((tag, self._complete(req_ids, load)))
            else:
                self._inflight.append((tag, req_ids, load))
        self._unpins = [f for f in self._unpins if not f.done()]
        return out

    def _complete(self, req_ids: list[str], load: InflightLoad) -> LoadReport:
        try:
            rep = load.collect()
        except Exception as e:  # a bug: fail the requests rather than lose them
            logger.exception("Maru: completing an asynchronous load failed")
            load.engine.path.settle()
            rep = LoadReport(failed=dict.fromkeys(req_ids, f"completing the load failed: {e}"))
        self._unpins.append(self._pool.submit(_release_logged, load))
        return rep

    def drain(self, timeout: float | None = None) -> list[tuple[Any, LoadReport]]:
        """Wait for every submitted load (issue up to ``timeout`` seconds, then its transfers) and
        every unpin; the reports not yet returned by ``poll``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wait([f for _, _, f in self._issuing], timeout=timeout)
        out = self.poll()
        inflight, self._inflight = self._inflight, []
        for tag, req_ids, load in inflight:
            out.append((tag, self._complete(req_ids, load)))  # collect() waits for the transfers
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        wait(self._unpins, timeout=left)
        self._unpins = [f for f in self._unpins if not f.done()]
        if self._issuing:
            logger.warning(
                "Maru: %d asynchronous loads were still looking up after %.1f s; their pins are freed "
                "with the lease",
                len(self._issuing),
                timeout,
            )
        return out

    def close(self, timeout: float | None = None) -> list[tuple[Any, LoadReport]]:
        out = self.drain(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return out


class BackgroundRunner:
    """One daemon thread running submitted calls in order; results are collected with ``poll``.

    Used for asynchronous loads (``engine.load``) and for write-behind commits
    (``engine.commit_store``). ``poll`` never blocks; ``drain`` waits for everything submitted.
    A call that raises comes back as its exception (the caller turns it into a failure).
    """

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: list[tuple[Any, Future[Any]]] = []

    def submit(self, tag: Any, fn: Any, *args: Any) -> None:
        self._pending.append((tag, self._pool.submit(fn, *args)))

    def __len__(self) -> int:
        return len(self._pending)

    def poll(self) -> list[tuple[Any, Any]]:
        """(tag, result or exception) of every finished call, in submission order of the finished ones."""
        out, keep = [], []
        for tag, fut in self._pending:
            if fut.done():
                exc = fut.exception()
                out.append((tag, exc if exc is not None else fut.result()))
            else:
                keep.append((tag, fut))
        self._pending = keep
        return out

    def drain(self, timeout: float | None = None) -> list[tuple[Any, Any]]:
        """Wait for every submitted call (up to ``timeout`` seconds), then ``poll``."""
        wait([f for _, f in self._pending], timeout=timeout)
        return self.poll()

    def close(self, timeout: float | None = None) -> list[tuple[Any, Any]]:
        out = self.drain(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return out


def _release_logged(load: InflightLoad) -> None:
    """``load.release()`` on the loader thread: a failure is logged (nobody waits for the result)."""
    try:
        load.release()
    except Exception:
        logger.exception("Maru: unpinning an asynchronous load failed; the lease frees its chunks")
