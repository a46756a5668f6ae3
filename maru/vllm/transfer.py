"""The transfer engine: paged KV cache <-> pool objects, independent of vLLM.

Given the registered per-layer caches, their ``KVLayout`` and a Maru client, it stores chunks
(gather every layer's KV of a token range straight into a reserved pool object, then publish
all of a step's objects in one commit) and loads them (one lookup-and-pin round trip, scatter,
unpin). It knows nothing of vLLM: requests are plain ``RequestTransfer`` records (block ids and
chunk references), which is what lets tests and benchmarks drive it with synthetic caches of
any layout, and what the GPU data path builds on.

Object format (one key per chunk): ``kv_ops``' canonical ``[num_layers, num_kv, tokens,
row]`` (``num_kv`` = 2: K plane then V plane per layer; 1 for MLA), in the cache's dtype.

Data paths: on CPU caches kv_ops runs straight on pool memory. On CUDA caches the engine
registers the pool mapping with CUDA once and moves chunks through ``kv_ops.pipeline.
TransferEngine`` (``data_path == "pipelined"``): a store waits for the D2H copies before anything
is committed, a load waits for the H2D copies and placements before anything is unpinned. If
that engine cannot be built the announced staged path copies each chunk through device memory.

Loads that do not wait (the worker's optional paths): ``start_load`` issues and returns an
``InflightLoad`` (polled with ``done()``; ``AsyncLoader`` runs it on a loader thread for
``maru_async_load``), and ``start_layer_load`` issues one ``load_layers`` for a step's requests
(``PipelinedLayerLoad``, ``maru_overlap_load_with_compute``; on CPU caches the ``LayerwiseLoad``
thread). Either way the pins are released only once the transfers completed.

Invariants:
- A key is published only after its object is completely written (write, then commit).
- A load is all or nothing per request: if any of its chunks is missing, has the wrong size,
  or fails to scatter, the request is reported failed (its KV must be recomputed), never
  partially trusted. Every pinned handle is released, whatever happens.
- Maru-side problems never raise out of ``store``/``load``; they come back in the reports.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from maru import kv_ops
from maru.errors import HandlerClosedError, MaruError, MaruTimeoutError, NotConnectedError

_LOST = (NotConnectedError, MaruTimeoutError, HandlerClosedError)

logger = logging.getLogger("maru.vllm")


@dataclass(frozen=True)
class ChunkRef:
    """One pool object of a request: ``num_tokens`` tokens starting at request token ``start``.

    Only object tokens ``[place_begin, place_end)`` are placed into (load) the paged cache; the
    others are skipped (they are already computed locally, or beyond what vLLM takes). For a
    store the whole object is gathered (``place_*`` are ignored).
    """

    key: str
    start: int
    num_tokens: int
    place_begin: int = 0
    place_end: int = -1  # -1: num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def placed(self) -> tuple[int, int]:
        pe = self.num_tokens if self.place_end < 0 else self.place_end
        return self.place_begin, pe


@dataclass(frozen=True)
class RequestTransfer:
    """The chunks of one request moved in one step, and the request's block table.

    ``block_ids[i]`` holds request tokens ``[i*BS, (i+1)*BS)``; it must cover every chunk.
    """

    req_id: str
    block_ids: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]

    def num_placed_tokens(self) -> int:
        return sum(pe - pb for pb, pe in (c.placed() for c in self.chunks))

    def block_ids_of(self, begin: int, end: int, block_size: int) -> set[int]:
        """Block ids holding request tokens ``[begin, end)``."""
        if end <= begin:
            return set()
        return set(self.block_ids[begin // block_size : (end + block_size - 1) // block_size])

    def placed_block_ids(self, block_size: int) -> set[int]:
        out: set[int] = set()
        for c in self.chunks:
            pb, pe = c.placed()
            out |= self.block_ids_of(c.start + pb, c.start + pe, block_size)
        return out


@dataclass
class StoreReport:
    stored: int = 0
    present: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    server_lost: bool = False  # the failure was the server itself (unreachable, timed out)


@dataclass
class LoadReport:
    loaded_req_ids: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # req_id -> why
    chunks: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    server_lost: bool = False


@dataclass
class PreparedStore:
    """Chunks gathered into reserved pool objects, not yet published (``prepare_store``)."""

    report: StoreReport
    keys: list[str] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _IssuedGather:
    """A pipelined gather queued on the ``TransferEngine`` whose copies may still run."""

    handle: Any
    ok: list[tuple[ChunkRef, Any]]
    bad: list[Any]
    outs: list[torch.Tensor]  # tensors over the pool pages: alive until the copies completed


@dataclass
class PendingStore:
    """A write-behind store between ``issue_store`` (forward thread) and ``complete_store`` (drain).

    Invariants: ``read_done`` is set once the paged cache is no longer read for this store (the
    gather completed or was given up); ``cancelled`` is only ever set before that, by a
    ``wait_store_read`` that timed out, and then ``complete_store`` aborts every object instead
    of publishing bytes that may have been read from overwritten blocks. ``started`` (CPU
    caches): the gather was taken, by the drain thread or by the preemption barrier; it is
    taken exactly once (under ``lock``).
    """

    requests: list[RequestTransfer]
    prep: PreparedStore
    issued: _IssuedGather | None = None  # pipelined: the gather in flight
    read_done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    started: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def req_ids(self) -> frozenset[str]:
        return frozenset(r.req_id for r in self.requests)


@dataclass
class PinnedLoad:
    """A load looked up and pinned, checked, not yet placed (``KVTransferEngine.pin``).

    ``ready``: the requests whose every chunk is present with the right size, each with its
    (object tensor, slot mapping) per chunk; ``failed``: req_id -> why. Nothing of a failed
    request is ever placed. The pins hold until ``KVTransferEngine.release``.
    """

    ready: list[tuple[RequestTransfer, list[tuple[torch.Tensor, torch.Tensor, int]]]] = field(
        default_factory=list
    )
    failed: dict[str, str] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)
    server_lost: bool = False
    seconds: float = 0.0


def slot_mapping(
    block_ids: Sequence[int],
    block_size: int,
    start: int,
    num_tokens: int,
    place: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Slots of request tokens ``[start, start+num_tokens)`` (int64); -1 outside ``place`` (object offsets).

    Only the placed tokens need blocks: vLLM may not have allocated blocks for the rest.
    """
    pb, pe = place if place is not None else (0, num_tokens)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    if pe <= pb:
        return slots
    first, last = start + pb, start + pe
    nblocks = (last + block_size - 1) // block_size
    if nblocks > len(block_ids):
        raise ValueError(
            f"tokens up to {last} need {nblocks} blocks of {block_size}, the request has {len(block_ids)}"
        )
    # Only the blocks under [first, last): a chunk's cost must not grow with its position in the
    # request (converting the whole block table per chunk made a 64-chunk load O(n^2)).
    b0 = first // block_size
    pos = torch.arange(first, last, dtype=torch.int64)
    table = torch.as_tensor(list(block_ids[b0:nblocks]), dtype=torch.int64)
    slots[pb:pe] = table[pos // block_size - b0] * block_size + pos % block_size
    return slots


# The layer-overlap load replays CUDA graphs captured at start for every power-of-two bucket up to
# this many tokens (one graph per layer and bucket, ~10 ms a bucket for 32 layers on an H200).
LAYER_WARM_TOKENS = 16384


def _buckets_up_to(tokens: int) -> list[int]:
    out, tb = [], 16
    while tb <= tokens:
        out.append(tb)
        tb *= 2
    return out


class KVTransferEngine:
    """Moves chunks between one worker's paged KV cache and the pool. One instance per worker.

    ``caches`` are the per-layer cache tensors in layer order (or a one-element list holding a
    cross-layer tensor), ``layout`` what ``kv_ops.detect_layout`` found for them, ``client`` a
    connected ``MaruHandler`` (or anything with its ``batch_alloc``/``batch_store``/``abort``/
    ``batch_retrieve``/``batch_release`` methods).
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        layout: Any,
        client: Any,
        *,
        backend: str | None = None,
        pipelined: bool = True,
    ) -> None:
        if not caches:
            raise ValueError("no KV caches to transfer")
        self.caches = list(caches)
        self.layout = layout
        self.client = client
        self.backend = backend
        self.block_size = int(layout.block_size)
        self.dtype = self.caches[0].dtype
        # A cross-layer cache is one tensor holding every layer.
        self.num_layers = int(layout.num_layers) if layout.is_cross_layer else len(self.caches)
        self.num_kv = int(layout.num_kv)
        self.row = int(layout.row_size)
        self.elem = torch.empty((), dtype=self.dtype).element_size()
        self.device = self.caches[0].device
        # "cpu": kv_ops straight on pool memory; "pipelined": kv_ops.pipeline.TransferEngine (copy
        # engine and placement kernels overlapped through staging); "staged": per-chunk device
        # staging with plain host copies (the announced slower path).
        self.data_path = "cpu"
        self.pipeline: Any = None  # the TransferEngine on CUDA caches
        self.host_registration: Any = None  # cuda_host's record for the pool mapping
        self._registered_mapping: Any = None  # unregistered by close(), before the handler unmaps it
        if self.device.type == "cuda" and pipelined:
            self.pipeline = self._build_pipeline()
        if self.pipeline is not None:
            self.data_path = "pipelined"
        elif self.device.type != "cpu":
            self.data_path = "staged"
            # Correct but not the fast path: pageable copies through a staging tensor on the device.
            logger.warning(
                "Maru: KV cache on %s: chunks are staged through device memory and copied to/from "
                "the pool with plain (unregistered) host copies; expect host-copy bandwidth. Fix: CUDA "
                "caches with a working kv_ops.pipeline (see the warning above, if any)",
                self.device,
            )

    def _build_pipeline(self) -> Any:
        """Register the pool mapping with CUDA (once per process) and build the ``TransferEngine``.

        A failed registration is announced by ``cuda_host`` (reason and fix) and the engine still
        runs, on pageable copies (announced again by the engine). A failure to build the engine
        returns None: the caller falls back to the staged path and announces it.
        """
        try:
            from maru.client import cuda_host
            from maru.kv_ops.pipeline import TransferEngine

            mapped = getattr(self.client, "_mapped", None)
            if callable(mapped):
                mapping = mapped()
                self.host_registration = cuda_host.register_host_mapping(mapping)
                if self.host_registration.registered:
                    self._registered_mapping = mapping
            else:
                logger.warning(
                    "Maru: the client %s exposes no pool mapping; pool pages are not registered with "
                    "CUDA and pool<->GPU copies are pageable (slower). Fix: use a MaruHandler",
                    type(self.client).__name__,
                )
            caches = self.caches[0] if self.layout.is_cross_layer else self.caches
            # The chunk paths run eager launches (a graph captured on first use could be captured on
            # the loader thread while the forward runs on another). The layer-overlap path, whose
            # per-layer issue cost is what it is judged on, replays graphs captured HERE, at start,
            # for every power-of-two bucket up to LAYER_WARM_TOKENS; nothing is captured while
            # serving (lazy_capture=False): a larger load launches eagerly, announced.
            engine = TransferEngine(
                caches,
                self.layout,
                backend=self.backend,
                use_graphs=False,
                layer_graphs=True,
                lazy_capture=False,
            )
            if engine.layer_graphs and LAYER_WARM_TOKENS:
                t0 = time.perf_counter()
                engine.warm(0, layer_tokens=_buckets_up_to(LAYER_WARM_TOKENS))
                logger.info(
                    "Maru: layer-overlap graphs captured for loads up to %d tokens in %.2f s",
                    LAYER_WARM_TOKENS,
                    time.perf_counter() - t0,
                )
            return engine
        except Exception as e:  # any problem here must leave a working (slower) connector
            logger.warning(
                "Maru: the pipelined GPU transfer engine could not be built (%s: %s); using the staged "
                "per-chunk path",
                type(e).__name__,
                e,
            )
            return None

    def close(self) -> None:
        """Wait for queued GPU transfers and unregister the pool mapping this engine registered.

        Call before the client closes (unmaps) the pool: a registration outliving its mapping would
        let CUDA copy to pages that are no longer the pool's. Idempotent; never raises.
        """
        if self.pipeline is not None:
            self._settle()
        mapping, self._registered_mapping = self._registered_mapping, None
        if mapping is None:
            return
        try:
            from maru.client import cuda_host

            cuda_host.unregister_host_mapping(mapping)
        except Exception as e:
            logger.warning("Maru: unregistering the pool mapping from CUDA failed: %s", e)

    # ------------------------------------------------------------------ geometry
    def object_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv, num_tokens, self.row)

    def object_nbytes(self, num_tokens: int) -> int:
        return self.num_layers * self.num_kv * num_tokens * self.row * self.elem

    def _tensor_over(self, buf: memoryview, num_tokens: int) -> torch.Tensor:
        with warnings.catch_warnings():
            # Loads read a read-only view; torch warns that writing it would be undefined. We only read.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buf, dtype=torch.uint8)
        return flat.view(self.dtype).view(self.object_shape(num_tokens))

    # ------------------------------------------------------------------ store
    def store(self, requests: Sequence[RequestTransfer]) -> StoreReport:
        """Gather every chunk of ``requests`` into new pool objects, then publish them in one batch.

        A key that appears twice (two requests sharing a prefix in one step) is stored once.
        """
        return self.commit_store(self.prepare_store(requests))

    def prepare_store(self, requests: Sequence[RequestTransfer]) -> PreparedStore:
        """Reserve pool objects and gather the chunks into them; nothing is published yet.

        When this returns, the paged cache is no longer read: the blocks may be reused at once.
        ``commit_store`` publishes the keys.
        """
        t0 = time.perf_counter()
        prep = PreparedStore(report=StoreReport())
        rep = prep.report
        reserved = self._reserve(requests, prep)
        if reserved is None:
            rep.seconds = time.perf_counter() - t0
            return prep
        todo, objs = reserved
        if self.pipeline is not None:
            self._gather_pipelined(todo, objs, prep)
            rep.seconds = time.perf_counter() - t0
            return prep
        ok: list[tuple[ChunkRef, Any]] = []
        bad: list[Any] = []
        for (req, c), obj in zip(todo, objs, strict=True):
            try:
                slots = slot_mapping(req.block_ids, self.block_size, c.start, c.num_tokens)
                out = self._tensor_over(obj.buf, c.num_tokens)
                if self.device.type == "cpu":
                    kv_ops.gather(self.caches, self.layout, slots, backend=self.backend, out=out)
                else:
                    staged = kv_ops.gather(
                        self.caches, self.layout, slots.to(self.device), backend=self.backend
                    )
                    out.copy_(staged)  # synchronous: the object is complete before it is published
                del out  # drop the export of obj.buf before the client releases it
            except Exception as e:  # a gather bug must not publish a half-written object
                bad.append(obj)
                rep.error = f"gathering chunk {c.key} failed: {type(e).__name__}: {e}"
                continue
            ok.append((c, obj))
        self._settle_prepared(prep, ok, bad)
        rep.seconds = time.perf_counter() - t0
        return prep

    def _reserve(
        self, requests: Sequence[RequestTransfer], prep: PreparedStore
    ) -> tuple[list[tuple[RequestTransfer, ChunkRef]], list[Any]] | None:
        """Every unique chunk of ``requests`` and a reserved pool object for each (one round trip).

        None when there is nothing to store or the reservation failed (recorded in ``prep``).
        """
        rep = prep.report
        todo: list[tuple[RequestTransfer, ChunkRef]] = []
        seen: set[str] = set()
        for req in requests:
            for c in req.chunks:
                if c.key not in seen:
                    seen.add(c.key)
                    todo.append((req, c))
        if not todo:
            return None
        try:
            objs = self.client.batch_alloc([self.object_nbytes(c.num_tokens) for _, c in todo])
        except (MaruError, ValueError) as e:
            rep.failed = len(todo)
            rep.error = f"reserving {len(todo)} objects failed: {e}"
            rep.server_lost = isinstance(e, _LOST)
            return None
        return todo, list(objs)

    def _gather_pipelined(
        self, todo: list[tuple[RequestTransfer, ChunkRef]], objs: list[Any], prep: PreparedStore
    ) -> None:
        """Gather every chunk into its reserved pool object through the ``TransferEngine``.

        Returns only after the transfer's ``wait()``: the D2H copies into the pool pages completed
        (so ``commit_store`` may publish) and the caches are no longer read. On any failure every
        object of the call is aborted, never published.
        """
        self._finish_pipelined(self._issue_pipelined(todo, objs, prep), prep)

    def _issue_pipelined(
        self, todo: list[tuple[RequestTransfer, ChunkRef]], objs: list[Any], prep: PreparedStore
    ) -> _IssuedGather:
        """Queue one ``pipeline.store`` for every chunk (stream-ordered after the work already on the
        caches' device, i.e. the forward's writes); the host does not wait for the copies."""
        rep = prep.report
        ig = _IssuedGather(handle=None, ok=[], bad=[], outs=[])
        slots: list[torch.Tensor] = []
        for (req, c), obj in zip(todo, objs, strict=True):
            try:
                s = slot_mapping(req.block_ids, self.block_size, c.start, c.num_tokens)
                o = self._tensor_over(obj.buf, c.num_tokens)
            except Exception as e:
                ig.bad.append(obj)
                rep.error = f"gathering chunk {c.key} failed: {type(e).__name__}: {e}"
                continue
            ig.outs.append(o)
            slots.append(s)
            ig.ok.append((c, obj))
        if ig.ok:
            try:
                ig.handle = self.pipeline.store(ig.outs, torch.cat(slots))
            except Exception as e:
                rep.error = f"gathering {len(ig.ok)} chunks failed: {type(e).__name__}: {e}"
                ig.bad.extend(obj for _, obj in ig.ok)
                ig.ok, ig.outs = [], []
                if not isinstance(e, ValueError):
                    self._settle()  # an issue that failed half way may have queued copies
        return ig

    def _finish_pipelined(self, ig: _IssuedGather, prep: PreparedStore) -> None:
        """Wait for an issued gather, then record (or abort) its objects through ``_settle_prepared``."""
        handle, ig.handle = ig.handle, None
        if handle is not None:
            try:
                handle.wait()  # the D2H copies completed: only now may the keys be published
            except Exception as e:
                prep.report.error = f"gathering {len(ig.ok)} chunks failed: {type(e).__name__}: {e}"
                ig.bad.extend(obj for _, obj in ig.ok)
                ig.ok = []
                self._settle()  # no copy may still write a page we hand back
            del handle
        ig.outs = []  # drop the exports of the pool buffers before the client releases them
        ok, bad, ig.ok, ig.bad = ig.ok, ig.bad, [], []
        self._settle_prepared(prep, ok, bad)

    # ------------------------------------------------------------------ write-behind store
    def issue_store(self, requests: Sequence[RequestTransfer]) -> PendingStore:
        """Start a write-behind store on the forward thread; ``complete_store`` finishes it.

        Never blocks on the device. CUDA caches (pipelined): reserve the objects and queue the
        gather, ordered after the forward's writes; the blocks are read when the copies run.
        CPU caches: nothing happens here: ``complete_store`` reserves, gathers and publishes on the
        drain thread. The staged fallback gathers here, synchronously. Until ``read_done`` is set
        the blocks of ``requests`` must not be reused (vLLM holds them: delayed free, preemption
        barrier through ``wait_store_read``).
        """
        pending = PendingStore(requests=list(requests), prep=PreparedStore(report=StoreReport()))
        if self.pipeline is not None:
            t0 = time.perf_counter()
            reserved = self._reserve(requests, pending.prep)
            if reserved is not None:
                pending.issued = self._issue_pipelined(*reserved, pending.prep)
            else:
                pending.read_done.set()
            pending.prep.report.seconds += time.perf_counter() - t0
        elif self.device.type != "cpu":
            pending.prep = self.prepare_store(requests)  # staged: synchronous copies
            pending.read_done.set()
        return pending

    def complete_store(self, pending: PendingStore) -> StoreReport:
        """Finish a write-behind store (drain thread): gather or wait for the gather, then publish.

        A store cancelled by ``wait_store_read`` publishes nothing (its objects are aborted).
        Never raises for Maru-side problems: they come back in the report.
        """
        try:
            if self.pipeline is not None:
                if pending.issued is not None:
                    t0 = time.perf_counter()
                    self._finish_pipelined(pending.issued, pending.prep)
                    pending.prep.report.seconds += time.perf_counter() - t0
            elif self.device.type == "cpu":
                with pending.lock:
                    taken, pending.started = pending.started, True
                if not taken:
                    pending.prep = self.prepare_store(pending.requests)  # reads the blocks
                else:
                    # The preemption barrier gathered it on the forward thread (it sets read_done).
                    pending.read_done.wait()
        finally:
            with pending.lock:
                cancelled = pending.cancelled
                pending.read_done.set()
        prep = pending.prep
        if cancelled:
            return self._abort_prepared(prep)
        return self.commit_store(prep)

    def wait_store_read(self, pending: PendingStore, timeout: float | None = None) -> bool:
        """Block until ``pending`` no longer reads the paged cache (the preemption barrier).

        CUDA: wait for the gather's copies. CPU: gather here if the drain thread has not started
        it, else wait for its gather. True: the blocks may be overwritten. False after ``timeout`` seconds: the store is
        cancelled (it will publish nothing, whatever it read), so the blocks may be overwritten too.
        """
        if self.pipeline is None and self.device.type == "cpu":
            with pending.lock:
                taken, pending.started = pending.started, True
            if not taken:
                # The drain thread has not reached it (it may be busy with earlier batches): gather
                # here, on the forward thread, rather than wait behind them; the drain publishes.
                try:
                    pending.prep = self.prepare_store(pending.requests)
                finally:
                    pending.read_done.set()
                return True
        ig = pending.issued
        handle = ig.handle if ig is not None else None
        if handle is not None and not pending.read_done.is_set():
            # Pipelined: the copies finishing is what matters, not the drain thread reaching them.
            try:
                handle.wait()
                return True
            except Exception as e:
                logger.error("Maru: waiting for a write-behind gather failed (%s); it is cancelled", e)
                self._settle()
        elif pending.read_done.wait(timeout):
            return True
        with pending.lock:
            if pending.read_done.is_set():
                return True
            pending.cancelled = True
        return False

    def _abort_prepared(self, prep: PreparedStore) -> StoreReport:
        rep = prep.report
        if prep.objects:
            rep.failed += len(prep.objects)
            rep.tokens = 0
            rep.error = (
                f"{len(prep.objects)} objects cancelled: their blocks were released (request preempted) "
                "before the write-behind gather finished reading them"
            )
            try:
                self.client.abort(prep.objects)
            except MaruError:
                pass  # the server reclaims reservations with the lease
            prep.keys, prep.objects = [], []
        return rep

    def _settle_prepared(self, prep: PreparedStore, ok: list[tuple[ChunkRef, Any]], bad: list[Any]) -> None:
        """Record the completely written objects for ``commit_store``; abort the others unpublished."""
        rep = prep.report
        for c, obj in ok:
            prep.keys.append(c.key)
            prep.objects.append(obj)
            rep.tokens += c.num_tokens
            prep.nbytes += obj.size
        if bad:
            rep.failed += len(bad)
            try:
                self.client.abort(bad)
            except MaruError:
                pass  # the server reclaims reservations with the lease

    def _settle(self) -> None:
        """After a failed transfer: wait for whatever the engine queued (best effort, logged)."""
        try:
            self.pipeline.synchronize()
        except Exception as e:  # a sticky CUDA error: the context runs nothing any more
            logger.error("Maru: waiting for the GPU transfer engine after a failure failed: %s", e)

    def commit_store(self, prep: PreparedStore) -> StoreReport:
        """Publish what ``prepare_store`` gathered (one batch); returns the step's full report."""
        t0 = time.perf_counter()
        rep = prep.report
        if prep.objects:
            try:
                results = self.client.batch_store(prep.keys, prep.objects)
            except MaruError as e:
                rep.failed += len(prep.objects)
                rep.tokens = 0
                rep.error = f"publishing {len(prep.objects)} objects failed: {e}"
                rep.server_lost = isinstance(e, _LOST)
                rep.seconds += time.perf_counter() - t0
                return rep
            for r in results:
                if str(getattr(r, "value", r)) == "stored":
                    rep.stored += 1
                else:
                    rep.present += 1
            rep.bytes = prep.nbytes
        rep.seconds += time.perf_counter() - t0
        return rep

    # ------------------------------------------------------------------ load
    def load(self, requests: Sequence[RequestTransfer]) -> LoadReport:
        """Place every request's chunks into the paged cache: one lookup-and-pin for all keys.

        All or nothing per request (see the module docstring). Returns which requests loaded, once
        every placement completed and the pins are released (``start_load``, then ``finish``).
        """
        return self.start_load(requests).finish()

    def start_load(self, requests: Sequence[RequestTransfer]) -> InflightLoad:
        """Look up and pin every chunk (one round trip), check each request, issue its placement.

        With a ``TransferEngine`` (CUDA caches) each checked request is one ``pipeline.load``: its
        copies and placement are queued on the engine's streams and this returns without waiting
        for them (the asynchronous load polls ``InflightLoad.done()``). Otherwise the placement runs
        here, synchronously (the staged path also waits for its kernels), and the returned load is
        already complete. The pins are released by ``InflightLoad.release``/``finish``, or here if
        this raises (after the engine's streams settled).
        """
        t0 = time.perf_counter()
        rep = LoadReport()
        index, handles, rep.server_lost = self._lookup_pinned(requests, rep.failed)
        if handles is None:
            return InflightLoad(self, rep, [], [], t0)
        issued: list[tuple[RequestTransfer, Any, int, int]] = []  # (request, transfer or None, chunks, bytes)
        try:
            for req in requests:
                why = self._check(req, handles, index)
                if why is None:
                    if self.pipeline is not None:
                        why = self._issue_load(req, handles, index, issued)
                    else:
                        why = self._place(req, handles, index, issued)
                if why is not None:
                    rep.failed[req.req_id] = why
            if self.pipeline is None:
                # The staged path queued its kernels on this thread's stream: the load is complete
                # (and may be reported from any thread) only once they ran.
                self.sync_device()
        except BaseException:
            if self.pipeline is not None:
                self._settle()  # unexpected: no copy may still read a page we unpin
            issued = []
            self._unpin(handles)
            raise
        return InflightLoad(self, rep, handles, issued, t0)

    def _lookup_pinned(
        self, requests: Sequence[RequestTransfer], failed: dict[str, str]
    ) -> tuple[dict[str, int], list[Any] | None, bool]:
        """Look up and pin every unique chunk key of ``requests`` in one round trip.

        Returns (key -> position, handles, server lost). Handles are None when there is nothing to
        look up or the lookup failed; on failure every request is in ``failed`` with the reason.
        """
        keys, index = _unique_keys(requests)
        if not keys:
            return index, None, False
        try:
            return index, list(self.client.batch_retrieve(keys, pin=True)), False
        except MaruError as e:
            for req in requests:
                failed[req.req_id] = f"lookup failed: {e}"
            return index, None, isinstance(e, _LOST)

    def _issue_load(
        self,
        req: RequestTransfer,
        handles: list[Any],
        index: dict[str, int],
        issued: list[tuple[RequestTransfer, Any, int, int]],
    ) -> str | None:
        """Queue ``req``'s chunks on the ``TransferEngine``; None, or why the request failed."""
        objs: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        nbytes = 0
        c = None
        try:
            for c in req.chunks:
                h = handles[index[c.key]]
                nbytes += h.size
                pb, pe = c.placed()
                if pe <= pb:
                    continue  # nothing of this chunk is placed: no copy at all
                slots.append(slot_mapping(req.block_ids, self.block_size, c.start, c.num_tokens, (pb, pe)))
                objs.append(self._tensor_over(h.view, c.num_tokens))
        except Exception as e:
            return f"placing chunk {c.key if c else '?'} failed: {type(e).__name__}: {e}"
        if not objs:
            issued.append((req, None, len(req.chunks), nbytes))
            return None
        try:
            handle = self.pipeline.load(objs, torch.cat(slots))
        except Exception as e:
            # A failure at issue may leave some copies queued: the caller settles before unpinning.
            self._settle()
            return f"placing the chunks failed: {type(e).__name__}: {e}"
        issued.append((req, handle, len(req.chunks), nbytes))
        return None

    def _check(self, req: RequestTransfer, handles: list[Any], index: dict[str, int]) -> str | None:
        for c in req.chunks:
            h = handles[index[c.key]]
            if h is None:
                return f"chunk {c.key} is gone from the pool (evicted or deleted)"
            want = self.object_nbytes(c.num_tokens)
            if h.size != want:
                return (
                    f"chunk {c.key} has {h.size} bytes, expected {want} (another format under the same key?)"
                )
        return None

    def _place(
        self,
        req: RequestTransfer,
        handles: list[Any],
        index: dict[str, int],
        issued: list[tuple[RequestTransfer, Any, int, int]],
    ) -> str | None:
        """Place ``req``'s chunks now (CPU, staged); None (and ``req`` recorded done), or why it failed."""
        nbytes = 0
        for c in req.chunks:
            h = handles[index[c.key]]
            try:
                slots = slot_mapping(req.block_ids, self.block_size, c.start, c.num_tokens, c.placed())
                obj = self._tensor_over(h.view, c.num_tokens)
                if self.device.type != "cpu":
                    obj, slots = obj.to(self.device), slots.to(self.device)
                kv_ops.scatter(obj, self.caches, self.layout, slots, backend=self.backend)
                del obj
            except Exception as e:  # reported as a load error: vLLM recomputes these blocks
                return f"placing chunk {c.key} failed: {type(e).__name__}: {e}"
            nbytes += h.size
        issued.append((req, None, len(req.chunks), nbytes))
        return None

    # ------------------------------------------------------------------ layer by layer
    def pin(self, requests: Sequence[RequestTransfer]) -> PinnedLoad:
        """Look up and pin every chunk of ``requests`` (one round trip) and check them; place nothing.

        The lookup decides: a request with any chunk missing or of the wrong size is failed
        whole, before a single layer of it is placed (all or nothing per request).
        """
        t0 = time.perf_counter()
        pl = PinnedLoad()
        index, handles, pl.server_lost = self._lookup_pinned(requests, pl.failed)
        if handles is None:
            pl.seconds = time.perf_counter() - t0
            return pl
        pl.handles = handles
        for req in requests:
            why = self._check(req, pl.handles, index)
            parts: list[tuple[torch.Tensor, torch.Tensor, int]] = []
            if why is None:
                try:
                    for c in req.chunks:
                        h = pl.handles[index[c.key]]
                        slots = slot_mapping(
                            req.block_ids, self.block_size, c.start, c.num_tokens, c.placed()
                        )
                        obj = self._tensor_over(h.view, c.num_tokens)
                        if self.device.type != "cpu" and self.pipeline is None:
                            # Placed by place_layer. The TransferEngine takes host slot mappings
                            # (it moves them itself, without blocking).
                            slots = slots.to(self.device)
                        parts.append((obj, slots, int(h.size)))
                except Exception as e:
                    why = f"preparing chunk {c.key} failed: {type(e).__name__}: {e}"
            if why is None:
                pl.ready.append((req, parts))
            else:
                pl.failed[req.req_id] = why
        pl.seconds = time.perf_counter() - t0
        return pl

    def place_layer(self, obj: torch.Tensor, slots: torch.Tensor, layer: int) -> None:
        """Place layer ``layer`` of one chunk object ``[L, KV, T, ROW]`` at ``slots``."""
        part = obj[layer]
        if self.device.type != "cpu":
            part = part.to(self.device)
            slots = slots.to(self.device)  # no-op when pin already moved them
        if self.layout.is_cross_layer:
            kv_ops.scatter_layer(part, self.caches[0], self.layout, slots, layer=layer, backend=self.backend)
        else:
            kv_ops.scatter_layer(part, self.caches[layer], self.layout, slots, backend=self.backend)

    def sync_device(self) -> None:
        """Wait until the work this thread queued on the caches' device ran (no-op on CPU).

        Loads issued from a background thread (layer overlap, async load) must not be reported
        placed while their kernels are still queued: the forward runs on another thread's stream.
        """
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def start_layer_load(self, pinned: PinnedLoad) -> LayerwiseLoad | PipelinedLayerLoad:
        """Start placing ``pinned`` layer by layer (the layer-overlap load); it owns the pins from now.

        With a ``TransferEngine`` (CUDA caches): one ``load_layers`` call for every ready request,
        issued on this thread (``PipelinedLayerLoad``). Otherwise the ``LayerwiseLoad`` thread.
        """
        if self.pipeline is not None:
            return PipelinedLayerLoad(self, pinned)
        return LayerwiseLoad(self, pinned).start()

    def release(self, pl: PinnedLoad) -> None:
        """Unpin what ``pin`` pinned (object tensors over the pool pages are dropped first)."""
        pl.ready = []
        handles, pl.handles = pl.handles, []
        self._unpin(handles)

    def _unpin(self, handles: list[Any]) -> None:
        """Release pinned lookup handles (None entries skipped) in one round trip; never raises
        a ``MaruError`` (logged: the lease frees them). Callers drop their tensors over the pages first."""
        handles = [h for h in handles if h is not None]
        if not handles:
            return
        try:
            self.client.batch_release(handles)
        except MaruError as e:
            logger.warning(
                "Maru: unpinning %d loaded chunks failed (%s); the lease frees them", len(handles), e
            )


class LayerwiseLoad:
    """The layer-overlap load: places a ``PinnedLoad`` layer by layer on a background thread.

    Invariants: layer i's ``Event`` is set only after layer i of every ready request is placed
    (or the load gave up: then ``report()`` names the failed requests and vLLM recomputes them);
    every event is set when the thread ends, so a waiter never hangs; the pins are released
    after the last layer. ``wait_for_layer(i)`` blocks on layer i only.
    """

    def __init__(self, engine: KVTransferEngine, pinned: PinnedLoad) -> None:
        self.engine = engine
        self.pinned = pinned
        self.num_layers = engine.num_layers
        self._events = [threading.Event() for _ in range(self.num_layers)]
        self._done = threading.Event()
        self._failed: dict[str, str] = {}
        self._report = LoadReport(failed=dict(pinned.failed), server_lost=pinned.server_lost)
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="maru-layer-load", daemon=True)

    def start(self) -> LayerwiseLoad:
        self._thread.start()
        return self

    def _run(self) -> None:
        ready = list(self.pinned.ready)
        try:
            for i in range(self.num_layers):
                for req, parts in ready:
                    if req.req_id in self._failed:
                        continue
                    try:
                        for obj, slots, _ in parts:
                            self.engine.place_layer(obj, slots, i)
                    except Exception as e:  # reported after the forward: vLLM recomputes the request
                        self._failed[req.req_id] = f"placing layer {i} failed: {type(e).__name__}: {e}"
                # On a GPU the kernels were only queued on this thread's stream: the layer is
                # placed when they ran, not when they were issued.
                self.engine.sync_device()
                self._events[i].set()
        finally:
            for ev in self._events:
                ev.set()
            rep = self._report
            for req, parts in ready:
                if req.req_id in self._failed:
                    rep.failed[req.req_id] = self._failed[req.req_id]
                    continue
                rep.loaded_req_ids.append(req.req_id)
                rep.tokens += req.num_placed_tokens()
                rep.chunks += len(parts)
                rep.bytes += sum(n for _, _, n in parts)
            del ready
            self.engine.release(self.pinned)
            rep.seconds = self.pinned.seconds + time.perf_counter() - self._t0
            self._done.set()

    def wait_for_layer(self, layer: int) -> None:
        self._events[layer].wait()

    def layer_done(self, layer: int) -> bool:
        return self._events[layer].is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> LoadReport:
        """Block until every layer is placed and the pins are released; the load's report."""
        self._done.wait()
        self._thread.join()
        return self._report


