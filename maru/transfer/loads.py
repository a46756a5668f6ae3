"""Loads in progress: pinned and checked (``PinnedLoad``), issued chunk by chunk (``InflightLoad``),
issued layer by layer (``LayerByLayerLoad``). Each releases its pins exactly once, only after every
transfer that reads the pinned pages completed. A request whose placed bytes failed their
committed checksum (the handle's ``mismatched()``) is failed like one whose copy failed, before
it is ever reported loaded, and its corrupt chunks are reported (``engine.report_corrupt``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from maru.kv_ops.pool_objects import PoolObjects
from maru.transfer.handles import LayerHandle
from maru.transfer.records import LoadReport, RequestTransfer
from maru.transfer.slot_plan import DeferredSlots, LayerGroup, joined_slots

if TYPE_CHECKING:
    from maru.transfer.engine import KVTransferEngine

logger = logging.getLogger("maru.transfer")


class StepObjects:
    """A load step's objects, one per chunk key its requests place from (``KVTransferEngine._views_of``).

    ``objs[where[k]]`` is the object over key position k's pinned page: ``PoolObjects`` (over one
    tensor of the pool, each made on first use) or tensors made beforehand (a client without one).
    """

    __slots__ = ("objs", "where")

    def __init__(self, objs: Sequence[torch.Tensor], where: dict[int, int]) -> None:
        self.objs = objs
        self.where = where

    def of(self, keys: Sequence[int]) -> Sequence[torch.Tensor]:
        """The objects of key positions ``keys``, in order (a request's chunks): a ``PoolObjects``
        sharing the step's made objects, or a list."""
        pos = [self.where[k] for k in keys]
        if isinstance(self.objs, PoolObjects):
            return self.objs.take(pos)
        return [self.objs[p] for p in pos]


class ReadyRequest:
    """A request of a ``PinnedLoad`` whose every chunk is present with the right size.

    Invariant: ``objs`` and ``handles`` run parallel to ``req.chunks`` (object i over the page
    that lookup handle i pinned); ``slots`` is the request's one host mapping, every token of its
    chunks in order (-1 where not placed: ``chunk_slots``); ``nbytes`` the chunks' bytes."""

    __slots__ = ("req", "objs", "slots", "handles", "nbytes")

    def __init__(
        self, req: RequestTransfer, objs: Sequence[torch.Tensor], slots: torch.Tensor, handles: list[Any]
    ) -> None:
        self.req = req
        self.objs = objs
        self.slots = slots
        self.handles = handles
        self.nbytes = sum(int(h.size) for h in handles)

    def placed(self) -> tuple[LayerGroup, list[Any]]:
        """The chunks that place a token, as one ``LayerGroup``, and their lookup handles. The
        request's mapping is passed whole where every chunk places (the usual case); otherwise the
        chunks that place nothing are left out, objects and slots."""
        chunks = self.req.chunks
        tokens = [c.num_tokens for c in chunks]
        if all(c.places() for c in chunks):
            return LayerGroup(self.objs, self.slots, tokens), self.handles
        keep = [i for i, c in enumerate(chunks) if c.places()]
        offs = [0]
        for t in tokens:
            offs.append(offs[-1] + t)
        slots = joined_slots([self.slots[offs[i] : offs[i + 1]] for i in keep])
        objs = self.objs.take(keep) if isinstance(self.objs, PoolObjects) else [self.objs[i] for i in keep]
        group = LayerGroup(objs, slots, [tokens[i] for i in keep])
        return group, [self.handles[i] for i in keep]


@dataclass
class PinnedLoad:
    """A load looked up and pinned, checked, not yet placed (``KVTransferEngine.pin``).

    ``ready``: the requests whose every chunk is present with the right size (``ReadyRequest``);
    ``failed``: req_id -> why. Nothing of a failed request is ever placed. The pins hold until
    ``KVTransferEngine.release``.
    """

    ready: list[ReadyRequest] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    server_lost: bool = False
    seconds: float = 0.0


@dataclass
class LookedUp:
    """A load looked up and pinned (``KVTransferEngine.look_up``), nothing checked or issued yet.

    ``handles`` is None when nothing was looked up or the lookup failed (every request is then in
    ``report.failed``); otherwise one pinned handle (or None: missing) per key, ``index`` giving each
    key's position. The pins pass to the ``InflightLoad`` that ``issue_load`` makes of it.
    """

    requests: list[RequestTransfer]
    report: LoadReport
    index: dict[str, int]
    handles: list[Any] | None
    t0: float


@dataclass
class IssuedScatter:
    """The placements of one load, issued as one scatter over every chunk of every request.

    ``requests``: (request, chunks, bytes) of each request whose chunks went into the scatter;
    ``owner[i]``: the position in ``requests`` of the request scatter item i belongs to, so a
    chunk that fails alone fails only its request. ``objs``/``slots`` are gathered before issue
    (the slots deferred: the path makes them once its first copy is queued), ``transfer`` is the
    path's handle once issued (None: nothing to place).
    """

    requests: list[tuple[RequestTransfer, int, int]] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)
    objs: list[torch.Tensor] = field(default_factory=list)
    slots: DeferredSlots = field(default_factory=DeferredSlots)
    placed: list[Any] = field(default_factory=list)  # item i's lookup handle (its committed checksum)
    transfer: Any = None

    def add(
        self,
        req: RequestTransfer,
        block_size: int,
        placed: list[tuple[torch.Tensor, int, int, Any]],
        nbytes: int,
    ) -> None:
        """``req`` with its placed chunks: (object, the chunk's first row in the request's mapping,
        its tokens, lookup handle) each."""
        k = len(self.requests)
        self.requests.append((req, len(req.chunks), nbytes))
        r = self.slots.add_request(req, block_size)
        for o, row, tokens, h in placed:
            self.objs.append(o)
            self.slots.add_item(r, row, tokens)
            self.placed.append(h)
            self.owner.append(k)

    def group_by_chunk(self) -> int:
        """Reorder the items so the ones of the same pool entry (one prefix chunk wanted by several
        requests) are adjacent, groups in first-seen order; the path then copies it once for all
        (``DevicePipeline`` shares a copy between consecutive objects over one page). Items keep
        their own slots, owner and handle. Returns how many items repeat an earlier one's chunk."""
        first: dict[int, int] = {}
        for i, h in enumerate(self.placed):
            first.setdefault(id(h), i)  # one lookup handle per unique key (one pin per key)
        repeats = len(self.placed) - len(first)
        if repeats:
            order = sorted(range(len(self.placed)), key=lambda i: (first[id(self.placed[i])], i))
            self.objs = [self.objs[i] for i in order]
            self.slots.reorder(order)
            self.placed = [self.placed[i] for i in order]
            self.owner = [self.owner[i] for i in order]
        return repeats


