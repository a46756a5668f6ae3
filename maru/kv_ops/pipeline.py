"""The transfer engine: chunk objects in host memory (the pool) <-> a paged KV cache, pipelined.

Independent of vLLM: it takes the per-layer caches and their ``KVLayout`` once, then stores and
loads *chunk objects* ``[L, KV, T, NH*HS]`` (see ``maru.kv_ops.ops``) that live in host memory,
normally tensors over the CUDA-registered pool mapping (``host_object``).

On a GPU a bounded ring of staging slots (one chunk object each) carries the chunks:

* LOAD: the copy engine brings chunk i from the pool into slot ``i % R`` (an async copy on the copy
  stream) while the placement kernel scatters chunk i-1 out of its slot on the placement stream.
  Events order them: the placement of chunk i waits for its copy; the copy into a slot waits until
  the previous placement out of that slot finished.
* STORE mirrors it: the gather kernel fills slot ``i % R`` on the placement stream, the copy engine
  moves it into the pool page on the copy stream. The caller commits (publishes keys) only after
  ``Transfer.wait()`` / ``done()``: a visible key means complete bytes.
* LAYERS (``load_layers``, the layer-overlap load): layer i of every chunk is copied into a staging
  buffer and placed with the single-layer kernel; one event per layer, so
  ``LayerLoad.wait_for_layer(i)`` makes the compute stream wait for layer i only.

Placement uses kv_ops's ``GraphedPlacer`` (CUDA-graph replays: a few microseconds of host time per
launch) when the Triton backend runs, else the eager ``kv_ops`` operations. Copies and events of the
layer path go straight to libcudart through ctypes (about a microsecond each), because the per-layer
issue budget is 10 us.

Invariants:

* Every operation starts after the work already queued on the caller's current stream (an event is
  recorded there at issue): a load never races the computation that last used those blocks, a store
  reads the KV the forward pass just wrote.
* Issue never blocks the host on the GPU (except once, when a graph is first captured). The host
  objects stay referenced by the handle until it has completed.
* Kernels receive the caches as detected (``KVLayout`` carries the physical strides), so an HND cache
  is placed in its physical axis order, whatever its shape shows.
* A skipped token (negative slot, or within ``skip_tokens``) is never written into the cache. In a
  stored object, the rows of negative slots are unspecified.
* On CPU caches there is nothing to pipeline: each call degrades to direct ``kv_ops`` calls between
  the pool and the cache (announced once, at info level: the normal CPU path).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from maru.kv_ops import ops
from maru.kv_ops.layout import KVLayout

log = logging.getLogger("maru.kv_ops")

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


# ---------------------------------------------------------------------- CUDA synchronisation


class _TorchSync:
    """Events and copies through torch (always available)."""

    raw = False

    def event(self) -> Any:
        return torch.cuda.Event()

    def record(self, event: Any, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()


_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost
_EVENT_DISABLE_TIMING = 2
_NOT_READY = 600  # cudaErrorNotReady


class _RawSync(_TorchSync):
    """The same operations straight through the process's libcudart (ctypes: ~1 us a call, against
    3-6 us through torch). Events are raw ``cudaEvent_t`` handles owned by the engine."""

    raw = True

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._lib = lib
        self._memcpy = self._fn("cudaMemcpyAsync", [vp, vp, sz, i, vp])
        self._memcpy2d = self._fn("cudaMemcpy2DAsync", [vp, sz, vp, sz, sz, sz, i, vp])
        self._record = self._fn("cudaEventRecord", [vp, vp])
        self._wait = self._fn("cudaStreamWaitEvent", [vp, vp, ctypes.c_uint])
        self._query = self._fn("cudaEventQuery", [vp])
        self._sync = self._fn("cudaEventSynchronize", [vp])
        self._create = self._fn("cudaEventCreateWithFlags", [ctypes.POINTER(vp), ctypes.c_uint])
        self._devptr = self._fn("cudaHostGetDevicePointer", [ctypes.POINTER(vp), vp, ctypes.c_uint])
        self._last_error = self._fn("cudaGetLastError", [])

    def _fn(self, name: str, argtypes: list[Any]) -> Any:
        f = getattr(self._lib, name)
        f.argtypes = argtypes
        f.restype = ctypes.c_int
        return f

    @classmethod
    def load(cls) -> _RawSync | None:
        """The libcudart torch already loaded (the same runtime and context), or None."""
        try:
            with open("/proc/self/maps") as maps:
                paths = [line.split()[-1] for line in maps if "libcudart" in line]
            return cls(ctypes.CDLL(paths[0])) if paths else None
        except (OSError, AttributeError):
            return None

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed: cudaError {err}")

    def event(self) -> int:
        handle = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(handle), _EVENT_DISABLE_TIMING), "cudaEventCreateWithFlags")
        return int(handle.value or 0)

    def record(self, event: int, stream: torch.cuda.Stream) -> None:
        self._check(self._record(event, stream.cuda_stream), "cudaEventRecord")

    def wait(self, stream: torch.cuda.Stream, event: int) -> None:
        self._check(self._wait(stream.cuda_stream, event, 0), "cudaStreamWaitEvent")

    def query(self, event: int) -> bool:
        err = self._query(event)
        if err == _NOT_READY:
            return False
        self._check(err, "cudaEventQuery")
        return True

    def synchronize(self, event: int) -> None:
        self._check(self._sync(event), "cudaEventSynchronize")

    def device_pointer(self, host_ptr: int) -> int | None:
        """The device address of registered/pinned host memory, or None if CUDA cannot map it."""
        out = ctypes.c_void_p()
        if self._devptr(ctypes.byref(out), host_ptr, 0):
            self._last_error()  # clear it: torch's next launch check would otherwise report it
            return None
        return int(out.value or 0)

    def copy(self, dst: int, src: int, nbytes: int, stream: int, kind: int = _H2D) -> None:
        self._check(
            self._memcpy(dst, src, nbytes, kind, stream), f"cudaMemcpyAsync({nbytes} bytes, kind {kind})"
        )

    def copy2d(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int
    ) -> None:
        err = self._memcpy2d(dst, dpitch, src, spitch, width, height, _H2D, stream)
        self._check(err, f"cudaMemcpy2DAsync({height} x {width} bytes)")


def _bucket(tokens: int) -> int:
    """Graph bucket of a layer load of ``tokens`` tokens: a power of two, at least 16."""
    tb = 16
    while tb < tokens:
        tb *= 2
    return tb


# ---------------------------------------------------------------------- handles


class Transfer:
    """Handle of one issued store or load. ``wait()`` before committing keys or unpinning entries."""

    def __init__(
        self,
        kind: str,
        path: str,
        nbytes: int,
        done_event: Any = None,
        sync: Any = None,
        keepalive: Any = None,
    ) -> None:
        self.kind = kind  # "load" | "store"
        self.path = path  # "pipelined" | "sync" | "cpu-direct" | "layers"
        self.nbytes = nbytes
        self.issue_s = 0.0  # host seconds spent issuing
        self._event = done_event  # None when complete at return (CPU, sync)
        self._sync = sync
        self._keepalive = keepalive

    def done(self) -> bool:
        """True once every copy and kernel of this transfer finished (never blocks)."""
        if self._event is None or self._sync.query(self._event):
            self._keepalive = None
            return True
        return False

    def wait(self) -> None:
        """Block the calling thread until the transfer completed."""
        if self._event is not None:
            self._sync.synchronize(self._event)
        self._keepalive = None

    def wait_on(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current stream) wait for this transfer; the host does not block."""
        if self._event is not None:
            self._sync.wait(stream or torch.cuda.current_stream(), self._event)


