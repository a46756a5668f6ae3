"""The transfer engine: chunk objects in host memory (the pool) <-> a paged KV cache, pipelined.

Independent of vLLM: it takes the per-layer caches and their ``KVLayout`` once, then stores and
loads *chunk objects* ``[L, KV, T, NH*HS]`` (see ``maru.kv_ops.ops``) that live in host memory,
normally tensors over the pool mapping (``host_object``).

On a GPU every transfer is split into *units*: a contiguous slice of one chunk object (a run of
whole layers of it, at most ``unit_bytes``). A bounded ring of GPU staging slots carries them:

* LOAD: the copy engine brings unit k from the pool into slot ``k % R`` (``copy_`` with
  ``non_blocking`` on the copy stream), while the placement kernel scatters unit k-1 out of its slot
  on the placement stream. Events order the two: the placement of unit k waits for its copy; the copy
  into a slot waits until the previous placement out of that slot finished.
* STORE mirrors it: the gather kernel fills slot ``k % R`` on the placement stream; the copy engine
  moves it into the pool page on the copy stream. The caller commits (registers keys) only after
  ``Transfer.wait()``: a visible key means complete bytes.
* LAYERS (``load_layers``, the layer-overlap load): layer i's slice of every chunk is copied into a
  per-call staging buffer and placed with the single-layer kernel; one event per layer, so
  ``LayerLoad.wait_for_layer(i)`` makes the compute stream wait for layer i only.

Invariants:

* Every operation starts after the work already queued on the caller's current stream (an event is
  recorded there at issue), so a load never races the computation that last wrote those blocks, and a
  store reads the KV the forward pass just wrote.
* Nothing blocks the host during issue; ``Transfer.wait()`` / ``done()`` / ``wait_on(stream)`` observe
  completion. The host objects stay referenced by the handle until it completed.
* Kernels receive the caches as detected (``KVLayout`` carries physical strides), so an HND cache is
  placed by its physical axis order whatever its shape shows.
* On CPU caches there is nothing to pipeline: each call degrades to direct ``kv_ops`` calls straight
  between the pool and the cache (announced once, at info level: the normal CPU path).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from maru.kv_ops import ops
from maru.kv_ops.layout import KVLayout

log = logging.getLogger("maru.kv_ops")

MiB = 1 << 20
DEFAULT_UNIT_BYTES = 16 * MiB  # a copy of this size runs at ~98% of the bus; the kernel takes ~10 us
DEFAULT_RING_SLOTS = 3  # one slot filling, one draining, one spare to absorb issue jitter

_announced: set[str] = set()
_announce_lock = threading.Lock()


def _announce_once(key: str, level: int, msg: str, *args: Any) -> None:
    with _announce_lock:
        if key in _announced:
            return
        _announced.add(key)
    log.log(level, msg, *args)


def host_object(buffer: Any, shape: Sequence[int], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over ``buffer`` (an mmap, a pool memoryview), no copy.

    Read-only buffers (a retrieved entry's view) are allowed: the load path only reads them.
    """
    count = 1
    for n in shape:
        count *= int(n)
    with warnings.catch_warnings():
        # torch warns that writing through a tensor over a read-only buffer is undefined; loads never do.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
    return flat.view(*shape)


@dataclass(frozen=True)
class _Unit:
    """One contiguous slice of one chunk object: layers ``[a, b)`` of chunk ``chunk``."""

    chunk: int
    a: int
    b: int
    token0: int  # the chunk's first token in the call's slot mapping
    tokens: int