class InflightLoad:
    """A load looked up, pinned and issued (``KVTransferEngine.start_load``); it may still be running.

    Invariants: ``done()`` never blocks. ``collect()`` gives the final report: a request is in
    ``loaded_req_ids`` only if every transfer of it completed without error (a failure of the
    whole scatter fails every request in it; a chunk that failed alone fails its request); after a
    transfer error the path is settled before anything is unpinned. ``release()`` unpins exactly
    once, and never before the transfer completed (it collects, i.e. waits, first if needed).
    """

    def __init__(
        self,
        engine: KVTransferEngine,
        report: LoadReport,
        handles: list[Any],
        issued: IssuedScatter,
        t0: float,
    ) -> None:
        self.engine = engine
        self.report = report  # failures at lookup, check and issue are in it already
        self._handles = handles  # the pinned lookup handles (None: missing key)
        self._issued = issued
        self._error: BaseException | None = None  # raised by the transfer's done()
        self._t0 = t0
        self._collected = False
        self._released = False

    @property
    def num_requests(self) -> int:
        """Requests whose placement was issued (and not yet collected)."""
        return len(self._issued.requests)

    def done(self) -> bool:
        """True once the issued transfer completed or failed (non-blocking)."""
        transfer = self._issued.transfer
        if transfer is None or self._error is not None:
            return True
        try:
            return bool(transfer.done())
        except Exception as e:  # an error at completion: collect() fails the requests
            self._error = e
            return True

    def collect(self) -> LoadReport:
        """The final report (idempotent). Waits for a transfer still running: none once ``done()``."""
        if self._collected:
            return self.report
        self._collected = True
        rep, batch = self.report, self._issued
        self._issued = IssuedScatter()
        failed: dict[int, str] = {}
        bad: list[int] = []  # scatter items whose placed bytes failed their checksum
        err = self._error
        if err is None and batch.transfer is not None:
            try:
                t_wait = time.perf_counter()
                batch.transfer.wait()
                rep.phases["wait"] = time.perf_counter() - t_wait
                for item, why in batch.transfer.failed_items().items():
                    failed.setdefault(batch.owner[item], f"placing chunk {item} failed: {why}")
                bad = batch.transfer.mismatched()
            except Exception as e:
                err = e
        if err is not None:  # reported as a load error: vLLM recomputes these blocks
            why = f"placing the chunks failed: {type(err).__name__}: {err}"
            failed = dict.fromkeys(range(len(batch.requests)), why)
            bad = []
        corrupt_of: dict[int, list[Any]] = {}
        for item in bad:
            corrupt_of.setdefault(batch.owner[item], []).append(batch.placed[item])
        verified = 0
        if self.engine.verify:
            verified = sum(1 for k in batch.owner if k not in failed) - len(bad)
        corrupt: list[Any] = []
        for k, (req, nchunks, nbytes) in enumerate(batch.requests):
            if k in failed:
                rep.failed[req.req_id] = failed[k]
                continue
            if k in corrupt_of:  # all or nothing: the request is recomputed, its good chunks included
                corrupt += corrupt_of[k]
                rep.failed[req.req_id] = mismatch_reason(corrupt_of[k])
                continue
            rep.loaded_req_ids.append(req.req_id)
            rep.tokens += req.num_placed_tokens()
            rep.chunks += nchunks
            rep.bytes += nbytes
        del batch  # the transfer drops its tensors over the pool pages with it
        corrupt = list({id(h): h for h in corrupt}.values())  # a chunk shared by requests: once
        if verified or corrupt:
            self.engine.report_corrupt(corrupt, verified)
        if failed:
            self.engine.path.settle()  # a failed transfer may leave copies queued: drain before unpinning
        rep.seconds = time.perf_counter() - self._t0
        return rep

    def release(self) -> None:
        """Unpin every chunk of the load, once, after its transfers completed (collects first)."""
        if self._released:
            return
        self._released = True
        try:
            if not self._collected:
                self.collect()
        finally:
            handles, self._handles = self._handles, []
            self.engine.unpin(handles)

    def finish(self) -> LoadReport:
        """``collect`` then ``release``: the synchronous load."""
        rep = self.collect()
        self.release()
        return rep


