"""Puts off LMCache's store path: a queue and one drain thread that copies into the pool.

``submit`` only takes a reference on each LMCache memory object and queues it, so LMCache's
store path never waits for Maru. The drain thread takes up to ``BATCH`` queued puts at a time:
one ``exists`` (already stored chunks are skipped), one ``batch_alloc``, a copy of each object
into its pool pages, one ``batch_store`` (a key is visible only once its bytes are complete),
then drops its references and calls LMCache's per-key completion callback.

Invariants: every queued object's reference is dropped exactly once, whatever happens; at most
``max_pending`` puts wait (more are dropped and counted, never block); a key is "pending" from
``submit`` until its put finished or was dropped.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from maru.announce import announce_once
from maru.errors import MaruError, PoolFullError
from maru.lmcache.link import ServerLink
from maru.lmcache.objects import HEADER_BYTES, encode_header, payload_bytes, write_object
from maru.protocol import CommitResult

logger = logging.getLogger("maru.lmcache")

BATCH = 64


@dataclass
class PutStats:
    """Counters of the put path (chunks)."""

    stored: int = 0
    already_present: int = 0
    dropped_queue_full: int = 0
    dropped_server_down: int = 0
    dropped_pool_full: int = 0
    failed: int = 0
    bytes_stored: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Put:
    key: str
    cache_key: Any
    obj: Any
    on_done: Callable[[Any], None] | None
    ready: Any = None  # CUDA objects: an event after the submitter's queued work on them


def _ready_event(obj: Any) -> Any:
    """For a memory object in CUDA memory, an event recorded on the submitting thread's current
    stream. The drain thread's copy runs on the drain thread's current stream; a submitter that
    filled the object on another stream (``torch.cuda.set_stream``) would otherwise have it read
    before the fill ran. (A producer on a side stream must still sync it before submitting, as
    LMCache does.) None for host objects."""
    tensor = getattr(obj, "raw_data", None)
    if tensor is None or not getattr(tensor, "is_cuda", False):
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


class PutQueue:
    """Queued puts and the thread that drains them into the pool (see module docs)."""

    def __init__(self, link: ServerLink, max_pending: int) -> None:
        self._link = link
        self._max_pending = max_pending
        self._queue: deque[_Put] = deque()
        self._pending: dict[str, int] = {}
        self._cv = threading.Condition()
        self._busy = 0
        self._stop = False
        self.stats = PutStats()
        self._thread = threading.Thread(target=self._run, name="maru-lmcache-put", daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[str, Any, Any]], on_done: Callable[[Any], None] | None) -> int:
        """Queue ``(pool key, LMCache key, memory object)`` puts; returns how many were queued."""
        queued = 0
        with self._cv:
            for key, cache_key, obj in items:
                if self._stop or len(self._queue) >= self._max_pending:
                    self.stats.dropped_queue_full += 1
                    announce_once(
                        logger,
                        "lmcache.put_queue_full",
                        logging.WARNING,
                        "Maru (LMCache backend): %d puts are queued already (maru_max_pending_puts); "
                        "further chunks are not stored in Maru until the queue drains",
                        self._max_pending,
                    )
                    continue
                obj.ref_count_up()
                self._queue.append(_Put(key, cache_key, obj, on_done, _ready_event(obj)))
                self._pending[key] = self._pending.get(key, 0) + 1
                queued += 1
            self._cv.notify()
        return queued

    def pending(self, key: str) -> bool:
        """Whether a put of ``key`` is queued or being written."""
        with self._cv:
            return key in self._pending

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued put finished; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued (up to ``timeout_s``), then stop; the rest is dropped."""
        self.flush(timeout_s)
        with self._cv:
            self._stop = True
            left = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        self._finish(left, stored=False)
        self._thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ drain thread
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    return
                batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
                self._busy += 1
            try:
                self._write(batch)
            except Exception as e:  # a bug must not kill the thread nor leak references
                self.stats.failed += len(batch)
                logger.exception("Maru (LMCache backend): put of %d chunks failed: %s", len(batch), e)
                self._finish(batch, stored=False)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _write(self, batch: list[_Put]) -> None:
        client = self._link.client()
        if client is None:
            self.stats.dropped_server_down += len(batch)
            self._finish(batch, stored=False)
            return
        allocs: list[Any] = []
        try:
            present = client.exists([p.key for p in batch])
            todo = [p for p, here in zip(batch, present, strict=True) if not here]
            self.stats.already_present += len(batch) - len(todo)
            if todo:
                sizes = [HEADER_BYTES + int(p.obj.get_size()) for p in todo]
                try:
                    allocs = client.batch_alloc(sizes)
                except PoolFullError as e:
                    self.stats.dropped_pool_full += len(todo)
                    announce_once(
                        logger,
                        "lmcache.pool_full",
                        logging.WARNING,
                        "Maru (LMCache backend): the pool has no room for %d chunks even after eviction "
                        "(%s); they are not stored in Maru. Raise maru server --pool-size.",
                        len(todo),
                        e,
                    )
                    self._finish(batch, stored=False)
                    return
                for p, a in zip(todo, allocs, strict=True):
                    if p.ready is not None:
                        p.ready.synchronize()
                    write_object(a.buf, encode_header(p.obj), payload_bytes(p.obj))
                results = client.batch_store([p.key for p in todo], allocs)
                allocs = []
                stored = sum(1 for r in results if r is CommitResult.STORED)
                self.stats.stored += stored
                self.stats.already_present += len(results) - stored
                self.stats.bytes_stored += sum(int(p.obj.get_size()) for p in todo)
        except BaseException as e:
            if allocs:
                try:
                    client.abort(allocs)
                except Exception:
                    pass
            if not isinstance(e, MaruError):
                raise  # a bug, not the link: _run logs it and drops the batch
            self.stats.dropped_server_down += len(batch)
            self._link.failed(client, e)
            self._finish(batch, stored=False)
            return
        self._finish(batch, stored=True)

    def _finish(self, batch: list[_Put], stored: bool) -> None:
        with self._cv:
            for p in batch:
                n = self._pending.get(p.key, 0) - 1
                if n > 0:
                    self._pending[p.key] = n
                else:
                    self._pending.pop(p.key, None)
        for p in batch:
            p.obj.ref_count_down()
            if stored and p.on_done is not None:
                try:
                    p.on_done(p.cache_key)
                except Exception as e:
                    logger.warning("Maru (LMCache backend): LMCache's put callback failed: %s", e)
