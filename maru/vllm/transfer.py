"""The transfer engine: paged KV cache <-> pool objects, independent of vLLM.

Given the registered per-layer caches, their ``KVLayout`` and a Maru client, it stores chunks
(gather every layer's KV of a token range straight into a reserved pool object, then publish
all of a step's objects in one commit) and loads them (one lookup-and-pin round trip, scatter,
unpin). It knows nothing of vLLM: requests are plain ``RequestTransfer`` records (block ids and
chunk references), which is what lets tests and benchmarks drive it with synthetic caches of
any layout, and what the GPU data path builds on.

Object format (one key per chunk): ``kv_ops``' canonical ``[num_layers, num_kv, tokens,
row]`` (``num_kv`` = 2: K plane then V plane per layer; 1 for MLA), in the cache's dtype.

Invariants:
- A key is published only after its object is completely written (write, then commit).
- A load is all or nothing per request: if any of its chunks is missing, has the wrong size,
  or fails to scatter, the request is reported failed (its KV must be recomputed), never
  partially trusted. Every pinned handle is released, whatever happens.
- Maru-side problems never raise out of ``store``/``load``; they come back in the reports.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
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
    pos = torch.arange(first, last, dtype=torch.int64)
    table = torch.as_tensor(list(block_ids[:nblocks]), dtype=torch.int64)
    slots[pb:pe] = table[pos // block_size] * block_size + pos % block_size
    return slots


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
        if self.device.type != "cpu":
            # Correct but not the fast path: pageable copies through a staging tensor on the device.
            # The pipelined path over a CUDA-registered pool is the GPU data path's job.
            logger.warning(
                "Maru: KV cache on %s: chunks are staged through device memory and copied to/from "
                "the pool with plain (unregistered) host copies; expect host-copy bandwidth",
                self.device,
            )

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
        t0 = time.perf_counter()
        rep = StoreReport()
        todo: list[tuple[RequestTransfer, ChunkRef]] = []
        seen: set[str] = set()
        for req in requests:
            for c in req.chunks:
                if c.key not in seen:
                    seen.add(c.key)
                    todo.append((req, c))
        if not todo:
            return rep
        try:
            objs = self.client.batch_alloc([self.object_nbytes(c.num_tokens) for _, c in todo])
        except (MaruError, ValueError) as e:
            rep.failed = len(todo)
            rep.error = f"reserving {len(todo)} objects failed: {e}"
            rep.server_lost = isinstance(e, _LOST)
            rep.seconds = time.perf_counter() - t0
            return rep
        keys: list[str] = []
        ready: list[Any] = []
        bad: list[Any] = []
        ready_bytes = 0
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
            keys.append(c.key)
            ready.append(obj)
            rep.tokens += c.num_tokens
            ready_bytes += obj.size
        if bad:
            rep.failed += len(bad)
            try:
                self.client.abort(bad)
            except MaruError:
                pass  # the server reclaims reservations with the lease
        if ready:
            try:
                results = self.client.batch_store(keys, ready)
            except MaruError as e:
                rep.failed += len(ready)
                rep.tokens = 0
                rep.error = f"publishing {len(ready)} objects failed: {e}"
                rep.server_lost = isinstance(e, _LOST)
                rep.seconds = time.perf_counter() - t0
                return rep
            for r in results:
                if str(getattr(r, "value", r)) == "stored":
                    rep.stored += 1
                else:
                    rep.present += 1
            rep.bytes = ready_bytes
        rep.seconds = time.perf_counter() - t0
        return rep

    # ------------------------------------------------------------------ load
    def load(self, requests: Sequence[RequestTransfer]) -> LoadReport:
        """Place every request's chunks into the paged cache: one lookup-and-pin for all keys.

        All or nothing per request (see the module docstring). Returns which requests loaded.
        """
        t0 = time.perf_counter()
        rep = LoadReport()
        keys: list[str] = []
        index: dict[str, int] = {}
        for req in requests:
            for c in req.chunks:
                if c.key not in index:
                    index[c.key] = len(keys)
                    keys.append(c.key)
        if not keys:
            return rep
        try:
            handles = self.client.batch_retrieve(keys, pin=True)
        except MaruError as e:
            for req in requests:
                rep.failed[req.req_id] = f"lookup failed: {e}"
            rep.server_lost = isinstance(e, _LOST)
            rep.seconds = time.perf_counter() - t0
            return rep
        try:
            for req in requests:
                why = self._check(req, handles, index)
                if why is None:
                    why = self._place(req, handles, index, rep)
                if why is None:
                    rep.loaded_req_ids.append(req.req_id)
                    rep.tokens += req.num_placed_tokens()
                else:
                    rep.failed[req.req_id] = why
        finally:
            try:
                self.client.batch_release(handles)
            except MaruError as e:
                logger.warning(
                    "Maru: unpinning %d loaded chunks failed (%s); the lease frees them", len(keys), e
                )
        rep.seconds = time.perf_counter() - t0
        return rep

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
        self, req: RequestTransfer, handles: list[Any], index: dict[str, int], rep: LoadReport
    ) -> str | None:
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
            rep.chunks += 1
            rep.bytes += h.size
        return None