class LayerByLayerLoad:
    """The layer-overlap load of one step, issued from a ``PinnedLoad`` whose pins it owns.

    ``report`` holds, from issue on, every ready request as loaded, or all of them failed when the
    issue failed (known before the forward reads anything). ``wait_for_layer(i)`` / ``wait_all()``
    make the caller wait for layer i / every layer (its CUDA stream on the pipelined path, the host
    otherwise). ``finish()`` waits for completion and moves the requests whose placement failed
    since issue to ``report.failed`` (``late_failures`` names them). ``release()`` unpins exactly
    once, after completion.
    """

    def __init__(self, engine: KVTransferEngine, pinned: PinnedLoad) -> None:
        t0 = time.perf_counter()
        self.engine = engine
        self.num_layers = engine.num_layers
        self.report = LoadReport(failed=dict(pinned.failed), server_lost=pinned.server_lost)
        self.late_failures: dict[str, str] = {}
        self.handle: LayerHandle | None = None
        self._pinned = pinned
        self._finished = False
        self._released = False
        ready, pinned.ready = pinned.ready, []  # the handle keeps the tensors it needs
        self._reqs = [r.req for r in ready]
        self._bytes = {r.req.req_id: r.nbytes for r in ready}
        groups: list[LayerGroup] = []
        expected, segments = [], []
        self._placed: list[tuple[int, Any]] = []  # (group, lookup handle) of each placed chunk, flat
        for g, r in enumerate(ready):
            group, hs = r.placed()
            groups.append(group)
            expected.append([h.checksum for h in hs])
            segments.append([h.segments for h in hs])
            self._placed += [(g, h) for h in hs]
        t1 = time.perf_counter()
        try:
            if any(g.objs for g in groups):
                verify = engine.verify
                self.handle = engine.path.scatter_layers(
                    groups, expected if verify else None, segments if verify else None
                )
        except Exception as e:
            why = f"placing the layers failed: {type(e).__name__}: {e}"
            for req in self._reqs:
                self.report.failed[req.req_id] = why
            self._reqs = []
        for r in ready:
            req = r.req
            if req.req_id not in self.report.failed:
                self.report.loaded_req_ids.append(req.req_id)
                self.report.tokens += req.num_placed_tokens()
                self.report.chunks += len(r.objs)
                self.report.bytes += r.nbytes
        del groups, ready
        t2 = time.perf_counter()
        # Where the host time went (the worker's timing line): the pins and each request's objects
        # and slots (``KVTransferEngine.pin``), the per-group lists here, the path's issue.
        self.report.phases.update(pin=pinned.seconds, prepare=t1 - t0, issue=t2 - t1)
        self.report.seconds = pinned.seconds + t2 - t0

    def wait_for_layer(self, layer: int) -> None:
        if self.handle is not None:
            self.handle.wait_for_layer(layer)

    def wait_all(self) -> None:
        """The caller waits for every layer. A verifying load also blocks the host until its
        checksums are known, so that ``done()`` is true after it and a mismatch is reported in
        this step, before vLLM takes the request as loaded."""
        if self.handle is not None:
            self.handle.wait_all()
            if self.engine.verify:
                try:
                    self.handle.wait()
                except Exception:  # finish() reports it
                    pass

    def layer_done(self, layer: int) -> bool:
        return self.handle is None or self.handle.layer_done(layer)

    def done(self) -> bool:
        """True once every layer is placed (or the load failed). Never blocks."""
        if self.handle is None or self._finished:
            return True
        try:
            return self.handle.done()
        except Exception:  # the error comes back from wait() in finish()
            return True

    def finish(self) -> LoadReport:
        """Wait for every layer; the final report (idempotent)."""
        if self._finished:
            return self.report
        self._finished = True
        handle = self.handle
        if handle is None:
            return self.report
        failed: dict[int, str] = {}
        try:
            handle.wait()
            failed = handle.failed_items()
            bad = handle.mismatched()
            corrupt = [self._placed[i][1] for i in bad]
            for g in sorted({self._placed[i][0] for i in bad}):
                failed.setdefault(
                    g, mismatch_reason([h for gg, h in (self._placed[i] for i in bad) if gg == g])
                )
            if self.engine.verify:
                self.engine.report_corrupt(corrupt, len(self._placed) - len(bad))
        except Exception as e:
            why = f"placing the layers failed: {type(e).__name__}: {e}"
            logger.error("Maru: the layer-overlap load of %d requests failed (%s)", len(self._reqs), why)
            failed = dict.fromkeys(range(len(self._reqs)), why)
            self.engine.path.settle()  # no copy may still read a page we unpin
        self.report.seconds += handle.host_seconds
        self.report.unread_bytes = handle.unread_bytes
        for g, why in failed.items():
            self._take_back(self._reqs[g], why)
        return self.report

    def fail_placed(self, why: str) -> list[str]:
        """Take back every request this load reported placed (``late_failures``, ``report.failed``):
        whatever read them may have read them before they were placed. The requests taken back."""
        taken = [req for req in self._reqs if req.req_id in self.report.loaded_req_ids]
        for req in taken:
            self._take_back(req, why)
        return [req.req_id for req in taken]

    def _take_back(self, req: RequestTransfer, why: str) -> None:
        if req.req_id in self.report.loaded_req_ids:
            self.report.loaded_req_ids.remove(req.req_id)
            self.report.tokens -= req.num_placed_tokens()
            self.report.chunks -= len(req.chunks)
            self.report.bytes -= self._bytes.get(req.req_id, 0)
        self.report.failed[req.req_id] = why
        self.late_failures[req.req_id] = why

    def wait(self) -> LoadReport:
        """``finish`` then ``release``: block until every layer is placed, unpin; the final report."""
        self.release()
        return self.report

    def release(self) -> None:
        """Unpin (once), after the transfer completed: blocks on it when ``done()`` is not yet true."""
        if self._released:
            return
        self._released = True
        try:
            self.finish()
        finally:
            self.handle = None  # drops the tensors over the pool pages before unpinning
            self.engine.release(self._pinned)


def mismatch_reason(corrupt: list[Any]) -> str:
    """Why a request failed whose chunks ``corrupt`` (lookup handles) failed their checksum."""
    keys = ", ".join(h.key for h in corrupt[:3]) + (", ..." if len(corrupt) > 3 else "")
    return (
        f"{len(corrupt)} chunk(s) ({keys}) do not match the checksum their writer committed (another "
        "process wrote into their pool space); served as a miss, reported to the server"
    )
