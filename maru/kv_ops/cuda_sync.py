"""CUDA events and copies for the device pipeline: through torch, or straight through libcudart.

``RawSync`` calls the process's libcudart through ctypes (about a microsecond a call, against 3-6
through torch), because the layer-overlap load's per-layer issue budget is about 10 us; ``TorchSync``
does the same through torch and is always available.

The GIL: a plain ``ctypes.CDLL`` call releases the GIL and takes it back afterwards. When another
Python thread is busy (vLLM's engine loop polls with an empty step while asynchronous loads run),
taking it back waits for that thread to yield, up to the interpreter's switch interval: measured on
the CPU machine, 600 calls took 0.3 ms alone and 123 ms beside one busy thread. A load issues a
few hundred such calls, so the calls that return at once (queueing a copy, an event, a graph launch,
a query) go through a ``ctypes.PyDLL`` handle of the same library, which keeps the GIL; only the
calls that block (``synchronize``) release it. Both expose one interface (event, record,
wait, query, synchronize); only ``RawSync`` has the raw copies (``raw`` says which one runs).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from maru import gil_calls
from maru.cudart import find_cudart
from maru.env_flags import flag


def current_stream_handle(device: torch.device) -> int:
    """The raw ``cudaStream_t`` of the caller's current stream on ``device``: what
    ``torch.cuda.current_stream(device).cuda_stream`` gives, without building a Stream object
    (about a microsecond against 5-20 on the H200 host; Triton's launcher reads it the same way)."""
    fast = _RAW_CURRENT
    if fast is not None:
        return int(fast(device.index if device.index is not None else torch.cuda.current_device()))
    return int(torch.cuda.current_stream(device).cuda_stream)


def current_raw_stream() -> int:
    """``current_stream_handle`` of the caller's current device (``torch.cuda.current_stream()``
    with no device looks it up through torch's Python: 20-30 us on the H200 host, paid by every
    layer of a layer-overlap load's forward in ``LayerLoad.wait_for_layer``)."""
    fast, dev = _RAW_CURRENT, _CURRENT_DEVICE
    if fast is not None and dev is not None:
        return int(fast(dev()))
    return int(torch.cuda.current_stream().cuda_stream)


_RAW_CURRENT = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


class TorchSync:
    """Events and copies through torch (always available)."""

    raw = False

    def event(self, blocking: bool = False) -> Any:
        """A new event; ``blocking``: a host thread that synchronizes on it sleeps until it completes
        instead of spinning (for waits off the forward thread: the write-behind drain)."""
        return torch.cuda.Event(blocking=blocking)

    def record(self, event: Any, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()


H2D = 1  # cudaMemcpyHostToDevice
D2H = 2  # cudaMemcpyDeviceToHost
D2D = 3  # cudaMemcpyDeviceToDevice
_EVENT_BLOCKING_SYNC = 1  # cudaEventBlockingSync: cudaEventSynchronize sleeps instead of spinning
_EVENT_DISABLE_TIMING = 2
_EVENT_RECORD_EXTERNAL = 1  # cudaEventRecordExternal
_NOT_READY = 600  # cudaErrorNotReady


RELEASE_GIL_ENV = "MARU_RAW_CALLS_RELEASE_GIL"


def gil_note() -> str | None:
    """Why the raw calls give the GIL up (``MARU_RAW_CALLS_RELEASE_GIL=1``, a bench's A/B left set):
    the slow path ``maru doctor`` shows; None when they keep it (the default)."""
    if not flag(RELEASE_GIL_ENV):
        return None
    return (
        f"{RELEASE_GIL_ENV} is set: Maru's CUDA calls give the GIL up and win it back one by one (each "
        "may wait for another Python thread; a load issued beside a busy thread measured slower that "
        "way, bench/gil_contention.py). An A/B of where a step's time goes, not a setting. Fix: unset "
        f"{RELEASE_GIL_ENV}"
    )


# RawSync's calls through ``quick`` (they keep the GIL): what the census times.
_QUICK_CALLS = (
    "_memcpy", "_memcpy2d", "_memset", "_record", "_record_flags", "_wait", "_query", "_launch",
    "_devptr", "_last_error",
)  # fmt: skip


class RawSync(TorchSync):
    """The same operations straight through the process's libcudart (ctypes: ~1 us a call, against
    3-6 us through torch). Events are raw ``cudaEvent_t`` handles owned by the engine."""

    raw = True

    def __init__(self, lib: ctypes.CDLL, quick: ctypes.CDLL | None = None) -> None:
        """``lib`` releases the GIL around a call (``CDLL``); ``quick`` (default: ``lib``) is the
        handle for calls that return at once: a ``PyDLL`` of the same library keeps the GIL."""
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._lib = lib
        q = quick or lib
        self._memcpy = self._fn(q, "cudaMemcpyAsync", [vp, vp, sz, i, vp])
        self._memcpy2d = self._fn(q, "cudaMemcpy2DAsync", [vp, sz, vp, sz, sz, sz, i, vp])
        self._memset = self._fn(q, "cudaMemsetAsync", [vp, i, sz, vp])
        self._record = self._fn(q, "cudaEventRecord", [vp, vp])
        self._record_flags = self._fn(q, "cudaEventRecordWithFlags", [vp, vp, ctypes.c_uint])
        self._wait = self._fn(q, "cudaStreamWaitEvent", [vp, vp, ctypes.c_uint])
        self._query = self._fn(q, "cudaEventQuery", [vp])
        self._launch = self._fn(q, "cudaGraphLaunch", [vp, vp])
        self._sync = self._fn(lib, "cudaEventSynchronize", [vp])  # blocks: lets other threads run
        self._create = self._fn(lib, "cudaEventCreateWithFlags", [ctypes.POINTER(vp), ctypes.c_uint])
        self._devptr = self._fn(q, "cudaHostGetDevicePointer", [ctypes.POINTER(vp), vp, ctypes.c_uint])
        self._last_error = self._fn(q, "cudaGetLastError", [])
        self.timed = quick is not None and gil_calls.enabled()
        if self.timed:  # the thread census: how long each call held the GIL (``maru.gil_calls``)
            for attr in _QUICK_CALLS:
                setattr(self, attr, gil_calls.timed(getattr(self, attr)))

    @staticmethod
    def _fn(lib: ctypes.CDLL, name: str, argtypes: list[Any]) -> Any:
        f = getattr(lib, name)
        f.argtypes = argtypes
        f.restype = ctypes.c_int
        return f

    @classmethod
    def load(cls, *, keep_gil: bool | None = None) -> RawSync | None:
        """The libcudart torch already loaded (the same runtime and context), or None.

        ``keep_gil=False`` releases the GIL on every call (the benchmarks' comparison); None: keep
        it unless ``MARU_RAW_CALLS_RELEASE_GIL=1`` (an A/B of a whole engine, ``gil_note``)."""
        if keep_gil is None:
            keep_gil = gil_note() is None
        try:
            path = find_cudart()
            return cls(ctypes.CDLL(path), ctypes.PyDLL(path) if keep_gil else None)
        except (OSError, AttributeError):
            return None

    @staticmethod
    def _check(err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"{what} failed: cudaError {err}")

    def event(self, blocking: bool = False) -> int:
        """A new raw event (no timing). ``blocking`` (``cudaEventBlockingSync``): ``synchronize``
        sleeps in the driver until the event completes; without it the wait spins a core, which a
        waiter on the forward thread wants (lower wake-up latency) and a background thread does not
        (its CPU time would be the spin's, not its work's)."""
        handle = ctypes.c_void_p()
        flags = _EVENT_DISABLE_TIMING | (_EVENT_BLOCKING_SYNC if blocking else 0)
        self._check(self._create(ctypes.byref(handle), flags), "cudaEventCreateWithFlags")
        return int(handle.value or 0)

    def record(self, event: int, stream: torch.cuda.Stream) -> None:
        self._check(self._record(event, stream.cuda_stream), "cudaEventRecord")

    def wait(self, stream: torch.cuda.Stream, event: int) -> None:
        self._check(self._wait(stream.cuda_stream, event, 0), "cudaStreamWaitEvent")

    def record_on(self, event: int, stream: int) -> None:
        """``record`` on a raw stream handle (``torch.cuda.Stream.cuda_stream``)."""
        self._check(self._record(event, stream), "cudaEventRecord")

    def wait_on(self, stream: int, event: int) -> None:
        """``wait`` on a raw stream handle."""
        self._check(self._wait(stream, event, 0), "cudaStreamWaitEvent")

    def record_external(self, event: int, stream: int) -> None:
        """Record ``event`` on raw ``stream``; inside a stream capture this becomes an event-record
        node of the graph (``cudaEventRecordExternal``): each replay records the event where the
        node runs, and waits queued after the replay's launch wait for it."""
        self._check(self._record_flags(event, stream, _EVENT_RECORD_EXTERNAL), "cudaEventRecordWithFlags")

    def query(self, event: int) -> bool:
        err = self._query(event)
        if err == _NOT_READY:
            return False
        self._check(err, "cudaEventQuery")
        return True

    def synchronize(self, event: int) -> None:
        self._check(self._sync(event), "cudaEventSynchronize")

    def launch_graph(self, graph_exec: int, stream: int) -> None:
        """Queue an instantiated CUDA graph (``cudaGraphExec_t``) on ``stream``; returns at once."""
        self._check(self._launch(graph_exec, stream), "cudaGraphLaunch")

    def clear_error(self) -> None:
        """Reset the runtime's last error (after a refused call whose failure was handled)."""
        self._last_error()

    def device_pointer(self, host_ptr: int) -> int | None:
        """The device address of registered/pinned host memory, or None if CUDA cannot map it."""
        out = ctypes.c_void_p()
        if self._devptr(ctypes.byref(out), host_ptr, 0):
            self._last_error()  # clear it: torch's next launch check would otherwise report it
            return None
        return int(out.value or 0)

    def copy(self, dst: int, src: int, nbytes: int, stream: int, kind: int = H2D) -> None:
        self._check(
            self._memcpy(dst, src, nbytes, kind, stream), f"cudaMemcpyAsync({nbytes} bytes, kind {kind})"
        )

    def zero(self, dst: int, nbytes: int, stream: int) -> None:
        """Queue ``nbytes`` zero bytes at device address ``dst`` on raw ``stream`` (a memset: no
        kernel launch through torch, ~1 us of host time against ~30 for ``torch.zeros``)."""
        self._check(self._memset(dst, 0, nbytes, stream), f"cudaMemsetAsync({nbytes} bytes)")

    def copy2d(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int
    ) -> None:
        err = self._memcpy2d(dst, dpitch, src, spitch, width, height, H2D, stream)
        self._check(err, f"cudaMemcpy2DAsync({height} x {width} bytes)")


# cudaMemcpyAttributes: srcAccessOrder, srcLocHint {type, id}, dstLocHint {type, id}, flags.
_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: the source is read in stream order
_LOC_DEVICE, _LOC_HOST = 1, 2  # cudaMemLocationTypeDevice, cudaMemLocationTypeHost
_PREFER_OVERLAP = 1  # cudaMemcpyFlagPreferOverlapWithCompute: keep the copy engines, not the SMs


class BatchCopies:
    """Host-to-device copies queued many at a time: ``cudaMemcpyBatchAsync`` (CUDA >= 12.8).

    One call queues a whole list of (destination, source, size) on a stream, where a
    ``cudaMemcpyAsync`` each costs ~3 us of host time; the copies run on the copy engines, asked to
    stay off the SMs (``PreferOverlapWithCompute``). The signature changed in CUDA 13 (no
    ``failIdx``); the runtime's version picks it. ``load`` returns None, with the reason in
    ``why_not``, where the runtime lacks it; a caller checks one real batch (``probe``) before it
    trusts the binding.
    """

    why_not: str | None = None

    def __init__(self, lib: ctypes.CDLL, version: int, device: int) -> None:
        self.version = version
        self._fn = lib.cudaMemcpyBatchAsync
        self._fn.restype = ctypes.c_int
        if gil_calls.enabled():  # keeps the GIL: timed with the thread census (``maru.gil_calls``)
            self._fn = gil_calls.timed(self._fn)
        self._attrs = (ctypes.c_int * 6)(_ORDER_STREAM, _LOC_HOST, 0, _LOC_DEVICE, device, _PREFER_OVERLAP)
        self._idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)
        self._old = version < 13000  # 12.8 and 12.9 take a failIdx before the stream
        self._last_error = lib.cudaGetLastError

    @classmethod
    def load(cls, device: int) -> BatchCopies | None:
        try:
            lib = ctypes.PyDLL(find_cudart())  # returns at once: keeps the GIL (module docstring)
            v = ctypes.c_int()
            if lib.cudaRuntimeGetVersion(ctypes.byref(v)):
                raise OSError("cudaRuntimeGetVersion failed")
            if v.value < 12080:
                cls.why_not = (
                    f"the CUDA runtime is {v.value // 1000}.{v.value % 1000 // 10}; batched copies need 12.8"
                )
                return None
            return cls(lib, v.value, device)
        except (OSError, AttributeError) as e:
            cls.why_not = f"no cudaMemcpyBatchAsync in the CUDA runtime ({e})"
            return None

    def copy(self, dsts: Any, srcs: Any, sizes: Any, count: int, stream: int) -> None:
        """Queue ``count`` host-to-device copies on raw ``stream``: ``dsts``/``srcs``/``sizes`` are
        addresses of ``count`` uint64 each (numpy ``.ctypes.data``), read during the call only."""
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        args: list[Any] = [vp(dsts), vp(srcs), vp(sizes), sz(count)]
        args += [vp(ctypes.addressof(self._attrs)), vp(ctypes.addressof(self._idx)), sz(1)]
        if self._old:
            args.append(ctypes.byref(self._fail))
        err = self._fn(*args, vp(stream))
        if err:
            self._last_error()  # clear it: torch's next launch check would otherwise report it
            raise RuntimeError(f"cudaMemcpyBatchAsync of {count} copies failed: cudaError {err}")

    def probe(self, device: torch.device) -> str | None:
        """Move a known pattern through one batch (two copies, one of them offset) and compare:
        None if the bytes arrived, else what went wrong. Synchronises the device once."""
        import numpy as np

        src = torch.arange(4096, dtype=torch.int32).pin_memory()
        dst = torch.zeros(4096, dtype=torch.int32, device=device)
        half = 2048 * 4
        dsts = np.array([dst.data_ptr(), dst.data_ptr() + half], dtype=np.uint64)
        srcs = np.array([src.data_ptr(), src.data_ptr() + half], dtype=np.uint64)
        sizes = np.array([half, half], dtype=np.uint64)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # after the zeros land (a busy stream)
        try:
            self.copy(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, 2, stream.cuda_stream)
            stream.synchronize()
        except RuntimeError as e:
            return str(e)
        if not torch.equal(dst.cpu(), src):
            return "a probe batch delivered the wrong bytes"
        return None
