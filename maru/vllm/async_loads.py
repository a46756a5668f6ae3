"""``maru_async_load`` on one worker: parked requests loaded by the loader thread, reported once done.

``AsyncLoads`` hands a step's parked requests (``WAITING_FOR_REMOTE_KVS``) to an ``AsyncLoader``
and turns what it reports into vLLM's ``finished_recving``. Invariants (those of ``AsyncLoader``,
kept here): every request handed over is reported exactly once, loaded or failed (vLLM would wait
for a lost one for ever); a failed one is failed through the worker (its blocks are recomputed) in
the same call that reports it finished.
"""

from __future__ import annotations

import time

from maru.transfer.background import AsyncLoader
from maru.transfer.records import RequestTransfer
from maru.vllm.load_hooks import LoadHooks
from maru.vllm.worker_stats import WorkerStats

# How long the forward thread waits for an async load's lookup (one round trip, ~0.1-0.3 ms) to
# issue it before the forward; a slower answer is issued after the forward, a step later.
ASYNC_ISSUE_WAIT_S = 0.005


class AsyncLoads:
    """The asynchronous loads of one worker (see the module docstring for the invariants).

    ``hooks`` are the worker's (``LoadHooks``); a completed batch is accounted as " (async)".
    """

    def __init__(self, stats: WorkerStats, hooks: LoadHooks, *, enable_load: bool, timeout_s: float) -> None:
        self.stats = stats
        self._hooks = hooks
        self._enable_load = enable_load
        self._timeout_s = timeout_s
        self.loader: AsyncLoader | None = None  # started by the first async load
        # For the timing line (maru_log_timing): when each request was handed over, and the
        # collect calls (vLLM steps) made until then, so a report says how long the park took.
        self._handed: dict[str, tuple[float, int]] = {}
        self._collects = 0

    def start(self, loads: list[RequestTransfer]) -> None:
        """Hand the step's parked requests to the loader; ``collect`` reports them.

        The loader thread makes one lookup-and-pin round trip for every request queued when its
        turn comes (``AsyncLoader``); the batch is issued on this thread, before the forward when
        the answer is back within ``ASYNC_ISSUE_WAIT_S``, else by ``collect`` (from ``get_finished``,
        after the forward: vLLM schedules the request a step later), counted in
        ``async_issued_late``. On CUDA caches the transfer runs on the engine's streams and
        ``collect`` reports a batch's requests once it is ``done()``; on CPU caches the issue is the
        copy itself.
        """
        if self.loader is None:
            self.loader = AsyncLoader("maru-loader")
        self.stats.async_loads += len(loads)
        now = time.perf_counter()
        for rt in loads:
            self._handed[rt.req_id] = (now, self._collects)
        engine = self._hooks.connect() if self._enable_load else "maru_enable_load is false"
        if isinstance(engine, str):
            for rt in loads:
                self.loader.fail(rt, rt.req_id, engine)
            return
        # One tag per request (it comes back with the batch's report), queued together so that
        # one turn takes them all. The engine is captured now: a reconnect later builds a new one.
        self.loader.submit_many(engine, [(rt, [self._hooks.rank(rt)]) for rt in loads])
        # Issued before the forward when the lookup is back in time: done by the step's end.
        self.stats.async_issued_late += self.loader.issue_now(ASYNC_ISSUE_WAIT_S)

    def collect(self) -> set[str]:
        """Requests whose async load completed or failed since the last call (never blocks)."""
        done: set[str] = set()
        if self.loader is None:
            return done
        self._collects += 1
        now = time.perf_counter()
        for tags, res in self.loader.poll():
            oldest = None
            self._hooks.done(tags)  # the batch's transfers completed (or never started)
            for rt in tags:
                done.add(rt.req_id)
                handed = self._handed.pop(rt.req_id, None)
                if handed is not None and (oldest is None or handed[0] < oldest[0]):
                    oldest = handed
                if rt.req_id in res.failed:
                    self.stats.async_load_failures += 1
                    self._hooks.fail(rt, res.failed[rt.req_id])
            if res.server_lost and res.failed:
                self._hooks.lost(next(iter(res.failed.values())))
            how = " (async)"
            if oldest is not None:  # handed over before its step's forward, reported now
                how = f" (async; reported {(now - oldest[0]) * 1e3:.1f} ms and {self._collects - oldest[1]} steps after the hand-over)"
            self._hooks.account(res, how, False)
        return done

    def close(self) -> None:
        """Wait for the loads in flight (up to the client's timeout for their issue), then stop."""
        if self.loader is not None:
            self.loader.close(timeout=self._timeout_s)