class Transfer:
    """Handle of one issued store or load. ``wait()`` before committing keys or unpinning entries."""

    def __init__(self, kind: str, path: str, nbytes: int, done_event: Any, keepalive: list[Any]) -> None:
        self.kind = kind  # "load" | "store"
        self.path = path  # "pipelined" | "sync" | "cpu-direct" | "layers"
        self.nbytes = nbytes
        self.issue_s = 0.0  # host seconds spent issuing (the per-layer path's issue cost)
        self._event = done_event  # torch.cuda.Event, or None when already complete (CPU)
        self._keepalive: list[Any] | None = keepalive

    def done(self) -> bool:
        """True once every copy and kernel of this transfer finished (never blocks)."""
        if self._event is None or self._event.query():
            self._keepalive = None
            return True
        return False

    def wait(self) -> None:
        """Block the calling thread until the transfer completed."""
        if self._event is not None:
            self._event.synchronize()
        self._keepalive = None

    def wait_on(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current stream) wait for this transfer, without blocking the host."""
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._event_device())).wait_event(self._event)

    def _event_device(self) -> Any:
        return None


class LayerLoad(Transfer):
    """A load issued layer by layer: ``wait_for_layer(i)`` waits for layer i alone."""

    def __init__(self, nbytes: int, layer_events: list[Any] | None, keepalive: list[Any]) -> None:
        done = layer_events[-1] if layer_events else None
        super().__init__("load", "layers" if layer_events else "cpu-direct", nbytes, done, keepalive)
        self._layer_events = layer_events
        self.num_layers = len(layer_events) if layer_events else 0

    def wait_for_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait until layer ``layer`` is placed. No host block."""
        if self._layer_events is None:
            return
        (stream or torch.cuda.current_stream()).wait_event(self._layer_events[layer])

    def layer_done(self, layer: int) -> bool:
        return self._layer_events is None or self._layer_events[layer].query()

    def done(self) -> bool:
        # Layers are placed in order on one stream: the last layer's event covers all of them.
        return super().done()


Placer = Callable[..., None]

_CUDA_MEMCPY_H2D = 1  # cudaMemcpyHostToDevice


class _RawCopier:
    """``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync`` straight through the process's libcudart.

    The layer-overlap load issues one or two copies per layer; through ``Tensor.copy_`` each costs
    several microseconds of Python and dispatcher work, through ctypes about one. Only used between
    contiguous host and device ranges whose addresses the engine computed itself. ``None`` when the
    library cannot be found (then ``Tensor.copy_`` is used: same bytes, more issue time).
    """

    def __init__(self, lib: Any) -> None:
        import ctypes

        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._memcpy.restype = ctypes.c_int
        self._memcpy2d = lib.cudaMemcpy2DAsync
        self._memcpy2d.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
            ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
        ]  # fmt: skip
        self._memcpy2d.restype = ctypes.c_int

    @classmethod
    def load(cls) -> _RawCopier | None:
        import ctypes

        try:
            with open("/proc/self/maps") as maps:
                paths = [line.split()[-1] for line in maps if "libcudart" in line]
            if not paths:
                return None
            return cls(ctypes.CDLL(paths[0]))
        except (OSError, AttributeError):
            return None

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._memcpy(dst, src, nbytes, _CUDA_MEMCPY_H2D, stream)
        if err:
            raise RuntimeError(
                f"cudaMemcpyAsync({dst:#x} <- {src:#x}, {nbytes} bytes) failed: cudaError {err}"
            )

    def copy2d(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int
    ) -> None:
        err = self._memcpy2d(dst, dpitch, src, spitch, width, height, _CUDA_MEMCPY_H2D, stream)
        if err:
            raise RuntimeError(
                f"cudaMemcpy2DAsync({dst:#x} <- {src:#x}, {height} x {width} bytes) failed: cudaError {err}"
            )


