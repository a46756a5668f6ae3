"""``KVTransferEngine``: a worker's paged KV cache <-> pool objects, on one data path.

Given the per-layer caches, their ``KVLayout`` and a Maru client, it stores chunks (reserve pool
objects, gather every layer's KV of a token range into them, then publish a step's objects in one
commit) and loads them (one lookup-and-pin round trip, scatter, unpin). How the bytes move is the
``DataPath`` (``maru.transfer.paths``); the engine holds no path-specific branch. Requests are
plain ``RequestTransfer`` records, so tests and benchmarks drive it with synthetic caches.

Invariants:
- A key is published only after its object is completely written (write, then commit).
- A load is all or nothing per request: if any of its chunks is missing, has the wrong size or
  fails to scatter, the request is reported failed, never partially trusted. Every pinned
  handle is released, after the transfers that read its page completed.
- Maru-side problems never raise out of ``store``/``load``; they come back in the reports.
- Integrity (``verify``, the default): every placed chunk's bytes, as the path placed them, are
  checked against the checksum its writer committed (``DataPath.scatter``'s ``expected``); a
  mismatch fails the request like a missing chunk, and is counted and reported to the server
  (``client.report_corrupt``). Stores commit the checksums the path computed from the bytes it
  wrote (device paths), else the client computes them over the pool object.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from maru import segments
from maru.announce import announce_once
from maru.client.objects import Retrieved
from maru.errors import CONNECTION_LOST, MaruError
from maru.kv_ops.geometry import ObjectGeometry
from maru.kv_ops.pool_objects import PoolObjects
from maru.transfer.loads import (
    InflightLoad,
    IssuedScatter,
    LayerByLayerLoad,
    LookedUp,
    PinnedLoad,
    ReadyRequest,
    StepObjects,
)
from maru.transfer.paths import DataPath, choose_path
from maru.transfer.records import (
    LoadReport,
    RequestTransfer,
    blocks_needed,
    chunk_slots,
    many_chunk_slots,
    too_few_blocks,
    unique_keys,
)
from maru.transfer.slot_plan import DeferredSlots
from maru.transfer.store_side import StoreSide

logger = logging.getLogger("maru.transfer")


class KVTransferEngine(StoreSide):
    """Moves chunks between one worker's paged KV cache and the pool. One instance per worker.

    ``caches``: the per-layer cache tensors in layer order (or a one-element list holding a
    cross-layer tensor); ``layout``: what ``kv_ops.detect_layouts`` found for them; ``client``: a
    connected ``MaruHandler`` (or anything with its ``batch_alloc``/``batch_store``/``abort``/
    ``batch_retrieve``/``batch_release``/``report_corrupt``). ``path``: the data path (default:
    ``choose_path``). ``verify``: the path checks the bytes it placed (see above); False: the client
    checks them on the CPU before placing (``batch_retrieve(verify=True)``, ~1 GB/s a core).
    ``chunk_tokens``: the chunk size, whose placement graphs the GPU path captures at build.
    ``paced_store``: write-behind stores (``issue_store``) yield the copy engine between chunks and
    share no stream with loads (``kv_ops.paced_store``: the inference engine's own small copies and
    the next step's loads are not held behind a whole store).
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        layout: Any,
        client: Any,
        *,
        backend: str | None = None,
        pipelined: bool = True,
        path: DataPath | None = None,
        verify: bool = True,
        chunk_tokens: int | None = None,
        paced_store: bool = True,
        segment_tokens: int | None = None,
        layer_path: str = "auto",
    ) -> None:
        if not caches:
            raise ValueError("no KV caches to transfer")
        self.caches = list(caches)
        self.layout = layout
        self.client = client
        self.block_size = int(layout.block_size)
        self.geometry = ObjectGeometry.of(self.caches[0] if layout.is_cross_layer else self.caches, layout)
        self.num_layers = self.geometry.num_layers
        self.device = self.caches[0].device
        self.path = path or choose_path(
            self.caches, layout, client, backend=backend, pipelined=pipelined, chunk_tokens=chunk_tokens,
            layer_path=layer_path,
        )  # fmt: skip
        self.verify = verify
        self.paced_store = paced_store
        # Stores commit segment sums with each checksum (maru.segments): a load that places only
        # a chunk's last tokens then reads only their segments. 0 turns them off.
        row_bytes = int(layout.row_size) * self.caches[0].element_size()
        if segment_tokens is None and chunk_tokens:
            if row_bytes % 8 == 0:
                segment_tokens = segments.segment_tokens(self.block_size, int(chunk_tokens))
            else:
                self.path.no_segments = f"a row of the cache is {row_bytes} bytes, not whole 8-byte words"
        self.path.segment_tokens = segment_tokens or None
        self._pool_map: Any = None  # the client's pool mapping whose address ``_pool_base`` is
        self._pool_base = 0

    @property
    def paces_stores(self) -> bool:
        """Write-behind stores are paced: asked for (``paced_store``) and the path really paces them."""
        return self.paced_store and self.path.paces_stores

    @property
    def data_path(self) -> str:
        """Which path moves the bytes: "cpu", "pipelined" or "staged"."""
        return self.path.name

    @property
    def host_registration(self) -> Any:
        """``cuda_host``'s record for the pool mapping (None where no registration was attempted)."""
        return self.path.registration

    def close(self) -> None:
        """Wait for queued transfers and unregister the pool mapping from CUDA (idempotent).

        Call before the client closes (unmaps) the pool: a registration outliving its mapping would
        let CUDA copy to pages that are no longer the pool's.
        """
        self.path.close()

    # ------------------------------------------------------------------ load
    def load(self, requests: Sequence[RequestTransfer]) -> LoadReport:
        """Place every request's chunks into the paged cache: one lookup-and-pin for all keys.

        All or nothing per request. Returns once every placement completed and the pins are released.
        """
        return self.start_load(requests).finish()

    def start_load(self, requests: Sequence[RequestTransfer]) -> InflightLoad:
        """Look up and pin every chunk (one round trip), check each request, issue one scatter for
        the chunks of every request that passed (one path call for the whole step).

        Returns without waiting where the path is asynchronous (poll ``InflightLoad.done()``). The
        pins are released by ``InflightLoad.release``/``finish``, or here if this raises.
        """
        return self.issue_load(self.look_up(requests))

    def look_up(self, requests: Sequence[RequestTransfer]) -> LookedUp:
        """The first half of ``start_load``: one lookup-and-pin round trip, no tensor work.

        Safe on a helper thread: it holds the GIL only to send and parse one message. The pins
        belong to the result until ``issue_load`` hands them to its ``InflightLoad``.
        """
        t0 = time.perf_counter()
        rep = LoadReport()
        index, handles, rep.server_lost = self._lookup_pinned(requests, rep.failed)
        rep.phases["lookup"] = time.perf_counter() - t0
        return LookedUp(list(requests), rep, index, handles, t0)

    def issue_load(self, looked: LookedUp) -> InflightLoad:
        """The second half of ``start_load``: check each request and issue one scatter for all.

        Unpins everything (one round trip) if it raises."""
        if looked.handles is None:
            return InflightLoad(self, looked.report, [], IssuedScatter(), looked.t0)
        batch = IssuedScatter()
        t1 = time.perf_counter()
        with self._issuing(looked):
            return self._issue_checked(looked, batch, t1)

    def _issuing(self, looked: LookedUp) -> contextlib.AbstractContextManager[Any]:
        """The path held for this load's issue, with the copy of its first placed chunk queued at
        once (``DevicePipeline.issuing``): a one-chunk load is on the bus while its checks and
        objects are made. Only where the pool's address in this process is known."""
        pipe = self.path.pipeline
        if pipe is None or not pipe.on_gpu or looked.handles is None or not self._pool_address():
            return contextlib.nullcontext()
        for req in looked.requests:
            for c in req.chunks:
                if c.places():
                    h = looked.handles[looked.index[c.key]]
                    if h is None or h.view is None:
                        return contextlib.nullcontext()
                    # The page's bounds were checked when its view was made (lookup or held pin).
                    return pipe.issuing(self._pool_base + h.offset, int(h.size), c.num_tokens)  # type: ignore[no-any-return]
        return contextlib.nullcontext()

    def _pool_address(self) -> int:
        """The client's pool mapping's address in this process, as of now (a server that came
        back with another pool is mapped anew: the lookups' offsets are in the new mapping);
        0 where the client maps no pool (a test's)."""
        try:
            mapping = self.client.pool_mapping
            if mapping is not self._pool_map:
                address = mapping.address
                self._pool_map, self._pool_base = mapping, address if isinstance(address, int) else 0
        except Exception:
            return 0
        return self._pool_base

    def _issue_checked(self, looked: LookedUp, batch: IssuedScatter, t1: float) -> InflightLoad:
        rep, index, handles = looked.report, looked.index, looked.handles
        assert handles is not None
        try:
            checked = []
            for req in looked.requests:
                why = self._check(req, handles, index)
                if why is None:
                    checked.append(req)
                else:
                    rep.failed[req.req_id] = why
            views = self._views_of(checked, handles, index)
            for req in checked:
                why = self._add_request(req, handles, index, batch, views)
                if why is not None:
                    rep.failed[req.req_id] = why
            t2 = time.perf_counter()
            rep.phases["prepare"] = t2 - t1
            if batch.objs:  # a chunk with nothing to place is not copied at all
                try:
                    batch.group_by_chunk()  # a chunk several requests want: adjacent, copied once
                    expected = [h.checksum for h in batch.placed] if self.verify else None
                    segs = [h.segments for h in batch.placed] if self.verify else None
                    batch.transfer = self.path.scatter(batch.objs, batch.slots, expected, segs)
                    rep.copies_shared = batch.transfer.copies_shared
                    # Host paths complete at issue; the copy engine's whole-chunk loads read all.
                    rep.unread_bytes = batch.transfer.unread_bytes
                    rep.phases["issue"] = time.perf_counter() - t2
                except Exception as e:  # reported as a load error: vLLM recomputes these blocks
                    why = f"placing the chunks failed: {type(e).__name__}: {e}"
                    for req, _, _ in batch.requests:
                        rep.failed[req.req_id] = why
                    batch.requests = []
                batch.objs, batch.slots = [], DeferredSlots()  # the transfer keeps what it reads
        except BaseException:
            self.path.settle()  # unexpected: no copy may still read a page we unpin
            batch = IssuedScatter()
            self.unpin(handles)
            raise
        return InflightLoad(self, rep, handles, batch, looked.t0)

    def _lookup_pinned(
        self, requests: Sequence[RequestTransfer], failed: dict[str, str]
    ) -> tuple[dict[str, int], list[Retrieved | None] | None, bool]:
        """Look up and pin every unique chunk key in one round trip: (key -> position, handles, lost).

        Handles are None when there is nothing to look up or the lookup failed (then every request
        is in ``failed``).
        """
        keys, index = unique_keys(requests)
        if not keys:
            return index, None, False
        handles: list[Any] = [None] * len(keys)
        try:
            # Chunks the scheduler side pinned for these loads: read where it says, no round trip.
            remote = self._held_views(requests, keys, index, handles)
            if remote:
                # verify=False: the path checks the bytes it places (after the copy), not a CPU pass.
                # segments: what lets a load that places a chunk's last tokens read only those.
                got = self.client.batch_retrieve(
                    remote, pin=True, verify=not self.verify, segments=self.verify
                )
                for k, h in zip(remote, got, strict=True):
                    handles[index[k]] = h
        except MaruError as e:
            self.unpin(handles)
            for req in requests:
                failed[req.req_id] = f"lookup failed: {e}"
            return index, None, isinstance(e, CONNECTION_LOST)
        return index, handles, False

    def _held_views(
        self, requests: Sequence[RequestTransfer], keys: list[str], index: dict[str, int], handles: list[Any]
    ) -> list[str]:
        """Fill ``handles`` for the chunks another client holds pinned for these loads
        (``RequestTransfer.held``); return the keys left to look up, in order. Only where the path
        verifies what it places (the committed checksum comes with the location) and the client
        maps the pool. A held handle's pin is its holder's: ``unpin`` only drops its view."""
        held = {h.key: h for req in requests for h in req.held}
        if not held or not self.verify or not hasattr(self.client, "pool_mapping"):
            return keys
        local = [k for k in keys if k in held]
        if not local:
            return keys
        # Bounds-checked against the data region (PoolError, a MaruError, if outside it).
        views = self.client.pool_mapping.read_views([[held[k].offset, held[k].size] for k in local])
        for k, view in zip(local, views, strict=True):
            h = held[k]
            handles[index[k]] = Retrieved(k, h.offset, view, False, None, h.checksum, segments=h.segments)
        return [k for k in keys if k not in held]

    def _objects(
        self,
        req: RequestTransfer,
        handles: list[Any],
        index: dict[str, int],
        views: StepObjects | None = None,
    ) -> tuple[list[Any], Sequence[torch.Tensor]]:
        """(lookup handle, object over its pinned page) of each of ``req``'s chunks; the objects from
        ``views`` (``_views_of``) where given, else made here."""
        hs = [handles[index[c.key]] for c in req.chunks]
        if views is not None:
            return hs, views.of([index[c.key] for c in req.chunks])
        return hs, self.geometry.over_many(
            (h.view, c.num_tokens) for h, c in zip(hs, req.chunks, strict=True)
        )

    def _ready(
        self,
        req: RequestTransfer,
        handles: list[Any],
        index: dict[str, int],
        views: StepObjects | None = None,
        flat: torch.Tensor | None = None,
    ) -> ReadyRequest:
        """``req`` ready to place: its objects over the pinned pages, its slot mapping whole (not
        sliced per chunk), its lookup handles. ``views``: objects made beforehand, by key position
        (``_views_of``); ``flat``: the request's slots made beforehand (``_step_slots``), else made
        here (raising why they cannot be)."""
        if flat is None:
            flat = chunk_slots(req.block_ids, self.block_size, req.chunks)  # one pass for the request
        hs, objs = self._objects(req, handles, index, views)
        return ReadyRequest(req, objs, flat, hs)

    def _add_request(
        self,
        req: RequestTransfer,
        handles: list[Any],
        index: dict[str, int],
        batch: IssuedScatter,
        views: StepObjects | None,
    ) -> str | None:
        """Add ``req``'s placed chunks to ``batch`` (their slots deferred: ``DeferredSlots``), their
        objects from ``views`` (``_views_of``; made here where it is None); None, or why the
        request cannot be placed."""
        try:
            hs, objs = self._objects(req, handles, index, views)
        except Exception as e:
            return f"preparing the chunks failed: {type(e).__name__}: {e}"
        placed, row = [], 0
        for c, h, obj in zip(req.chunks, hs, objs, strict=True):
            if c.places():
                placed.append((obj, row, c.num_tokens, h))
            row += c.num_tokens
        batch.add(req, self.block_size, placed, sum(int(h.size) for h in hs))
        return None

    def _check(self, req: RequestTransfer, handles: list[Any], index: dict[str, int]) -> str | None:
        """None, or why ``req`` cannot be placed: a chunk gone, unverifiable or of another size, or
        too few blocks for its placed tokens. Runs per chunk on every load's pin (64 for a 16k-token
        request): the bytes a token count needs are computed once a call."""
        verify, nbytes = self.verify, self.geometry.nbytes
        sizes: dict[int, int] = {}
        for c in req.chunks:
            h = handles[index[c.key]]
            if h is None:
                return f"chunk {c.key} is gone from the pool (evicted or deleted)"
            if verify and h.checksum is None:
                return (
                    f"chunk {c.key} was committed without a checksum (an older writer): it cannot be verified"
                )
            t = c.num_tokens
            want = sizes.get(t)
            if want is None:
                want = sizes[t] = nbytes(t)
            if h.size != want:
                return (
                    f"chunk {c.key} has {h.size} bytes, expected {want} (another format under the same key?)"
                )
        need = blocks_needed(self.block_size, req.chunks)  # the slots, made later, must not fail
        if need > len(req.block_ids):
            return too_few_blocks(need, self.block_size, len(req.block_ids))
        return None

    def report_corrupt(self, corrupt: list[Any], verified: int) -> None:
        """Count ``verified`` good chunks and report the ``corrupt`` lookup handles (integrity)."""
        report = getattr(self.client, "report_corrupt", None)
        if report is not None:
            report(corrupt, verified=verified)
        elif corrupt:
            logger.warning(
                "Maru: %d loaded chunks failed their checksum (e.g. %s); %s cannot report them",
                len(corrupt),
                corrupt[0].key,
                type(self.client).__name__,
            )

    # ------------------------------------------------------------------ layer by layer
    def pin(self, requests: Sequence[RequestTransfer]) -> PinnedLoad:
        """Look up and pin every chunk of ``requests`` (one round trip) and check them; place nothing.

        A request with any chunk missing or of the wrong size is failed whole, before a single
        layer of it is placed (all or nothing per request).
        """
        t0 = time.perf_counter()
        pl = PinnedLoad()
        index, handles, pl.server_lost = self._lookup_pinned(requests, pl.failed)
        if handles is not None:
            pl.handles = handles
            checked = []
            for req in requests:
                why = self._check(req, handles, index)
                if why is None:
                    checked.append(req)
                else:
                    pl.failed[req.req_id] = why
            views = self._views_of(checked, handles, index)
            flats = self._step_slots(checked)
            for req, flat in zip(checked, flats, strict=True):
                try:
                    pl.ready.append(self._ready(req, handles, index, views, flat))
                except Exception as e:
                    pl.failed[req.req_id] = f"preparing the chunks failed: {type(e).__name__}: {e}"
        pl.seconds = time.perf_counter() - t0
        return pl

    def _step_slots(self, requests: list[RequestTransfer]) -> list[torch.Tensor | None]:
        """Every request's slots in one pass (``many_chunk_slots``; the pin of 32 held turns of two
        chunks: 1.20 -> 0.77 ms median on the CI machine, bench/RESULTS.md); None for a request
        whose slots cannot be made: ``_ready`` then makes them, raising why (it fails alone)."""
        return list(many_chunk_slots([(r.block_ids, r.chunks) for r in requests], self.block_size))

    def _views_of(
        self, requests: list[RequestTransfer], handles: list[Any], index: dict[str, int]
    ) -> StepObjects | None:
        """The objects over the pinned pages the requests place from, one per key: over one tensor
        of the whole pool where the client has one (``PoolObjects``: checked together, each made
        on first use: the direct layer load makes none), else made together by ``over_many`` (one
        warnings scope for a step's objects, not one a request: 15 held turns 0.94-1.43 -> 0.55-0.57
        ms, minimum, on the CI machine: ``bench/load_prep_cpu.py``); None if that fails, and each
        request then makes its own (and fails alone)."""
        # A key's tokens are the same in every request (its size was checked against them).
        tokens = {index[c.key]: c.num_tokens for req in requests for c in req.chunks}
        if not tokens:
            return None
        try:
            mapping = getattr(self.client, "pool_mapping", None)
            if mapping is not None and hasattr(mapping, "read_tensor"):
                # By offset over one tensor of the whole pool: the pages' offsets were bounds-checked
                # when their views were made (``read_views``), and each view is that very range.
                g = self.geometry
                objs: Sequence[torch.Tensor] = PoolObjects.make(
                    mapping.read_tensor(g.dtype), g, [(handles[i].offset, t) for i, t in tokens.items()]
                )
            else:
                objs = self.geometry.over_many((handles[i].view, t) for i, t in tokens.items())
        except Exception as e:
            # Not expected (the pages were bounds-checked); each request then makes its own objects
            # and fails alone, with the reason, if its own cannot be made either: slower, not wrong.
            announce_once(
                logger,
                "transfer.step-objects",
                logging.WARNING,
                "Maru: making a load step's chunk objects together failed (%s: %s); each request makes "
                "its own (slower host prep). Please report it with this line",
                type(e).__name__,
                e,
            )
            return None
        return StepObjects(objs, {k: i for i, k in enumerate(tokens)})

    def start_layer_load(self, pinned: PinnedLoad) -> LayerByLayerLoad:
        """Start placing ``pinned`` layer by layer (the layer-overlap load); it owns the pins now."""
        return LayerByLayerLoad(self, pinned)

    def release(self, pl: PinnedLoad) -> None:
        """Unpin what ``pin`` pinned (object tensors over the pool pages are dropped first)."""
        pl.ready = []
        handles, pl.handles = pl.handles, []
        self.unpin(handles)

    def unpin(self, handles: list[Any]) -> None:
        """Release pinned lookup handles (None entries skipped) with one UNPIN sent without waiting
        for its reply; never raises a ``MaruError`` (logged: the heartbeat or the lease frees them).
        Callers drop their tensors over the pages first."""
        handles = [h for h in handles if h is not None]
        if not handles:
            return
        try:
            # Without waiting for the reply: the server applies it before our next request, and
            # the load is done once its bytes are placed (one round trip less per load).
            self.client.batch_release(handles, wait=False)
        except MaruError as e:
            logger.warning(
                "Maru: unpinning %d loaded chunks failed (%s); the lease frees them", len(handles), e
            )