class InflightLoad:
    """A load looked up, pinned and issued (``KVTransferEngine.start_load``); it may still be running.

    Invariants: ``done()`` never blocks. ``collect()`` gives the final report: a request is in
    ``loaded_req_ids`` only if every transfer of it completed without error; a transfer error at
    completion (``done()`` or ``wait()`` raising) fails its request and the engine's streams are
    settled before anything is unpinned. ``release()`` unpins exactly once, and never before every
    issued transfer completed (it collects, i.e. waits, first if needed).
    """

    def __init__(
        self,
        engine: KVTransferEngine,
        report: LoadReport,
        handles: list[Any],
        issued: list[tuple[RequestTransfer, Any, int, int]],
        t0: float,
    ) -> None:
        self.engine = engine
        self.report = report  # failures at lookup, check and issue are in it already
        self._handles = handles  # the pinned lookup handles (None: missing key)
        self._issued = issued  # (request, transfer or None when placed at issue, chunks, bytes)
        self._errors: dict[int, BaseException] = {}  # issued index -> error raised by its done()
        self._t0 = t0
        self._collected = False
        self._released = False

    def done(self) -> bool:
        """True once every issued transfer completed or failed (non-blocking event queries)."""
        for k, (_, transfer, _, _) in enumerate(self._issued):
            if transfer is None or k in self._errors:
                continue
            try:
                if not transfer.done():
                    return False
            except Exception as e:  # an error at completion: collect() fails the request
                self._errors[k] = e
        return True

    def collect(self) -> LoadReport:
        """The final report (idempotent). Waits for transfers still running: none once ``done()``."""
        if self._collected:
            return self.report
        self._collected = True
        rep, settle = self.report, False
        issued, self._issued = self._issued, []
        for k, (req, transfer, nchunks, nbytes) in enumerate(issued):
            err = self._errors.get(k)
            if err is None and transfer is not None:
                try:
                    transfer.wait()
                except Exception as e:
                    err = e
            if err is not None:  # reported as a load error: vLLM recomputes these blocks
                rep.failed[req.req_id] = f"placing the chunks failed: {type(err).__name__}: {err}"
                settle = True
                continue
            rep.loaded_req_ids.append(req.req_id)
            rep.tokens += req.num_placed_tokens()
            rep.chunks += nchunks
            rep.bytes += nbytes
        del issued  # the transfers drop their tensors over the pool pages with it
        if settle and self.engine.pipeline is not None:
            self.engine._settle()  # a failed transfer may leave copies queued: drain before unpinning
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
            self.engine._unpin(handles)

    def finish(self) -> LoadReport:
        """``collect`` then ``release``: the synchronous load."""
        rep = self.collect()
        self.release()
        return rep


