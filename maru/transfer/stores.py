"""Stores in progress: gathered-not-published (``PreparedStore``), gathers in flight
(``IssuedGather``) and write-behind stores between the forward and drain threads (``PendingStore``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from maru.transfer.handles import TransferHandle
from maru.transfer.records import ChunkRef, RequestTransfer, StoreReport


@dataclass
class PreparedStore:
    """Chunks gathered into reserved pool objects, not yet published (``prepare_store``)."""

    report: StoreReport
    keys: list[str] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    checksums: list[int | None] = field(default_factory=list)  # of the bytes written, where known
    segments: list[Any] = field(default_factory=list)  # their SegmentSums, where known (maru.segments)
    nbytes: int = 0


@dataclass
class IssuedGather:
    """A gather issued on the data path whose copies may still run.

    ``outs`` (tensors over the pool pages) stay alive until the copies completed; ``ok`` are the
    chunks in the gather (with their objects), ``bad`` the objects to abort; ``sums`` the
    checksums the path computed of what it wrote, parallel to ``ok`` (once waited for).
    """

    handle: TransferHandle | None = None
    ok: list[tuple[ChunkRef, Any]] = field(default_factory=list)
    bad: list[Any] = field(default_factory=list)
    sums: list[int | None] = field(default_factory=list)
    segments: list[Any] = field(default_factory=list)  # SegmentSums parallel to ``sums`` (or None)
    outs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class PendingStore:
    """A write-behind store between ``issue_store`` (forward thread) and ``complete_store`` (drain).

    Invariants: ``read_done`` is set once the paged cache is no longer read for this store (the
    gather completed or was given up); ``cancelled`` is only ever set before that (``cancel``), and
    then the store aborts every object instead of publishing bytes that may have been read from
    reused blocks. A deferred gather is taken exactly once (``take``), by the drain thread or by
    the preemption barrier, and is ordered after ``after`` (the path's ``mark()`` taken on the
    forward thread when the store was issued).
    """

    requests: list[RequestTransfer]
    prep: PreparedStore
    issued: IssuedGather | None = None  # the gather in flight, where the path issues at once
    after: Any = None  # where the path defers the gather: what it must be ordered after
    read_done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    started: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def req_ids(self) -> frozenset[str]:
        return frozenset(r.req_id for r in self.requests)

    def reading_done(self) -> bool:
        """Whether the paged cache is no longer read for this store, without blocking: the read is
        known to be over (``read_done``), or the issued gather's device work completed (its copies
        out of the blocks ran; publishing may still be ahead). The blocks may be reused then."""
        if self.read_done.is_set():
            return True
        issued = self.issued
        handle = issued.handle if issued is not None else None  # None once the drain thread took it
        return handle is not None and handle.done()

    def take(self) -> bool:
        """True for the one caller that runs the deferred gather."""
        with self.lock:
            taken, self.started = self.started, True
        return not taken

    def finish_reading(self) -> bool:
        """The cache is no longer read for this store; True if it was cancelled before that."""
        with self.lock:
            self.read_done.set()
            return self.cancelled

    def cancel(self) -> bool:
        """Cancel unless the read already finished; True when the blocks may be reused either way
        because the read finished (False: cancelled, it will publish nothing)."""
        with self.lock:
            if self.read_done.is_set():
                return True
            self.cancelled = True
        return False
