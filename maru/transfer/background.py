"""The background threads of a worker: the loader (``AsyncLoader``) and the drain (``BackgroundRunner``).

Neither ever blocks the calling thread on a transfer: ``poll`` returns what finished, ``drain``
waits (shutdown, tests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from maru.transfer.loads import InflightLoad, LookedUp
from maru.transfer.records import LoadReport, RequestTransfer

if TYPE_CHECKING:
    from maru.transfer.engine import KVTransferEngine

logger = logging.getLogger("maru.transfer")


class AsyncLoader:
    """``maru_async_load`` without blocking on transfers: batched lookups on a loader thread, polled completion.

    ``submit(tag, engine, requests)`` queues requests; each turn of the loader thread takes *every*
    queued request (of one engine) and makes one lookup-and-pin round trip for all of them.

    The loader thread only does the round trip; the next ``poll()``, on the caller's thread (vLLM's),
    issues the batch (``engine.issue_load``). Issued on the loader thread, each of a batch's many
    calls that give the GIL up (CUDA calls, torch copies) had to win it back from vLLM's engine loop,
    which spins while loads are pending: on an H200 the loads reached 26-41% of pinned bandwidth
    against 72-87% issued by ``poll`` (bench/gil_contention.py); on the CPU build a 2k-token load
    took 9.2-10.0 s against 0.2 s for the same load done synchronously (bench/e2e_cpu.py
    --async-load), slower than recomputing. On CUDA caches ``issue_load`` only queues device work
    (one ``pipeline.load``); on CPU caches it is the copy itself, so ``poll`` returns that batch
    complete.

    Several batches are in flight at once: the loader thread goes on to the next turn while the
    copy engine runs. ``poll()`` never waits for a transfer: it returns ``(tags, LoadReport)`` for
    every batch whose transfers are ``done()`` and hands its unpin (a server round trip) back to
    the loader thread.

    Invariants: every tag comes back from ``poll``/``drain`` exactly once, in a report that either
    loads or fails each of its requests (an unexpected exception becomes a failure, never a lost
    tag: vLLM would wait for the request for ever); a batch is reported only once complete; every
    batch's pins are released exactly once, after completion (``InflightLoad.release``).
    """

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._queue: list[tuple[Any, KVTransferEngine, list[RequestTransfer]]] = []  # for the next turn
        self._turns: list[Future[None]] = []
        # by turns: looked up (the caller issues it), issued, or failed
        self._issued: list[
            tuple[list[Any], list[str], KVTransferEngine, LookedUp | InflightLoad | BaseException]
        ] = []
        self._ready: list[tuple[list[Any], LoadReport]] = []  # failed without a lookup: due at next poll
        self._inflight: list[tuple[list[Any], list[str], InflightLoad]] = []
        self._unpins: list[Future[None]] = []
        self._counted_late: set[Future[None]] = set()  # turns issue_now returned as left for later
        self.batches = 0  # batches issued (one lookup round trip each)

    def submit(self, tag: Any, engine: KVTransferEngine, requests: Sequence[RequestTransfer]) -> None:
        """Queue ``requests`` (reported together under ``tag``) for the loader's next turn."""
        self.submit_many(engine, [(tag, requests)])

    def submit_many(
        self, engine: KVTransferEngine, items: Sequence[tuple[Any, Sequence[RequestTransfer]]]
    ) -> None:
        """Queue several (tag, requests) at once: a turn never takes only part of them."""
        if not items:
            return
        with self._lock:
            scheduled = bool(self._queue)  # a turn is scheduled already and will take these too
            self._queue.extend((tag, engine, list(reqs)) for tag, reqs in items)
        if not scheduled:
            self._turns.append(self._pool.submit(self._turn))

    def fail(self, tag: Any, req_id: str, why: str) -> None:
        """Report ``req_id`` failed at the next ``poll`` (nothing was looked up)."""
        self._ready.append(([tag], LoadReport(failed={req_id: why})))

    def __len__(self) -> int:
        """Submissions (tags) not yet reported."""
        with self._lock:
            queued = len(self._queue) + sum(len(tags) for tags, _, _ in self._issued)
        return (
            queued
            + sum(len(tags) for tags, _ in self._ready)
            + sum(len(tags) for tags, _, _ in self._inflight)
        )

    def _turn(self) -> None:
        """Loader thread: issue every queued submission, one ``start_load`` per engine."""
        with self._lock:
            queue, self._queue = self._queue, []
        by_engine: dict[int, tuple[KVTransferEngine, list[Any], list[RequestTransfer]]] = {}
        for tag, engine, reqs in queue:
            _, tags, all_reqs = by_engine.setdefault(id(engine), (engine, [], []))
            tags.append(tag)
            all_reqs.extend(reqs)
        for engine, tags, reqs in by_engine.values():
            result: LookedUp | InflightLoad | BaseException
            try:
                result = engine.look_up(reqs)  # the copies are issued by poll(), on the caller's thread
            except BaseException as e:  # look_up holds no pins when it raises
                result = e
            self.batches += 1
            with self._lock:
                self._issued.append((tags, [r.req_id for r in reqs], engine, result))

    def _issue_looked_up(self) -> list[tuple[list[Any], LoadReport]]:
        """Issue (caller's thread) every batch the loader thread looked up; the ones that failed."""
        failed = []
        with self._lock:
            issued, self._issued = self._issued, []
        for tags, req_ids, engine, result in issued:
            if isinstance(result, LookedUp):
                try:
                    result = engine.issue_load(result)  # unpins before raising
                except Exception as e:
                    result = e
            if isinstance(result, BaseException):
                why = f"issuing the load failed: {type(result).__name__}: {result}"
                failed.append((tags, LoadReport(failed=dict.fromkeys(req_ids, why))))
            else:
                self._inflight.append((tags, req_ids, result))
        return failed

    def issue_now(self, wait_s: float) -> int:
        """Issue, on the caller's thread, every batch whose lookup comes back within ``wait_s``
        seconds (one round trip); the rest are issued by a later ``poll``. Never reports.

        Called before the step's forward, so a batch's copies run under that forward and ``poll``
        after it can report the batch done in the same step: vLLM schedules the request a step
        earlier than when the batch was issued only by the ``poll`` after the forward.

        Returns how many batches it left for later: loader turns still looking up (or queued
        behind one) after the wait, each counted by one call only (a turn left for later by an
        earlier call is not counted again). A turn is one batch per engine its submissions name:
        one for a worker, whose submissions all name its current engine.
        """
        pending = [f for f in self._turns if not f.done()]
        if pending:
            wait(pending, timeout=wait_s)
        late = {f for f in pending if not f.done()}
        left = len(late - self._counted_late)
        self._counted_late = late  # the turns done since drop out
        self._ready.extend(self._issue_looked_up())
        return left

    def poll(self) -> list[tuple[list[Any], LoadReport]]:
        """(tags, report) of every batch that completed or failed since the last call. Never blocks."""
        out, self._ready = self._ready, []
        out += self._issue_looked_up()
        inflight, self._inflight = self._inflight, []
        for tags, req_ids, load in inflight:
            if load.done():
                out.append((tags, self._complete(req_ids, load)))
            else:
                self._inflight.append((tags, req_ids, load))
        self._unpins = [f for f in self._unpins if not f.done()]
        self._turns = [f for f in self._turns if not f.done()]
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

    def drain(self, timeout: float | None = None) -> list[tuple[list[Any], LoadReport]]:
        """Wait for every submitted load (issue up to ``timeout`` seconds, then its transfers) and
        every unpin; the reports not yet returned by ``poll``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wait(self._turns, timeout=timeout)
        out = self.poll()
        inflight, self._inflight = self._inflight, []
        for tags, req_ids, load in inflight:
            out.append((tags, self._complete(req_ids, load)))  # collect() waits for the transfers
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        wait(self._unpins, timeout=left)
        self._unpins = [f for f in self._unpins if not f.done()]
        if self._turns:
            logger.warning(
                "Maru: asynchronous loads were still looking up after %.1f s; their pins are freed "
                "with the lease",
                timeout,
            )
        return out

    def close(self, timeout: float | None = None) -> list[tuple[list[Any], LoadReport]]:
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