class PipelinedLayerLoad:
    """The layer-overlap load on CUDA caches: ONE ``TransferEngine.load_layers`` for a whole step.

    Issued on the calling (forward) thread from a ``PinnedLoad``: the chunk objects and slot
    mappings of every ready request are concatenated into one call (``place_begin``/``place_end``
    are -1 slots, never written; a chunk with nothing to place is not copied). ``wait_for_layer(i)``
    makes the current stream wait for layer i's placement and ``wait_on()`` for every layer: the
    host never blocks. Same interface as ``LayerwiseLoad`` (``wait_for_layer``, ``layer_done``,
    ``done``, ``wait``, ``num_layers``) plus ``report``, ``wait_on`` and ``release``.

    Invariants: the requests of the call succeed or fail together. A failure at issue fails all of
    them here (``report`` says so before the forward reads anything) and settles the engine's
    streams. A failure at completion (``done``/``wait`` raising) is logged, moves every loaded
    request of ``report`` to its failures and settles the streams. ``release()`` unpins exactly
    once, only after the transfer completed (waiting for it if ``done()`` is not yet true).
    """

    def __init__(self, engine: KVTransferEngine, pinned: PinnedLoad) -> None:
        t0 = time.perf_counter()
        self.engine = engine
        self.num_layers = engine.num_layers
        self.report = LoadReport(failed=dict(pinned.failed), server_lost=pinned.server_lost)
        self.handle: Any = None  # the LayerLoad
        self.error: str | None = None
        self._pinned = pinned
        self._released = False
        ready, pinned.ready = pinned.ready, []  # the handle keeps the tensors it needs
        objs: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        for req, parts in ready:
            for c, (obj, s, _) in zip(req.chunks, parts, strict=True):
                pb, pe = c.placed()
                if pe > pb:
                    objs.append(obj)
                    slots.append(s)
        try:
            if objs:
                self.handle = engine.pipeline.load_layers(objs, torch.cat(slots))
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            engine._settle()  # a failure at issue may leave copies queued
            for req, _ in ready:
                self.report.failed[req.req_id] = f"placing the layers failed: {self.error}"
        else:
            for req, parts in ready:
                self.report.loaded_req_ids.append(req.req_id)
                self.report.tokens += req.num_placed_tokens()
                self.report.chunks += len(parts)
                self.report.bytes += sum(n for _, _, n in parts)
        del objs, slots, ready
        self.issue_s = time.perf_counter() - t0
        self.report.seconds = pinned.seconds + self.issue_s

    def wait_for_layer(self, layer: int) -> None:
        """The current stream waits for layer ``layer`` of every chunk (GPU-side; no host block)."""
        if self.handle is not None:
            self.handle.wait_for_layer(layer)

    def wait_on(self) -> None:
        """The current stream waits for every layer (GPU-side; no host block)."""
        if self.handle is not None:
            self.handle.wait_on()

    def layer_done(self, layer: int) -> bool:
        return self.handle is None or bool(self.handle.layer_done(layer))

    def done(self) -> bool:
        """True once every layer is placed (or the transfer failed). Never blocks."""
        if self.handle is None or self.error is not None:
            return True
        try:
            return bool(self.handle.done())
        except Exception as e:
            self._failed_at_completion(e)
            return True

    def wait(self) -> LoadReport:
        """Block until every layer is placed, release the pins; the load's report."""
        self.release()
        return self.report

    def release(self) -> None:
        """Unpin (once), after the transfer completed: blocks on it when ``done()`` is not yet true."""
        if self._released:
            return
        self._released = True
        try:
            if self.handle is not None and self.error is None:
                try:
                    self.handle.wait()
                except Exception as e:
                    self._failed_at_completion(e)
        finally:
            self.handle = None  # drops the tensors over the pool pages before unpinning
            self.engine.release(self._pinned)

    def _failed_at_completion(self, e: BaseException) -> None:
        if self.error is not None:
            return
        self.error = f"{type(e).__name__}: {e}"
        logger.error(
            "Maru: the layer-overlap load of %d requests failed on the device (%s)",
            len(self.report.loaded_req_ids),
            self.error,
        )
        for req_id in self.report.loaded_req_ids:
            self.report.failed[req_id] = f"placing the layers failed: {self.error}"
        self.report.loaded_req_ids = []
        self.engine._settle()  # no copy may still read a page we unpin


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
            if load.engine.pipeline is not None:
                load.engine._settle()
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


def _unique_keys(requests: Sequence[RequestTransfer]) -> tuple[list[str], dict[str, int]]:
    """Every chunk key of ``requests`` once, in first-seen order, and each key's position.

    Requests sharing a prefix share chunks: one lookup (and one pin) per key, not per request.
    """
    keys: list[str] = []
    index: dict[str, int] = {}
    for req in requests:
        for c in req.chunks:
            if c.key not in index:
                index[c.key] = len(keys)
                keys.append(c.key)
    return keys, index
