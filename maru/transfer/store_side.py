"""The store half of ``KVTransferEngine`` (a mixin): reserve pool objects, gather the chunks into
them, publish them in one commit; and the write-behind store, split between the forward thread
and the drain thread.

Invariants (the engine's): a key is published only after its object is completely written, and
only with the checksum of the bytes written; where the path also computed segment sums
(``maru.segments``, from the KV cache itself) they must add up to that checksum, or the object is
never published (the store path wrote bytes the cache did not hold).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from maru.errors import CONNECTION_LOST, MaruError
from maru.protocol import CommitResult
from maru.transfer.records import RequestTransfer, StoreReport, many_chunk_slots, slot_mapping
from maru.transfer.stores import IssuedGather, PendingStore, PreparedStore

logger = logging.getLogger("maru.transfer")


class StoreSide:
    """Stores of ``KVTransferEngine`` (see ``maru.transfer.engine``); uses its client, path, geometry,
    block size and ``paced_store``."""

    client: Any
    path: Any
    geometry: Any
    block_size: int
    paced_store: bool

    # ------------------------------------------------------------------ store
    def store(self, requests: Sequence[RequestTransfer]) -> StoreReport:
        """Gather every chunk of ``requests`` into new pool objects, then publish them in one batch.

        A key that appears twice (two requests sharing a prefix in one step) is stored once.
        """
        return self.commit_store(self.prepare_store(requests))

    def prepare_store(
        self, requests: Sequence[RequestTransfer], *, after: Any = None, paced: bool = False
    ) -> PreparedStore:
        """Reserve pool objects and gather the chunks into them; nothing is published yet.

        When this returns the paged cache is no longer read: the blocks may be reused at once.
        ``after``/``paced``: see ``DataPath.gather`` (a write-behind store on the drain thread).
        """
        t0, c0 = time.perf_counter(), time.thread_time()
        prep = PreparedStore(report=StoreReport())
        cpu = prep.report.cpu
        reserved = self._reserve(requests, prep)
        c1 = time.thread_time()
        cpu["reserve"] = c1 - c0
        if reserved is not None:
            issued = self.issue_gather(*reserved, prep, paced=paced, after=after)
            c2 = time.thread_time()
            self.finish_gather(issued, prep)
            cpu["issue"], cpu["complete"] = c2 - c1, time.thread_time() - c2
        prep.report.seconds += time.perf_counter() - t0
        return prep

    def _reserve(
        self, requests: Sequence[RequestTransfer], prep: PreparedStore
    ) -> tuple[list[tuple[RequestTransfer, Any]], list[Any]] | None:
        """Every unique chunk of ``requests`` and a reserved pool object for each (one round trip).

        None when there is nothing to store or the reservation failed (recorded in ``prep``).
        """
        rep = prep.report
        todo: list[tuple[RequestTransfer, Any]] = []
        seen: set[str] = set()
        for req in requests:
            for c in req.chunks:
                if c.key not in seen:
                    seen.add(c.key)
                    todo.append((req, c))
        if not todo:
            return None
        try:
            objs = self.client.batch_alloc([self.geometry.nbytes(c.num_tokens) for _, c in todo])
        except (MaruError, ValueError) as e:
            rep.failed = len(todo)
            rep.error = f"reserving {len(todo)} objects failed: {e}"
            rep.server_lost = isinstance(e, CONNECTION_LOST)
            return None
        return todo, list(objs)

    def issue_gather(
        self,
        todo: list[tuple[RequestTransfer, Any]],
        objs: list[Any],
        prep: PreparedStore,
        *,
        paced: bool = False,
        after: Any = None,
    ) -> IssuedGather:
        """Issue the gather of every chunk into its reserved object on the data path (may be queued;
        ``paced``, ``after``: see ``DataPath.gather``)."""
        rep = prep.report
        ig = IssuedGather()
        slots: list[torch.Tensor] = []
        per_req = self._store_slots(todo)
        for (req, c), obj in zip(todo, objs, strict=True):
            try:
                s = per_req.get(id(c))
                if s is None:  # its request's slots failed as a whole: this chunk's own error
                    s = slot_mapping(req.block_ids, self.block_size, c.start, c.num_tokens)
                o = self.geometry.over(obj.buf, c.num_tokens)
            except Exception as e:
                ig.bad.append(obj)
                rep.error = f"gathering chunk {c.key} failed: {type(e).__name__}: {e}"
                continue
            ig.outs.append(o)
            slots.append(s)
            ig.ok.append((c, obj))
        if ig.ok:
            try:
                ig.handle = self.path.gather(ig.outs, slots, paced=paced, after=after)
            except Exception as e:  # nothing of it is published
                rep.error = f"gathering {len(ig.ok)} chunks failed: {type(e).__name__}: {e}"
                ig.bad.extend(obj for _, obj in ig.ok)
                ig.ok, ig.outs = [], []
        return ig

    def _store_slots(self, todo: list[tuple[RequestTransfer, Any]]) -> dict[int, torch.Tensor]:
        """Every chunk's slots (whole chunks), computed once per request (``chunk_slots``); keyed by
        ``id(chunk)``. A request whose slots cannot be computed as a whole is left out."""
        by_req: dict[str, tuple[RequestTransfer, list[Any]]] = {}
        for req, c in todo:
            by_req.setdefault(req.req_id, (req, []))[1].append(c)
        out: dict[int, torch.Tensor] = {}
        groups = list(by_req.values())
        # Every request at once; one whose slots cannot be made is None: left out alone (its
        # chunks then make their own mapping, which says why).
        flats = many_chunk_slots([(r.block_ids, c) for r, c in groups], self.block_size, whole=True)
        for (_, chunks), flat in zip(groups, flats, strict=True):
            if flat is None:
                continue
            o = 0
            for c in chunks:
                out[id(c)] = flat[o : o + c.num_tokens]
                o += c.num_tokens
        return out

    def finish_gather(self, ig: IssuedGather, prep: PreparedStore) -> None:
        """Wait for an issued gather, then record its complete objects in ``prep``; abort the others."""
        handle, ig.handle = ig.handle, None
        if handle is not None:
            try:
                handle.wait()  # the copies into the pool pages completed: only now may keys be published
            except Exception as e:
                prep.report.error = f"gathering {len(ig.ok)} chunks failed: {type(e).__name__}: {e}"
                ig.bad.extend(obj for _, obj in ig.ok)
                ig.ok = []
                self.path.settle()  # no copy may still write a page we hand back
            else:
                sums = handle.checksums() or [None] * len(ig.ok)
                segs = handle.segment_sums() or [None] * len(ig.ok)
                failed = handle.failed_items()
                for i in sorted(failed, reverse=True):
                    c, obj = ig.ok.pop(i)
                    sums.pop(i)
                    segs.pop(i)
                    ig.bad.append(obj)
                    prep.report.error = f"gathering chunk {c.key} failed: {failed[i]}"
                for i in reversed(range(len(ig.ok))):
                    seg, cs = segs[i], sums[i]
                    if seg is not None and cs is not None and not seg.consistent(cs, ig.ok[i][1].size):
                        # The bytes written are not the bytes the cache held: never published.
                        c, obj = ig.ok.pop(i)
                        sums.pop(i)
                        segs.pop(i)
                        ig.bad.append(obj)
                        prep.report.error = (
                            f"chunk {c.key}: the bytes the store wrote do not match the KV cache it read "
                            "(their checksum differs from the cache's segment sums); not published. "
                            "A store path wrote wrong bytes: report it with `maru doctor` output"
                        )
                        logger.error("Maru: %s", prep.report.error)
                ig.sums, ig.segments = list(sums), list(segs)
            del handle
        ig.outs = []  # drop the exports of the pool buffers before the client releases them
        ok, bad, ig.ok, ig.bad = ig.ok, ig.bad, [], []
        sums, ig.sums = ig.sums or [None] * len(ok), []
        segs, ig.segments = ig.segments or [None] * len(ok), []
        rep = prep.report
        for (c, obj), cs, seg in zip(ok, sums, segs, strict=True):
            prep.keys.append(c.key)
            prep.objects.append(obj)
            prep.checksums.append(cs)
            prep.segments.append(seg)
            rep.tokens += c.num_tokens
            prep.nbytes += obj.size
        if bad:
            rep.failed += len(bad)
            self._abort(bad)

    def abort_prepared(self, prep: PreparedStore, why: str) -> StoreReport:
        """Hand every prepared object back unpublished; the report counts them failed with ``why``."""
        rep = prep.report
        if prep.objects:
            rep.failed += len(prep.objects)
            rep.tokens = 0
            rep.error = f"{len(prep.objects)} objects {why}"
            self._abort(prep.objects)
            prep.keys, prep.objects, prep.checksums, prep.segments = [], [], [], []
        return rep

    def _abort(self, objs: list[Any]) -> None:
        try:
            self.client.abort(objs)
        except MaruError:
            pass  # the server reclaims reservations with the lease

    def commit_store(self, prep: PreparedStore) -> StoreReport:
        """Publish what ``prepare_store`` gathered (one batch); returns the step's full report."""
        t0, c0 = time.perf_counter(), time.thread_time()
        rep = prep.report
        if prep.objects:
            try:
                # The path's checksums of the bytes it wrote; where one is missing the client
                # computes them all over the pool objects.
                sums = prep.checksums if prep.checksums and None not in prep.checksums else None
                segs = prep.segments if sums is not None and any(prep.segments) else None
                results = self.client.batch_store(prep.keys, prep.objects, checksums=sums, segments=segs)
            except MaruError as e:
                rep.failed += len(prep.objects)
                rep.tokens = 0
                rep.error = f"publishing {len(prep.objects)} objects failed: {e}"
                rep.server_lost = isinstance(e, CONNECTION_LOST)
                rep.seconds += time.perf_counter() - t0
                return rep
            for r in results:
                if r == CommitResult.STORED:
                    rep.stored += 1
                else:
                    rep.present += 1
            rep.bytes = prep.nbytes
        rep.seconds += time.perf_counter() - t0
        rep.cpu["publish"] = time.thread_time() - c0
        return rep

    # ------------------------------------------------------------------ write-behind store
    def issue_store(self, requests: Sequence[RequestTransfer]) -> PendingStore:
        """Start a write-behind store on the forward thread; ``complete_store`` finishes it.

        Where the path defers the gather (CPU, CUDA) only the path's ``mark()`` is taken here (a
        CUDA event on the forward's stream): the drain thread reserves the objects and issues the
        gather ordered after it. Otherwise (the staged path) the objects are reserved and the
        gather runs now. Until ``read_done`` is set the blocks of ``requests`` must not be reused
        (``wait_store_read``).
        """
        pending = PendingStore(requests=list(requests), prep=PreparedStore(report=StoreReport()))
        if self.path.defers_store_gather:
            pending.after = self.path.mark()
            return pending
        t0 = time.perf_counter()
        reserved = self._reserve(requests, pending.prep)
        if reserved is not None:
            pending.issued = self.issue_gather(*reserved, pending.prep, paced=self.paced_store)
        else:
            pending.read_done.set()
        pending.prep.report.seconds += time.perf_counter() - t0
        return pending

    def complete_store(self, pending: PendingStore) -> StoreReport:
        """Finish a write-behind store (drain thread): gather or wait for the gather, then publish.

        A store cancelled by ``wait_store_read`` publishes nothing (its objects are aborted).
        """
        try:
            if pending.issued is not None:
                t0 = time.perf_counter()
                self.finish_gather(pending.issued, pending.prep)
                pending.prep.report.seconds += time.perf_counter() - t0
            elif self.path.defers_store_gather:
                if pending.take():
                    pending.prep = self._gather_deferred(pending)  # reads the blocks
                else:  # the preemption barrier gathered it on the forward thread
                    pending.read_done.wait()
        finally:
            cancelled = pending.finish_reading()
        if cancelled:
            return self.abort_prepared(
                pending.prep,
                "cancelled: their blocks were released (request preempted) before the write-behind "
                "gather finished reading them",
            )
        return self.commit_store(pending.prep)

    def _gather_deferred(self, pending: PendingStore) -> PreparedStore:
        """A deferred write-behind gather (drain thread, or the preemption barrier): reserve, gather
        after the forward's mark, wait for the copies. The blocks are not read after this returns."""
        return self.prepare_store(pending.requests, after=pending.after, paced=self.paced_store)

    def wait_store_read(self, pending: PendingStore, timeout: float | None = None) -> bool:
        """Block until ``pending`` no longer reads the paged cache (the preemption barrier).

        Deferred gathers (CPU) not yet started by the drain thread run here, on the forward thread;
        issued gathers are waited for. True: the blocks may be overwritten. False after ``timeout``
        seconds: the store is cancelled (it publishes nothing), so the blocks may be overwritten too.
        """
        if self.path.defers_store_gather and pending.take():
            try:
                pending.prep = self._gather_deferred(pending)
            finally:
                pending.read_done.set()
            return True
        handle = pending.issued.handle if pending.issued is not None else None
        if handle is not None and not pending.read_done.is_set():
            try:
                handle.wait()  # the copies finishing is what matters, not the drain thread reaching them
                return True
            except Exception as e:
                logger.error("Maru: waiting for a write-behind gather failed (%s); it is cancelled", e)
                self.path.settle()
        elif pending.read_done.wait(timeout):
            return True
        return pending.cancel()