class TransferEngine:
    """Stores and loads chunk objects between host memory and one set of paged caches.

    ``caches``: the per-layer cache tensors (or the one cross-layer tensor) as the engine allocated
    them; ``layout``: ``kv_ops.detect_layouts`` of them. GPU state (streams, the staging ring) is
    allocated once here; the engine is safe to call from several threads (issue is serialized).
    """

    def __init__(
        self,
        caches: Any,
        layout: KVLayout,
        *,
        unit_bytes: int = DEFAULT_UNIT_BYTES,
        ring_slots: int = DEFAULT_RING_SLOTS,
        backend: str | None = None,
        raw_copy: bool = True,
    ) -> None:
        if isinstance(caches, dict):
            caches = list(caches.values())
        self.layout = layout
        self.cross_layer = layout.is_cross_layer
        self.caches: list[torch.Tensor] | torch.Tensor = caches if self.cross_layer else list(caches)
        first = caches if isinstance(caches, torch.Tensor) else self.caches[0]
        assert isinstance(first, torch.Tensor)
        self.dtype = first.dtype
        self.device = first.device
        self.num_layers = int(layout.num_layers) if self.cross_layer else len(self.caches)
        self.backend = backend
        self.raw_copy = raw_copy  # False: the layer path issues copies with Tensor.copy_ (bench comparison)
        self.esize = first.element_size()
        self.layer_token_bytes = layout.num_kv * layout.row_size * self.esize  # one token of one layer
        self.unit_bytes = max(int(unit_bytes), 1)
        self.ring_slots = max(int(ring_slots), 1)
        self._lock = threading.Lock()
        self.on_gpu = self.device.type == "cuda"
        if self.on_gpu:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._place_stream = torch.cuda.Stream(self.device)
            self._ring: list[torch.Tensor] = []  # grown on demand to the largest unit seen
            self._ring_ready = [torch.cuda.Event() for _ in range(self.ring_slots)]
            self._ring_free = [torch.cuda.Event() for _ in range(self.ring_slots)]
            self._ring_used = [False] * self.ring_slots
            self._next_slot = 0
            self._layer_staging: torch.Tensor | None = None
            self._layer_staging_free: Any = None  # event: last placement out of the layer staging
            self._checked_pinned = False
            self._copied_events: list[Any] = []
            self._raw = _RawCopier.load()
            if self._raw is None:
                self.raw_copy = False
                _announce_once(
                    "raw-copier",
                    logging.INFO,
                    "maru.kv_ops: libcudart not found in this process; the layer-overlap load issues its copies "
                    "with Tensor.copy_ (same bytes, a few microseconds more issue time per layer)",
                )
        else:
            _announce_once(
                "cpu-direct",
                logging.INFO,
                "maru.kv_ops: no CUDA: direct CPU placement (caches on %s; pool <-> cache with kv_ops, no staging)",
                self.device,
            )

    # ------------------------------------------------------------------ geometry

    def object_shape(self, tokens: int, num_layers: int | None = None) -> tuple[int, int, int, int]:
        """Shape of a chunk object of ``tokens`` tokens: ``[L, KV, T, NH*HS]``."""
        return (num_layers or self.num_layers, self.layout.num_kv, int(tokens), self.layout.row_size)

    def object_bytes(self, tokens: int) -> int:
        return self.num_layers * self.layer_token_bytes * int(tokens)

    def host_object(self, buffer: Any, tokens: int, offset: int = 0) -> torch.Tensor:
        """A chunk object of ``tokens`` tokens over ``buffer`` at byte ``offset`` (no copy)."""
        return host_object(buffer, self.object_shape(tokens), self.dtype, offset)

    # ------------------------------------------------------------------ public operations

    def load(
        self,
        objects: Sequence[torch.Tensor] | torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        skip_tokens: int = 0,
        pipelined: bool = True,
    ) -> Transfer:
        """Scatter chunk objects (host) into the caches at ``slot_mapping`` (their tokens, in order).

        ``skip_tokens=n`` leaves the first n tokens of the call unwritten (blocks shared with the
        engine's own prefix cache). Returns at once on a GPU; ``wait()``/``wait_on()`` the handle.
        """
        objs = self._objects(objects)
        slots = self._slots(slot_mapping, objs, skip_tokens)
        nbytes = sum(o.numel() for o in objs) * self.esize
        if not self.on_gpu:
            with self._lock:
                token0 = 0
                for obj in objs:
                    t = obj.shape[2]
                    ops.scatter(
                        obj, self.caches, self.layout, slots[token0 : token0 + t], backend=self.backend
                    )
                    token0 += t
            return Transfer("load", "cpu-direct", nbytes, None, [])
        self._check_pinned(objs)
        with self._lock:
            if pipelined:
                return self._issue(objs, slots, nbytes, load=True)
            return self._sync(objs, slots, nbytes, load=True)

    def store(
        self,
        objects: Sequence[torch.Tensor] | torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        pipelined: bool = True,
    ) -> Transfer:
        """Gather the caches' KV at ``slot_mapping`` into chunk objects (host, e.g. pool pages).

        The objects' bytes are complete only after ``wait()`` (or ``done()`` returned True): commit
        (publish the keys) after that, never before.
        """
        objs = self._objects(objects)
        slots = self._slots(slot_mapping, objs, 0)
        nbytes = sum(o.numel() for o in objs) * self.esize
        if not self.on_gpu:
            with self._lock:
                token0 = 0
                for obj in objs:
                    t = obj.shape[2]
                    ops.gather(
                        self.caches, self.layout, slots[token0 : token0 + t], backend=self.backend, out=obj
                    )
                    token0 += t
            return Transfer("store", "cpu-direct", nbytes, None, [])
        self._check_pinned(objs)
        with self._lock:
            if pipelined:
                return self._issue(objs, slots, nbytes, load=False)
            return self._sync(objs, slots, nbytes, load=False)

    def load_layers(
        self,
        objects: Sequence[torch.Tensor] | torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        skip_tokens: int = 0,
        placer: Placer | None = None,
    ) -> LayerLoad:
        """Issue a load layer by layer (the layer-overlap load); returns at once.

        For each layer i: the copy engine brings layer i of every chunk into a staging buffer, the
        single-layer kernel places it, and an event is recorded. The forward pass calls
        ``wait_for_layer(i)`` before attention of layer i: it waits on layer i's event only.
        ``placer(obj_layer [KV, T, ROW], layer, slots)`` replaces the default
        ``kv_ops.scatter_layer`` call (for example a graph-replaying launcher).
        """
        objs = self._objects(objects)
        slots = self._slots(slot_mapping, objs, skip_tokens)
        nbytes = sum(o.numel() for o in objs) * self.esize
        if not self.on_gpu:
            with self._lock:
                for i in range(self.num_layers):
                    token0 = 0
                    for obj in objs:
                        t = obj.shape[2]
                        self._place_layer(obj[i], i, slots[token0 : token0 + t], placer)
                        token0 += t
            return LayerLoad(nbytes, None, [])
        self._check_pinned(objs)
        with self._lock:
            return self._issue_layers(objs, slots, nbytes, placer)

    # ------------------------------------------------------------------ validation

    def _objects(self, objects: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        objs = [objects] if isinstance(objects, torch.Tensor) else list(objects)
        if not objs:
            raise ValueError("no chunk objects given")
        out = []
        for c, obj in enumerate(objs):
            if obj.device.type != "cpu":
                raise ValueError(
                    f"chunk object {c} is on {obj.device}; the engine moves host objects (pool pages) "
                    f"to and from the caches, pass a tensor over the pool mapping (host_object)"
                )
            if obj.dtype != self.dtype:
                raise ValueError(f"chunk object {c} is {obj.dtype}, the caches are {self.dtype}")
            if not obj.is_contiguous():
                raise ValueError(
                    f"chunk object {c} must be contiguous (one pool page), got strides {obj.stride()}"
                )
            per_token = self.num_layers * self.layout.num_kv * self.layout.row_size
            if obj.dim() != 4:
                if obj.numel() % per_token:
                    raise ValueError(
                        f"chunk object {c} has {obj.numel()} elements, not a whole number of tokens of "
                        f"{per_token} elements ([L={self.num_layers}, KV={self.layout.num_kv}, T, {self.layout.row_size}])"
                    )
                obj = obj.view(self.object_shape(obj.numel() // per_token))
            elif tuple(obj.shape[:2]) + (obj.shape[3],) != (
                self.num_layers,
                self.layout.num_kv,
                self.layout.row_size,
            ):
                raise ValueError(
                    f"chunk object {c} has shape {list(obj.shape)}, expected "
                    f"[{self.num_layers}, {self.layout.num_kv}, T, {self.layout.row_size}]"
                )
            out.append(obj)
        return out

    def _slots(self, slot_mapping: torch.Tensor, objs: list[torch.Tensor], skip_tokens: int) -> torch.Tensor:
        total = sum(o.shape[2] for o in objs)
        if not isinstance(slot_mapping, torch.Tensor):
            slot_mapping = torch.as_tensor(slot_mapping, dtype=torch.int64)
        if slot_mapping.dim() != 1 or slot_mapping.numel() != total:
            raise ValueError(
                f"slot_mapping has shape {list(slot_mapping.shape)}, expected [{total}] (one slot per token "
                f"of the {len(objs)} chunk object(s), in order)"
            )
        if skip_tokens < 0 or skip_tokens > total:
            raise ValueError(f"skip_tokens={skip_tokens} must be in [0, {total}]")
        if skip_tokens:
            # A negative slot is never written: skipping is masking, for every backend and path.
            slot_mapping = slot_mapping.clone()
            slot_mapping[:skip_tokens] = -1
        if self.on_gpu and slot_mapping.device != self.device:
            slot_mapping = slot_mapping.to(torch.int64)
            if not slot_mapping.is_pinned():
                slot_mapping = slot_mapping.pin_memory()
            with torch.cuda.stream(self._place_stream):
                dev = slot_mapping.to(self.device, non_blocking=True)
            # The pinned source must live until the copy ran; the placement stream orders the rest.
            dev.record_stream(self._place_stream)
            self._slot_src_keepalive = slot_mapping
            return dev
        return slot_mapping

    def _check_pinned(self, objs: list[torch.Tensor]) -> None:
        if self._checked_pinned:
            return
        self._checked_pinned = True
        if not objs[0].is_pinned():
            _announce_once(
                "pageable",
                logging.WARNING,
                "maru.kv_ops: SLOW PATH: chunk objects live in pageable host memory (the pool mapping is not "
                "registered with CUDA): host<->GPU copies run ~11x below the bus (4.9 vs 55 GB/s on an H200). "
                "Fix: maru.client.cuda_host.register_host_mapping(pool_mapping) once per process "
                "(see `maru doctor`)",
            )

    # ------------------------------------------------------------------ GPU paths

    def _units(self, objs: list[torch.Tensor]) -> list[_Unit]:
        units = []
        token0 = 0
        for c, obj in enumerate(objs):
            t = obj.shape[2]
            layer_bytes = t * self.layer_token_bytes
            if self.cross_layer:
                per = self.num_layers  # kv_ops places a cross-layer cache all layers at once
            else:
                per = max(1, min(self.num_layers, self.unit_bytes // max(layer_bytes, 1)))
            for a in range(0, self.num_layers, per):
                units.append(_Unit(c, a, min(a + per, self.num_layers), token0, t))
            token0 += t
        return units

    def _slot_tensor(self, s: int, numel: int) -> torch.Tensor:
        while len(self._ring) <= s:
            self._ring.append(torch.empty(0, dtype=self.dtype, device=self.device))
        if self._ring[s].numel() < numel:
            # Growing a slot: wait until its last use finished before the old memory is released.
            if self._ring_used[s]:
                self._ring_free[s].synchronize()
            self._ring[s] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self._ring[s]

    def _caches_for(self, u: _Unit) -> Any:
        return self.caches if self.cross_layer else self.caches[u.a : u.b]

    def _start_event(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _issue(self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, *, load: bool) -> Transfer:
        t0 = time.perf_counter()
        start = self._start_event()
        copy, place = self._copy_stream, self._place_stream
        copy.wait_event(start)
        place.wait_event(start)
        for u in self._units(objs):
            s = self._next_slot
            self._next_slot = (s + 1) % self.ring_slots
            host = objs[u.chunk][u.a : u.b]
            stage = self._slot_tensor(s, host.numel())[: host.numel()].view(host.shape)
            unit_slots = slots[u.token0 : u.token0 + u.tokens]
            if load:
                if self._ring_used[s]:
                    copy.wait_event(self._ring_free[s])
                with torch.cuda.stream(copy):
                    stage.copy_(host, non_blocking=True)
                    self._ring_ready[s].record(copy)
                place.wait_event(self._ring_ready[s])
                with torch.cuda.stream(place):
                    ops.scatter(stage, self._caches_for(u), self.layout, unit_slots, backend=self.backend)
                    self._ring_free[s].record(place)
            else:
                if self._ring_used[s]:
                    place.wait_event(self._ring_free[s])
                with torch.cuda.stream(place):
                    ops.gather(self._caches_for(u), self.layout, unit_slots, backend=self.backend, out=stage)
                    self._ring_ready[s].record(place)
                copy.wait_event(self._ring_ready[s])
                with torch.cuda.stream(copy):
                    host.copy_(stage, non_blocking=True)
                    self._ring_free[s].record(copy)
            self._ring_used[s] = True
        done = torch.cuda.Event()
        if load:
            done.record(place)
        else:
            done.record(copy)
        handle = Transfer("load" if load else "store", "pipelined", nbytes, done, [objs, slots])
        handle.issue_s = time.perf_counter() - t0
        return handle

    def _sync(self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, *, load: bool) -> Transfer:
        """The unpipelined baseline: per chunk, the whole copy, then the whole kernel, one stream."""
        t0 = time.perf_counter()
        stream = torch.cuda.current_stream(self.device)
        # slots were moved on the placement stream; make the caller's stream see them.
        stream.wait_stream(self._place_stream)
        token0 = 0
        for obj in objs:
            t = obj.shape[2]
            s = slots[token0 : token0 + t]
            if load:
                ops.scatter(
                    obj.to(self.device, non_blocking=True), self.caches, self.layout, s, backend=self.backend
                )
            else:
                dev = ops.gather(self.caches, self.layout, s, backend=self.backend)
                obj.copy_(dev, non_blocking=True)
            token0 += t
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()
        handle = Transfer("load" if load else "store", "sync", nbytes, None, [])
        handle.issue_s = time.perf_counter() - t0
        return handle

    def _events(self, n: int) -> list[Any]:
        # Copy-done events are reused across calls: a stream wait binds to the record made before it.
        while len(self._copied_events) < n:
            self._copied_events.append(torch.cuda.Event())
        return self._copied_events

    def _layer_buffer(self, numel: int) -> torch.Tensor:
        if self._layer_staging is None or self._layer_staging.numel() < numel:
            if self._layer_staging_free is not None:
                self._layer_staging_free.synchronize()
            self._layer_staging = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self._layer_staging

    def _place_layer(
        self, obj_layer: torch.Tensor, layer: int, slots: torch.Tensor, placer: Placer | None
    ) -> None:
        if placer is not None:
            placer(obj_layer, layer, slots)
        elif self.cross_layer:
            ops.scatter_layer(obj_layer, self.caches, self.layout, slots, layer=layer, backend=self.backend)
        else:
            ops.scatter_layer(obj_layer, self.caches[layer], self.layout, slots, backend=self.backend)

    def _issue_layers(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, placer: Placer | None
    ) -> LayerLoad:
        t0 = time.perf_counter()
        total = slots.numel()
        kv, row = self.layout.num_kv, self.layout.row_size
        # [L, KV, T_total, ROW]: layer i is one contiguous [KV, T, ROW] object for one kernel launch.
        staging = self._layer_buffer(self.num_layers * kv * total * row)[: self.num_layers * kv * total * row]
        staging = staging.view(self.num_layers, kv, total, row)
        start = self._start_event()
        copy, place = self._copy_stream, self._place_stream
        copy.wait_event(start)
        place.wait_event(start)
        if self._layer_staging_free is not None:
            copy.wait_event(self._layer_staging_free)  # the previous call's placements read this buffer
        copied_events = self._events(self.num_layers)
        events = [torch.cuda.Event() for _ in range(self.num_layers)]
        raw = self._raw if self.raw_copy else None
        es = self.esize
        obj_ptrs = [(o.data_ptr(), o.shape[2]) for o in objs]
        st_ptr, st_layer, st_plane = staging.data_ptr(), staging.stride(0) * es, staging.stride(1) * es
        copy_handle = copy.cuda_stream
        with torch.cuda.stream(place):  # placement kernels launch on the current stream
            for i in range(self.num_layers):
                if raw is not None:
                    token0 = 0
                    for ptr, t in obj_ptrs:
                        plane = t * row * es  # one plane of one layer of this chunk, contiguous in the pool
                        src = ptr + i * kv * plane
                        dst = st_ptr + i * st_layer + token0 * row * es
                        if len(obj_ptrs) == 1:
                            raw.copy(dst, src, kv * plane, copy_handle)
                        else:  # K and V planes land T_total rows apart: one pitched copy
                            raw.copy2d(dst, st_plane, src, plane, plane, kv, copy_handle)
                        token0 += t
                else:
                    with torch.cuda.stream(copy):
                        token0 = 0
                        for obj in objs:
                            t = obj.shape[2]
                            for p in range(kv):  # each plane slice is contiguous on both sides
                                staging[i, p, token0 : token0 + t].copy_(obj[i, p], non_blocking=True)
                            token0 += t
                copied_events[i].record(copy)
                place.wait_event(copied_events[i])
                self._place_layer(staging[i], i, slots, placer)
                events[i].record(place)
        self._layer_staging_free = events[-1]
        handle = LayerLoad(nbytes, events, [objs, slots])
        handle.issue_s = time.perf_counter() - t0
        return handle

    def synchronize(self) -> None:
        """Wait for everything this engine issued (tests, shutdown)."""
        if self.on_gpu:
            self._copy_stream.synchronize()
            self._place_stream.synchronize()