class LayerLoad(Transfer):
    """A load issued layer by layer: ``wait_for_layer(i)`` waits for layer i alone.

    Layer events are recycled after a few later calls; waiting on a recycled event waits for a
    *later* load of the same layer, which is later in stream order: never too early, at worst late.
    """

    def __init__(self, nbytes: int, layer_events: list[Any] | None, sync: Any, keepalive: Any) -> None:
        done = layer_events[-1] if layer_events else None
        super().__init__("load", "layers" if layer_events else "cpu-direct", nbytes, done, sync, keepalive)
        self._layer_events = layer_events
        self.graphed = False  # placements replayed from CUDA graphs
        self.copy_issue_s = 0.0  # host time to queue every layer's copies (and the call's setup)
        self.place_issue_s = 0.0  # host time to queue the per-layer placements and their events

    def wait_for_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait until layer ``layer`` is placed. No host block."""
        if self._layer_events is not None:
            self._sync.wait(stream or torch.cuda.current_stream(), self._layer_events[layer])

    def layer_done(self, layer: int) -> bool:
        return self._layer_events is None or self._sync.query(self._layer_events[layer])


Placer = Callable[[torch.Tensor, int, torch.Tensor], None]


# ---------------------------------------------------------------------- staging slots


class _Slot:
    """One staging slot of the ring: a chunk-sized GPU buffer plus the means to place it.

    With a ``GraphedPlacer`` the buffer is the placer's static staging for T tokens and placement is
    a graph replay; otherwise the buffer is a plain tensor and placement an eager kv_ops call.
    ``free`` is recorded when the slot's last user (copy or kernel) finished with it.
    """

    def __init__(self, engine: TransferEngine, placer: Any) -> None:
        self.engine = engine
        self.placer = placer
        self.own: torch.Tensor | None = None
        self.free = engine._sync.event()
        self.ready = engine._sync.event()
        self.used = False

    def buffer(self, tokens: int) -> tuple[torch.Tensor, bool]:
        """``[L, KV, T, ROW]`` staging for ``tokens`` tokens, and whether it is graph-backed."""
        if self.placer is not None:
            try:
                # The placer's buffers hold the cache's bits (an integer dtype of the same width).
                return self.placer.staging(tokens).view(self.engine.dtype), True
            except ValueError:
                _announce_once(
                    "placer-full",
                    logging.INFO,
                    "maru.kv_ops: chunk of %d tokens has no graph bucket left; placing it with an eager launch",
                    tokens,
                )
        e = self.engine
        numel = e.num_layers * e.layout.num_kv * tokens * e.layout.row_size
        if self.own is None or self.own.numel() < numel:
            if self.used:
                e._sync.synchronize(self.free)  # the old buffer may still be read by a queued copy
            self.own = torch.empty(numel, dtype=e.dtype, device=e.device)
        return self.own[:numel].view(e.object_shape(tokens)), False

    def place(self, stage: torch.Tensor, graphed: bool, slots: torch.Tensor, *, load: bool) -> None:
        """Scatter ``stage`` into the caches (load) or gather into it (store), on the current stream."""
        e = self.engine
        if graphed:
            t = self.placer.set_slots(slots)
            if load:
                self.placer.scatter(t)
            else:
                self.placer.gather(t)
        elif load:
            ops.scatter(stage, e.caches, e.layout, slots, backend=e.backend)
        else:
            ops.gather(e.caches, e.layout, slots, backend=e.backend, out=stage)


# ---------------------------------------------------------------------- the engine


class TransferEngine:
    """Stores and loads chunk objects between host memory and one set of paged caches.

    ``caches``: the per-layer cache tensors (or the one cross-layer tensor) as the inference engine
    allocated them (they never move); ``layout``: ``kv_ops.detect_layouts`` of them. GPU state
    (streams, events, the staging ring, graphs) is made once here or on first use. Thread-safe: issue
    is serialized by a lock; handles may be waited on from any thread.

    ``use_graphs``: replay placements from CUDA graphs (kv_ops's ``GraphedPlacer``) when Triton runs;
    ``raw_cuda``: issue the layer path's copies and events through libcudart directly.
    """

    def __init__(
        self,
        caches: Any,
        layout: KVLayout,
        *,
        ring_slots: int = DEFAULT_RING_SLOTS,
        backend: str | None = None,
        use_graphs: bool = True,
        raw_cuda: bool = True,
        layer_path: str = "auto",
        layer_graphs: bool | None = None,
        lazy_capture: bool = True,
    ) -> None:
        if layer_path not in ("auto", "direct", "staged"):
            raise ValueError(f"layer_path must be 'auto', 'direct' or 'staged', got {layer_path!r}")
        if isinstance(caches, dict):
            caches = list(caches.values())
        self.layout = layout
        self.cross_layer = layout.is_cross_layer
        self.caches: Any = caches if self.cross_layer else list(caches)
        first = caches if isinstance(caches, torch.Tensor) else self.caches[0]
        self.dtype = first.dtype
        self.device = first.device
        self.num_layers = int(layout.num_layers) if self.cross_layer else len(self.caches)
        self.backend = backend
        self.esize = first.element_size()
        self.layer_token_bytes = layout.num_kv * layout.row_size * self.esize  # one token of one layer
        self.ring_slots = max(int(ring_slots), 1)
        self.layer_path = layer_path
        self._direct_ok: bool | None = None  # decided on the first layer load (needs an object)
        self._lock = threading.Lock()
        self.on_gpu = self.device.type == "cuda"
        self.graphs = False
        if not self.on_gpu:
            _announce_once(
                "cpu-direct",
                logging.INFO,
                "maru.kv_ops: no CUDA: direct CPU placement (caches on %s; pool <-> cache with kv_ops, no staging)",
                self.device,
            )
            return
        raw = _RawSync.load() if raw_cuda else None
        if raw_cuda and raw is None:
            _announce_once(
                "raw-cuda",
                logging.INFO,
                "maru.kv_ops: libcudart not found in this process; the layer-overlap load issues copies and "
                "events through torch (same bytes, a few microseconds more issue time per layer)",
            )
        self._sync: Any = raw or _TorchSync()
        self._copy_stream = torch.cuda.Stream(self.device)
        self._place_stream = torch.cuda.Stream(self.device)
        self.graphs = use_graphs and self._graphs_usable()
        self._ring = [_Slot(self, self._new_placer()) for _ in range(self.ring_slots)]
        self._next_slot = 0
        # The layer path may replay graphs while the chunk paths run eagerly (layer_graphs=True,
        # use_graphs=False): per-layer issue cost is what the layer-overlap load is judged on.
        want_layer_graphs = use_graphs if layer_graphs is None else layer_graphs
        self.layer_graphs = want_layer_graphs and (self.graphs or self._graphs_usable())
        self.lazy_capture = lazy_capture
        self._layer_placer = self._new_placer(self.layer_graphs)
        self._layer_own: torch.Tensor | None = None
        self._layer_free: Any = None  # event: last placement out of the layer staging
        self._event_sets: list[tuple[list[Any], list[Any]]] = []
        self._event_set_next = 0
        self._checked_pinned = False

    # ------------------------------------------------------------------ setup helpers

    def _graphs_usable(self) -> bool:
        from maru.kv_ops.selection import choose

        if self.backend == "reference" or (self.backend is None and choose("cuda").name != "triton"):
            return False
        try:
            from maru.kv_ops.placer import GraphedPlacer  # noqa: F401
        except ImportError as exc:
            _announce_once(
                "no-placer",
                logging.INFO,
                "maru.kv_ops: no graph placer (%s); placements are eager launches (~30 us of host time each)",
                exc,
            )
            return False
        return True

    def _new_placer(self, graphs: bool | None = None) -> Any:
        if not (self.graphs if graphs is None else graphs):
            return None
        from maru.kv_ops.placer import GraphedPlacer

        return GraphedPlacer(self.caches, self.layout)

    def _layer_events(self) -> tuple[list[Any], list[Any]]:
        """(copied, placed) event lists for one layer-path call, recycled over 4 calls."""
        if len(self._event_sets) < 4:
            s = self._sync
            self._event_sets.append(
                ([s.event() for _ in range(self.num_layers)], [s.event() for _ in range(self.num_layers)])
            )
            return self._event_sets[-1]
        self._event_set_next = (self._event_set_next + 1) % 4
        return self._event_sets[self._event_set_next]

    # ------------------------------------------------------------------ geometry

    def object_shape(self, tokens: int) -> tuple[int, int, int, int]:
        """Shape of a chunk object of ``tokens`` tokens: ``[L, KV, T, NH*HS]``."""
        return (self.num_layers, self.layout.num_kv, int(tokens), self.layout.row_size)

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
        nbytes = sum(o.numel() for o in objs) * self.esize
        with self._lock:
            if self.on_gpu and pipelined:
                self._check_pinned(objs)
                return self._issue_load(objs, slot_mapping, skip_tokens, nbytes)
            slots = self._slots(slot_mapping, objs, skip_tokens)
            if not self.on_gpu:
                for obj, s in self._per_chunk(objs, slots):
                    ops.scatter(obj, self.caches, self.layout, s, backend=self.backend)
                return Transfer("load", "cpu-direct", nbytes)
            self._check_pinned(objs)
            return self._sync_path(objs, slots, nbytes, load=True)

    def store(
        self,
        objects: Sequence[torch.Tensor] | torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        pipelined: bool = True,
    ) -> Transfer:
        """Gather the caches' KV at ``slot_mapping`` into chunk objects (host, e.g. pool pages).

        The objects' bytes are complete only after ``wait()`` (or once ``done()`` is True): commit
        (publish the keys) after that, never before.
        """
        objs = self._objects(objects)
        nbytes = sum(o.numel() for o in objs) * self.esize
        with self._lock:
            slots = self._slots(slot_mapping, objs, 0)
            if not self.on_gpu:
                for obj, s in self._per_chunk(objs, slots):
                    ops.gather(self.caches, self.layout, s, backend=self.backend, out=obj)
                return Transfer("store", "cpu-direct", nbytes)
            self._check_pinned(objs)
            if pipelined:
                return self._issue_store(objs, slots, nbytes)
            return self._sync_path(objs, slots, nbytes, load=False)

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
        single-layer kernel places it, an event is recorded. The forward pass calls
        ``wait_for_layer(i)`` before attention of layer i and waits on layer i's event only.
        ``placer(obj_layer [KV, T, ROW], layer, slots)`` replaces the built-in placement.
        """
        objs = self._objects(objects)
        nbytes = sum(o.numel() for o in objs) * self.esize
        with self._lock:
            if not self.on_gpu:
                slots = self._slots(slot_mapping, objs, skip_tokens)
                for i in range(self.num_layers):
                    for obj, s in self._per_chunk(objs, slots):
                        self._eager_layer(obj[i], i, s, placer)
                return LayerLoad(nbytes, None, None, None)
            self._check_pinned(objs)
            if placer is None and self._use_direct(objs[0]):
                return self._issue_layers_direct(objs, slot_mapping, skip_tokens, nbytes)
            slots = self._slots(slot_mapping, objs, skip_tokens)
            return self._issue_layers(objs, slots, nbytes, placer)

    def warm(self, chunk_tokens: int, layer_tokens: Sequence[int] = ()) -> None:
        """Capture the CUDA graphs now (about a millisecond each, with a device sync), not on first use.

        ``chunk_tokens``: the chunk size of the pipelined paths (every ring slot); ``layer_tokens``:
        request sizes the layer-overlap load will see (rounded up to their power-of-two bucket).
        The warm-up launches place nothing: the static slot buffers hold -1 until a call sets them.
        No-op without graphs (CPU, reference backend). With ``lazy_capture=False`` only warmed sizes
        are replayed from graphs; other sizes launch eagerly (no capture while serving).
        """
        if not self.on_gpu:
            return
        with self._lock, torch.cuda.stream(self._place_stream):
            if chunk_tokens and self.graphs:
                if any(slot.used for slot in self._ring):
                    # A capture replays its op once eagerly; after a transfer the static slots hold
                    # real slots.
                    raise RuntimeError("TransferEngine.warm(chunk_tokens) must run before the first transfer")
                for slot in self._ring:
                    slot.placer.warm(int(chunk_tokens))
            if self._layer_placer is None:
                return
            for tokens in layer_tokens:
                tb = _bucket(tokens)
                if self.layer_path == "staged":
                    if self._layer_free is not None:
                        raise RuntimeError(
                            "TransferEngine.warm(layer_tokens) must run before the first layer load"
                        )
                    self._layer_placer.warm(tb, per_layer=True)
                else:
                    # The direct path needs only its per-layer graphs (no staging). Its capture replays
                    # the kernel once eagerly: clear the table's slots first (stream-ordered after any
                    # earlier load), so that replay places nothing.
                    self._layer_placer.direct_table(tb)[2].fill_(-1)
                    self._layer_placer.warm_direct(tb)

    def synchronize(self) -> None:
        """Wait for everything this engine issued (tests, shutdown)."""
        if self.on_gpu:
            self._copy_stream.synchronize()
            self._place_stream.synchronize()

    # ------------------------------------------------------------------ validation

    def _objects(self, objects: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        objs = [objects] if isinstance(objects, torch.Tensor) else list(objects)
        if not objs:
            raise ValueError("no chunk objects given")
        per_token = self.num_layers * self.layout.num_kv * self.layout.row_size
        out = []
        for c, obj in enumerate(objs):
            if obj.device.type != "cpu":
                raise ValueError(
                    f"chunk object {c} is on {obj.device}; the engine moves host objects (pool pages) to and "
                    f"from the caches: pass a tensor over the pool mapping (host_object)"
                )
            if obj.dtype != self.dtype:
                raise ValueError(f"chunk object {c} is {obj.dtype}, the caches are {self.dtype}")
            if not obj.is_contiguous():
                raise ValueError(
                    f"chunk object {c} must be contiguous (one pool page), got strides {obj.stride()}"
                )
            if obj.dim() != 4:
                if obj.numel() % per_token:
                    raise ValueError(
                        f"chunk object {c} has {obj.numel()} elements, not a whole number of tokens of "
                        f"{per_token} elements ([L={self.num_layers}, KV={self.layout.num_kv}, T, "
                        f"{self.layout.row_size}])"
                    )
                obj = obj.view(self.object_shape(obj.numel() // per_token))
            elif (obj.shape[0], obj.shape[1], obj.shape[3]) != (
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

    @staticmethod
    def _check_slots(slot_mapping: Any, objs: list[torch.Tensor], skip_tokens: int) -> torch.Tensor:
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
        return slot_mapping

    def _slots(self, slot_mapping: Any, objs: list[torch.Tensor], skip_tokens: int) -> torch.Tensor:
        """The slot mapping as int64 on the caches' device (moved on the placement stream)."""
        slot_mapping = self._check_slots(slot_mapping, objs, skip_tokens)
        if self.on_gpu:
            caller = torch.cuda.current_stream(self.device)
            if slot_mapping.device.type == "cpu" and not slot_mapping.is_pinned():
                # From pageable memory an async copy first syncs the stream: pin (cached) to stay async.
                slot_mapping = slot_mapping.to(torch.int64).pin_memory()
            with torch.cuda.stream(self._place_stream):
                # Wait for whatever produced a device mapping on the caller's stream.
                self._place_stream.wait_stream(caller)
                slots = slot_mapping.to(self.device, torch.int64, non_blocking=True)
                if skip_tokens:  # a negative slot is never written: skipping is masking
                    slots = slots.clone() if slots is slot_mapping else slots
                    slots[:skip_tokens] = -1
            return slots
        slots = slot_mapping.to(torch.int64)
        if skip_tokens:
            slots = slots.clone() if slots is slot_mapping else slots
            slots[:skip_tokens] = -1
        return slots

    @staticmethod
    def _per_chunk(objs: list[torch.Tensor], slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out, token0 = [], 0
        for obj in objs:
            t = obj.shape[2]
            out.append((obj, slots[token0 : token0 + t]))
            token0 += t
        return out

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

    def _start(self) -> None:
        """Both engine streams start after the work queued so far on the caller's stream."""
        caller = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(caller)
        self._place_stream.wait_stream(caller)

    def _h2d(self, stage: torch.Tensor, host: torch.Tensor) -> None:
        """Queue ``stage <- host`` on the copy stream (raw cudaMemcpyAsync when available)."""
        if self._sync.raw:
            self._sync.copy(
                stage.data_ptr(), host.data_ptr(), host.numel() * self.esize, self._copy_stream.cuda_stream
            )
        else:
            with torch.cuda.stream(self._copy_stream):
                stage.copy_(host, non_blocking=True)

    def _d2h(self, host: torch.Tensor, stage: torch.Tensor) -> None:
        if self._sync.raw:
            n = host.numel() * self.esize
            self._sync.copy(host.data_ptr(), stage.data_ptr(), n, self._copy_stream.cuda_stream, _D2H)
        else:
            with torch.cuda.stream(self._copy_stream):
                host.copy_(stage, non_blocking=True)

    def _take_slot(self) -> _Slot:
        slot = self._ring[self._next_slot]
        self._next_slot = (self._next_slot + 1) % self.ring_slots
        return slot

    def _issue_load(
        self, objs: list[torch.Tensor], slot_mapping: Any, skip_tokens: int, nbytes: int
    ) -> Transfer:
        """Copies run up to R chunks ahead of placements; the first copies are queued before anything else."""
        t0 = time.perf_counter()
        self._check_slots(slot_mapping, objs, skip_tokens)  # before any copy is queued
        sync, copy, place = self._sync, self._copy_stream, self._place_stream
        self._start()
        staged: list[tuple[_Slot, torch.Tensor, bool]] = []

        def issue_copy(k: int) -> None:
            slot = self._take_slot()
            stage, graphed = slot.buffer(objs[k].shape[2])
            if slot.used:
                sync.wait(copy, slot.free)  # its previous placement must have read it
            self._h2d(stage, objs[k])
            sync.record(slot.ready, copy)
            slot.used = True
            staged.append((slot, stage, graphed))

        n, ahead = len(objs), min(self.ring_slots, len(objs))
        for k in range(ahead):
            issue_copy(k)
        slots = self._slots(slot_mapping, objs, skip_tokens)  # validated and moved while the bus is busy
        with torch.cuda.stream(place):  # placements launch on the current stream
            for k, (_obj, chunk_slots) in enumerate(self._per_chunk(objs, slots)):
                slot, stage, graphed = staged[k]
                sync.wait(place, slot.ready)
                slot.place(stage, graphed, chunk_slots, load=True)
                sync.record(slot.free, place)
                if k + ahead < n:
                    issue_copy(k + ahead)
        done = self._done_event()
        sync.record(done, place)
        handle = Transfer("load", "pipelined", nbytes, done, sync, (objs, slots))
        handle.issue_s = time.perf_counter() - t0
        return handle

    def _issue_store(self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int) -> Transfer:
        t0 = time.perf_counter()
        sync, copy, place = self._sync, self._copy_stream, self._place_stream
        self._start()
        with torch.cuda.stream(place):  # placements launch on the current stream
            for host, chunk_slots in self._per_chunk(objs, slots):
                slot = self._take_slot()
                stage, graphed = slot.buffer(host.shape[2])
                if slot.used:
                    sync.wait(place, slot.free)  # its previous copy to the pool must have read it
                slot.place(stage, graphed, chunk_slots, load=False)
                sync.record(slot.ready, place)
                sync.wait(copy, slot.ready)
                self._d2h(host, stage)
                sync.record(slot.free, copy)
                slot.used = True
        done = self._done_event()
        sync.record(done, copy)
        handle = Transfer("store", "pipelined", nbytes, done, sync, (objs, slots))
        handle.issue_s = time.perf_counter() - t0
        return handle

    def _done_event(self) -> Any:
        # Raw events are engine-owned; done events of the pipelined path are recycled over 64 calls
        # (a handle kept longer waits, at worst, for a later transfer: never too early).
        if not self._sync.raw:
            return self._sync.event()
        if not hasattr(self, "_done_events"):
            self._done_events = [self._sync.event() for _ in range(64)]
            self._done_next = 0
        self._done_next = (self._done_next + 1) % len(self._done_events)
        return self._done_events[self._done_next]

    def _sync_path(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, *, load: bool
    ) -> Transfer:
        """The unpipelined baseline: per chunk the whole copy, then the whole kernel, one stream, then wait."""
        t0 = time.perf_counter()
        stream = torch.cuda.current_stream(self.device)
        stream.wait_stream(self._place_stream)  # the slot mapping was moved there
        for obj, s in self._per_chunk(objs, slots):
            if load:
                ops.scatter(
                    obj.to(self.device, non_blocking=True), self.caches, self.layout, s, backend=self.backend
                )
            else:
                obj.copy_(ops.gather(self.caches, self.layout, s, backend=self.backend), non_blocking=True)
        stream.synchronize()
        handle = Transfer("load" if load else "store", "sync", nbytes)
        handle.issue_s = time.perf_counter() - t0
        return handle

    def _eager_layer(
        self, obj_layer: torch.Tensor, layer: int, slots: torch.Tensor, placer: Placer | None
    ) -> None:
        if placer is not None:
            placer(obj_layer, layer, slots)
        elif self.cross_layer:
            ops.scatter_layer(obj_layer, self.caches, self.layout, slots, layer=layer, backend=self.backend)
        else:
            ops.scatter_layer(obj_layer, self.caches[layer], self.layout, slots, backend=self.backend)

    def _layer_staging(self, tokens: int, placer: Placer | None) -> tuple[torch.Tensor, int, bool]:
        """(staging [L, KV, Tb, ROW], Tb, graph-backed) for a call of ``tokens`` tokens.

        With graphs, Tb is ``tokens`` rounded up to a power of two (at least 16), so a handful of
        static buffers and graphs serve every request size; pad slots are -1 (never written).
        """
        if placer is None and self._layer_placer is not None:
            tb = _bucket(tokens)
            try:
                return self._layer_placer.staging(tb).view(self.dtype), tb, True
            except ValueError:
                _announce_once(
                    "layer-placer-full",
                    logging.INFO,
                    "maru.kv_ops: layer-overlap load of %d tokens has no graph bucket left; eager launches",
                    tokens,
                )
        numel = self.num_layers * self.layout.num_kv * tokens * self.layout.row_size
        if self._layer_own is None or self._layer_own.numel() < numel:
            if self._layer_free is not None:
                self._sync.synchronize(self._layer_free)
            self._layer_own = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self._layer_own[:numel].view(self.object_shape(tokens)), tokens, False

    def _issue_layers(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, placer: Placer | None
    ) -> LayerLoad:
        t0 = time.perf_counter()
        total = slots.numel()
        kv, row, es = self.layout.num_kv, self.layout.row_size, self.esize
        staging, tb, graphed = self._layer_staging(total, placer)
        copied, placed = self._layer_events()
        sync, copy, place = self._sync, self._copy_stream, self._place_stream
        self._start()
        if self._layer_free is not None:
            sync.wait(copy, self._layer_free)  # the previous call's placements read this staging
        raw = sync.raw
        st_ptr, st_layer, st_plane = staging.data_ptr(), staging.stride(0) * es, staging.stride(1) * es
        chunks = [(o.data_ptr(), o.shape[2]) for o in objs]
        copy_handle = copy.cuda_stream
        # Phase A: every layer's copies, layer-major (layer 0 lands first), one event per layer.
        for i in range(self.num_layers):
            if raw:
                token0 = 0
                for ptr, t in chunks:
                    plane = t * row * es  # one plane of one layer of this chunk, contiguous in the pool
                    src = ptr + i * kv * plane
                    dst = st_ptr + i * st_layer + token0 * row * es
                    # One chunk filling its bucket: the layer's planes are contiguous on both sides.
                    if tb == t:
                        sync.copy(dst, src, kv * plane, copy_handle)
                    else:  # planes land Tb rows apart in the staging: a copy per plane
                        for p in range(kv):
                            sync.copy(dst + p * st_plane, src + p * plane, plane, copy_handle)
                    token0 += t
            else:
                with torch.cuda.stream(copy):
                    token0 = 0
                    for obj in objs:
                        t = obj.shape[2]
                        staging[i, :, token0 : token0 + t].copy_(obj[i], non_blocking=True)
                        token0 += t
            sync.record(copied[i], copy)
        t_copies = time.perf_counter()
        # Phase B: per layer, wait for its copy, place it (a graph replay), record its event.
        with torch.cuda.stream(place):  # placements launch on the current stream
            if graphed:
                if tb != total:
                    padded = torch.full((tb,), -1, dtype=torch.int64, device=self.device)
                    padded[:total] = slots
                    slots = padded
                self._layer_placer.set_slots(slots)
            t_place = time.perf_counter()
            for i in range(self.num_layers):
                sync.wait(place, copied[i])
                if graphed:
                    self._layer_placer.scatter_layer(i, tb)
                else:
                    self._eager_layer(staging[i], i, slots, placer)
                sync.record(placed[i], place)
        t_end = time.perf_counter()
        self._layer_free = placed[-1]
        handle = LayerLoad(nbytes, placed, sync, (objs, slots))
        handle.graphed = graphed
        handle.issue_s = time.perf_counter() - t0
        handle.copy_issue_s = t_copies - t0  # includes the fixed per-call setup
        handle.place_issue_s = t_end - t_place  # the per-layer placements alone
        return handle

    # ------------------------------------------------------------------ direct (zero-copy) layer path

    def _use_direct(self, obj: torch.Tensor) -> bool:
        """Whether the layer load reads the objects in place: decided once, announced once.

        Needs the Triton backend and host memory the GPU addresses at the same pointer (a pool
        registered with CUDA, or pinned memory, under unified addressing).
        """
        if self.layer_path == "staged":
            return False
        if self._direct_ok is None:
            why = self._direct_blocker(obj)
            self._direct_ok = why is None
            if why is None:
                _announce_once(
                    "layer-direct",
                    logging.INFO,
                    "maru.kv_ops: layer-overlap load reads chunk objects in place (zero-copy: one kernel "
                    "per layer over the bus, no staging, no per-chunk copies)",
                )
            elif self.layer_path == "direct":
                raise RuntimeError(f"layer_path='direct' cannot run: {why}")
            else:
                _announce_once(
                    "layer-staged",
                    logging.WARNING,
                    "maru.kv_ops: layer-overlap load uses staged copies (one host call per chunk and layer, "
                    "~20 us each): %s. Fix: register the pool with CUDA (maru doctor) and use the triton backend",
                    why,
                )
        return self._direct_ok

    def _direct_blocker(self, obj: torch.Tensor) -> str | None:
        from maru.kv_ops.selection import choose

        if self.backend == "reference" or (self.backend is None and choose("cuda").name != "triton"):
            return "the placement backend is not triton"
        if not obj.is_pinned():
            return "the chunk objects are pageable host memory (the GPU cannot address them)"
        if self._sync.raw:
            dev = self._sync.device_pointer(obj.data_ptr())
            if dev != obj.data_ptr():
                return f"CUDA maps the pool at another device address ({dev}); in-place reads need UVA"
        return None

    def _after_caller(self, stream: torch.cuda.Stream) -> None:
        """``stream`` waits for the work queued so far on the caller's current stream.

        Through libcudart when available (an engine-owned event: ~2 us against ~15 us for
        ``wait_stream``); re-recording the event later is safe, the wait already captured it.
        """
        caller = torch.cuda.current_stream(self.device)
        if not self._sync.raw:
            stream.wait_stream(caller)
            return
        if getattr(self, "_caller_event", None) is None:
            self._caller_event = self._sync.event()
        self._sync.record(self._caller_event, caller)
        self._sync.wait(stream, self._caller_event)

    def _issue_layers_direct(
        self, objs: list[torch.Tensor], slot_mapping: Any, skip_tokens: int, nbytes: int
    ) -> LayerLoad:
        """One direct kernel (a graph replay) and one event per layer; no copies to issue.

        The per-call table (source address, plane stride and slot of every token) is built on the
        host and uploaded with one async copy on the placement stream; the graphs read it from a
        static buffer of the call's bucket, so a later call's upload is ordered after this call's
        kernels by the stream.
        """
        from maru.kv_ops import triton_kernels as tk

        t0 = time.perf_counter()
        slot_mapping = self._check_slots(slot_mapping, objs, skip_tokens)
        total = int(slot_mapping.numel())
        on_device = slot_mapping.device.type != "cpu"
        host_slots = (
            torch.full((total,), -1, dtype=torch.int64) if on_device else slot_mapping.to(torch.int64)
        )
        if skip_tokens and not on_device:
            host_slots = host_slots.clone() if host_slots is slot_mapping else host_slots
            host_slots[:skip_tokens] = -1
        graphed = self._layer_placer is not None
        tb = _bucket(total) if graphed else total
        if graphed and not self.lazy_capture and not self._layer_placer.has_direct(tb):
            _announce_once(
                f"direct-cold-{tb}",
                logging.INFO,
                "maru.kv_ops: layer load of %d tokens: no warmed graphs for its %d-token bucket; eager "
                "launches (~30 us of host time a layer). Warm the engine for that size at start",
                total,
                tb,
            )
            graphed, tb = False, total  # eager: no capture while serving, no padding
        chunks = [(o.data_ptr(), o.shape[2]) for o in objs]
        host_tab = tk.direct_table_host(chunks, host_slots, self.layout.row_size, self.esize, tb)
        _copied, placed = self._layer_events()
        sync, place = self._sync, self._place_stream
        self._after_caller(place)
        with torch.cuda.stream(place):  # the table upload and the kernels run on the placement stream
            if graphed:
                try:
                    tab = self._layer_placer.direct_table(tb)
                except ValueError:
                    graphed, tab = False, None
            if not graphed:
                tab = torch.empty((tk.DIRECT_ROWS, tb + 1), dtype=torch.int64, device=self.device)
            tab.copy_(host_tab, non_blocking=True)
            if on_device:  # the slot row comes from the device mapping, not the host
                tab[2, :total].copy_(slot_mapping.to(torch.int64), non_blocking=True)
                if skip_tokens:
                    tab[2, :skip_tokens].fill_(-1)
            t_place = time.perf_counter()
            refs = None if graphed else ops.layer_refs(self.caches, self.layout)
            for i in range(self.num_layers):
                if graphed:
                    self._layer_placer.scatter_layer_direct(i, tb)
                else:
                    tk.direct_scatter_layer(tab, refs[i], self.layout, i, tb)
                sync.record(placed[i], place)
        t_end = time.perf_counter()
        handle = LayerLoad(nbytes, placed, sync, (objs, host_tab, tab, slot_mapping))
        handle.path = "layers-direct"
        handle.graphed = graphed
        handle.issue_s = t_end - t0
        handle.copy_issue_s = t_place - t0  # the table: built on the host and uploaded
        handle.place_issue_s = t_end - t_place
        return handle
