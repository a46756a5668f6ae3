"""Registering a host mapping of the pool with CUDA, so pool <-> GPU copies are DMA at pinned speed.

A pool is an ``mmap`` of a ``/dev/shm`` file or a DAX device. To CUDA that is *pageable* memory:
a copy from it goes through a driver bounce buffer (measured on an H200: 4.9 GB/s host->GPU,
against 55 GB/s once the same mapping is registered with ``cudaHostRegister``). Registration pins
the pages, which takes time (8 GiB took 4.4 s; 2 GiB of untouched shared memory 1.0 s, of already
touched pages 0.1 s), so it is done once per mapping, with progress, and reported.

Invariants:

* A mapping (address, size) is registered at most once per process; ``register_host_mapping`` is
  idempotent and returns the same ``HostRegistration`` record for the same range.
* Every outcome is recorded and visible through ``registrations()`` (for ``maru doctor``):
  registered bytes and seconds, or the reason it is not registered.
* A failed registration is announced once per mapping, as a warning naming the reason, the
  consequence (pageable copies, about 11x slower) and the fix. No CUDA at all is the normal CPU
  path and is logged at info level.
* Registration is never partial: if one slice fails, the slices already registered are
  unregistered again, so a copy never silently straddles pinned and pageable pages.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from maru.announce import first_time
from maru.cudart import find_cudart

log = logging.getLogger("maru.client")

GiB = 1 << 30

# cudaHostRegister flags (cuda_runtime_api.h).
CUDA_HOST_REGISTER_DEFAULT = 0
CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_READ_ONLY = 8
_ERR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_ERR_NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered

# Set MARU_CUDA_REGISTER=0 to leave pools pageable on purpose (announced, like any slower path).
ENV_DISABLE = "MARU_CUDA_REGISTER"

# Measured on an H200 (shared/design/ANCHORS.md): what an unregistered pool costs.
PAGEABLE_GBPS = 4.9
PINNED_GBPS = 55.2

State = Literal["registered", "failed", "disabled", "unavailable", "unregistered"]
ProgressFn = Callable[[int, int, float], None]  # (bytes registered so far, total bytes, seconds)


@dataclass
class HostRegistration:
    """The outcome of registering one host range ``[address, address + size)`` with CUDA.

    ``state``: ``registered`` (copies are DMA), ``failed`` (CUDA refused; see ``reason``),
    ``disabled`` (``MARU_CUDA_REGISTER=0``), ``unavailable`` (no CUDA in this process: CPU path),
    ``unregistered`` (was registered, then released).
    """

    name: str
    address: int
    size: int
    state: State
    registered_bytes: int = 0
    seconds: float = 0.0
    slices: int = 0
    reason: str | None = None
    owned: bool = True  # False when someone else in this process had registered the range first
    _slices: list[tuple[int, int]] = field(default_factory=list, repr=False)

    @property
    def registered(self) -> bool:
        return self.state == "registered"

    def describe(self) -> str:
        """One line for logs and ``maru doctor``."""
        size = f"{self.size / GiB:.2f} GiB"
        if self.state == "registered":
            rate = self.registered_bytes / self.seconds / GiB if self.seconds > 0 else float("inf")
            who = "" if self.owned else " (already registered by another component)"
            return (
                f"{self.name}: {size} registered with CUDA in {self.seconds:.2f} s ({rate:.1f} GiB/s, "
                f"{self.slices} slice(s)){who}: pool<->GPU copies are DMA"
            )
        return f"{self.name}: {size} NOT registered with CUDA ({self.state}): {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        """Plain record for ``maru doctor`` / stats."""
        return {
            "name": self.name,
            "address": self.address,
            "size": self.size,
            "state": self.state,
            "registered_bytes": self.registered_bytes,
            "seconds": round(self.seconds, 3),
            "slices": self.slices,
            "reason": self.reason,
        }


class _CudaRuntime:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's bundled cudart bindings."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._rt = torch.cuda.cudart()

    def register(self, address: int, size: int, flags: int) -> int:
        return self._code(self._rt.cudaHostRegister(address, size, flags))

    def unregister(self, address: int) -> int:
        return self._code(self._rt.cudaHostUnregister(address))

    def error_name(self, code: int) -> str:
        try:
            # torch exposes cudaGetErrorString only through the raw library; a code is enough.
            lib = ctypes.CDLL(find_cudart())
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            return f"{lib.cudaGetErrorString(code).decode()} (cudaError {code})"
        except Exception:  # noqa: BLE001 - naming the error is best effort, the code is kept
            return f"cudaError {code}"

    @staticmethod
    def _code(result: Any) -> int:
        # torch returns a cudaError enum member (int-like); older versions a plain int.
        return int(getattr(result, "value", result))


def _cuda_unavailable_reason() -> str | None:
    """Why this process cannot register with CUDA, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU build"
        return "no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)"
    return None


class CudaHostRegistry:
    """All host ranges this process registered with CUDA, keyed by (address, size).

    Thread-safe; one instance per process (``default_registry()``). Unregisters everything it owns
    at ``close()`` (called at interpreter exit by the owner of the mapping, before ``munmap``).
    """

    def __init__(self, runtime_factory: Callable[[], Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[int, int], HostRegistration] = {}
        self._runtime_factory = runtime_factory or _CudaRuntime
        self._runtime: Any = None

    def _rt(self) -> Any:
        if self._runtime is None:
            self._runtime = self._runtime_factory()
        return self._runtime

    def register(
        self,
        address: int,
        size: int,
        *,
        name: str = "pool",
        slice_bytes: int | None = None,
        flags: int = CUDA_HOST_REGISTER_DEFAULT,
        progress: ProgressFn | None = None,
        progress_interval_s: float = 1.0,
    ) -> HostRegistration:
        """Register ``[address, address + size)`` once; return its record (existing one if any).

        ``slice_bytes=None`` (the default) registers the range in one call and reports progress from
        a ticker while the call runs. ``slice_bytes=n`` registers n-byte slices and reports progress
        between them, but a copy that spans
        two separately registered slices *fails* (cudaErrorInvalidValue): use slices only where no
        object can cross a slice boundary (slices aligned to the server's region size).
        ``progress(done, total, seconds)`` defaults to an info log.
        """
        if size <= 0:
            raise ValueError(f"cannot register {size} bytes at {address:#x}: size must be positive")
        key = (address, size)
        with self._lock:
            record = self._records.get(key)
            if record is not None and record.state in ("registered", "disabled", "unavailable"):
                return record
            record = self._register_locked(
                address, size, name, slice_bytes, flags, progress, progress_interval_s
            )
            self._records[key] = record
        self._announce(record)
        return record

    def _register_locked(
        self,
        address: int,
        size: int,
        name: str,
        slice_bytes: int | None,
        flags: int,
        progress: ProgressFn | None,
        progress_interval_s: float,
    ) -> HostRegistration:
        if os.environ.get(ENV_DISABLE, "1").strip().lower() in ("0", "false", "no", "off"):
            return HostRegistration(
                name, address, size, "disabled", reason=f"{ENV_DISABLE}=0 in the environment"
            )
        why = _cuda_unavailable_reason() if self._runtime_factory is _CudaRuntime else None
        if why is not None:
            return HostRegistration(name, address, size, "unavailable", reason=why)
        rt = self._rt()
        report = progress or _log_progress(name)
        step = size if not slice_bytes else max(int(slice_bytes) // 4096 * 4096, 4096)
        record = HostRegistration(name, address, size, "registered")
        start = time.perf_counter()
        done = 0
        while done < size:
            n = min(step, size - done)
            code = self._timed_call(
                rt, address + done, n, flags, report, done, size, start, progress_interval_s
            )
            if code == _ERR_ALREADY_REGISTERED and done == 0 and n == size:
                # Someone else in this process (another handler, the engine) pinned it: DMA works,
                # but we must not unregister what we do not own.
                record.owned = False
            elif code != 0:
                self._rollback(rt, record)
                record.state = "failed"
                record.registered_bytes = 0
                record.seconds = time.perf_counter() - start
                record.reason = (
                    f"cudaHostRegister({address + done:#x}, {n} bytes, flags={flags}) returned "
                    f"{rt.error_name(code)} after {done} of {size} bytes"
                )
                return record
            else:
                record._slices.append((address + done, n))
            done += n
            record.registered_bytes = done
            record.slices += 1
            if slice_bytes:
                report(done, size, time.perf_counter() - start)
        record.seconds = time.perf_counter() - start
        return record

    @staticmethod
    def _timed_call(
        rt: Any,
        address: int,
        n: int,
        flags: int,
        report: ProgressFn,
        done: int,
        total: int,
        start: float,
        interval: float,
    ) -> int:
        """One cudaHostRegister call; a ticker reports elapsed time while a long call runs."""
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(interval):
                report(done, total, time.perf_counter() - start)

        ticker = threading.Thread(target=tick, name="maru-cuda-register-progress", daemon=True)
        ticker.start()
        try:
            return rt.register(address, n, flags)
        finally:
            stop.set()
            ticker.join()

    @staticmethod
    def _rollback(rt: Any, record: HostRegistration) -> None:
        for addr, _n in record._slices:
            rt.unregister(addr)
        record._slices.clear()

    def _announce(self, record: HostRegistration) -> None:
        # Once per registry and range (a test's private registry announces on its own).
        key = f"cuda_host:{id(self)}:{record.address:#x}:{record.size}"
        if not first_time(key):
            return
        if record.state == "registered":
            log.info("%s", record.describe())
        elif record.state == "unavailable":
            log.info(
                "%s: not registered with CUDA (%s): CPU placement, nothing to pin", record.name, record.reason
            )
        else:
            log.warning(
                "%s. Consequence: pool<->GPU copies are pageable, about %.0fx slower (%.1f vs %.1f GB/s "
                "measured on an H200). Fix: %s",
                record.describe(),
                PINNED_GBPS / PAGEABLE_GBPS,
                PAGEABLE_GBPS,
                PINNED_GBPS,
                fix_for(record),
            )

    def unregister(self, address: int, size: int) -> HostRegistration | None:
        """Unpin a range registered here (before its ``munmap``). Idempotent; returns the record."""
        with self._lock:
            record = self._records.get((address, size))
            if record is None or record.state != "registered":
                return record
            if record.owned:
                rt = self._rt()
                for addr, _n in record._slices:
                    code = rt.unregister(addr)
                    if code not in (0, _ERR_NOT_REGISTERED):
                        log.warning(
                            "cudaHostUnregister(%#x) for %s: %s", addr, record.name, rt.error_name(code)
                        )
                record._slices.clear()
            record.state = "unregistered"
            record.reason = "unregistered by its owner"
            return record

    def lookup(self, address: int, size: int = 1) -> HostRegistration | None:
        """The registered record whose range contains ``[address, address + size)``, if any."""
        with self._lock:
            for (base, n), record in self._records.items():
                if record.state == "registered" and base <= address and address + size <= base + n:
                    return record
        return None

    def registrations(self) -> list[HostRegistration]:
        """Every range this process tried to register, in order (for ``maru doctor``)."""
        with self._lock:
            return list(self._records.values())

    def close(self) -> None:
        """Unregister every range this registry owns."""
        for record in self.registrations():
            self.unregister(record.address, record.size)


def fix_for(record: HostRegistration) -> str:
    """The advice for a registration that did not happen (logs, ``maru doctor``)."""
    if record.state == "disabled":
        return f"unset {ENV_DISABLE} (or set it to 1)"
    return (
        "make sure the process may pin that much memory (a locked-memory limit, `ulimit -l`, "
        "or a container memory limit below the pool size), that the pool is ordinary RAM or a DAX "
        "device the NVIDIA driver can pin, and that enough host memory is free; see docs/gpu.md"
    )


def _log_progress(name: str) -> ProgressFn:
    def report(done: int, total: int, seconds: float) -> None:
        log.info("registering %s with CUDA: %.2f of %.2f GiB, %.1f s", name, done / GiB, total / GiB, seconds)

    return report


_DEFAULT: CudaHostRegistry | None = None
_DEFAULT_LOCK = threading.Lock()


def default_registry() -> CudaHostRegistry:
    """The process-wide registry (one per process, so a range is never registered twice)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = CudaHostRegistry()
        return _DEFAULT


def buffer_address(buffer: Any) -> tuple[int, int]:
    """(address, size in bytes) of a writable buffer (an ``mmap``, a writable memoryview)."""
    view = memoryview(buffer)
    try:
        if view.readonly:
            # ctypes needs a writable buffer to hand out its address; the pool mapping is writable.
            raise ValueError("cannot take the address of a read-only buffer; pass the pool's mmap")
        size = view.nbytes
        holder = (ctypes.c_char * size).from_buffer(view)
        address = ctypes.addressof(holder)
        del holder  # drop the export at once, so the mapping can still be closed later
        return address, size
    finally:
        view.release()


def _is_pool_mapping(obj: Any) -> bool:
    # A PoolMapping has an ``address`` and an integer ``size``; an mmap has a ``size()`` method.
    return hasattr(obj, "address") and isinstance(getattr(obj, "size", None), int)


def register_host_mapping(
    mapping: Any,
    *,
    name: str | None = None,
    slice_bytes: int | None = None,
    progress: ProgressFn | None = None,
    registry: CudaHostRegistry | None = None,
) -> HostRegistration:
    """Register a pool mapping with CUDA, once. Accepts a ``PoolMapping`` (``.address``/``.size``/
    ``.path``), an ``mmap`` or any writable buffer. Never raises for a CUDA refusal: the record
    says why, and the failure was announced (warning with reason, consequence and fix)."""
    if _is_pool_mapping(mapping):
        address, size = int(mapping.address), int(mapping.size)
        label = name or f"pool {getattr(mapping, 'path', hex(address))}"
    else:
        address, size = buffer_address(mapping)
        label = name or f"host buffer at {address:#x}"
    return (registry or default_registry()).register(
        address, size, name=label, slice_bytes=slice_bytes, progress=progress
    )


def unregister_host_mapping(mapping: Any, *, registry: CudaHostRegistry | None = None) -> None:
    """Undo ``register_host_mapping`` (call before unmapping). Safe if it was never registered."""
    if _is_pool_mapping(mapping):
        address, size = int(mapping.address), int(mapping.size)
    else:
        address, size = buffer_address(mapping)
    (registry or default_registry()).unregister(address, size)


def registrations() -> list[dict[str, Any]]:
    """Records of every registration attempt in this process (for ``maru doctor``)."""
    return [r.as_dict() for r in default_registry().registrations()]


def probe_registration(
    path: str, size: int | None = None, *, registry: CudaHostRegistry | None = None
) -> HostRegistration:
    """Map the pool at ``path``, register it with CUDA, time it, unregister, unmap (``maru doctor``).

    Returns the record as it was while registered (state ``registered`` with bytes and seconds, or
    why not). Pins the whole pool for a moment: about 0.5 s per GiB of never-touched memory.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        length = size if size is not None else os.fstat(fd).st_size
        mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    reg = registry or CudaHostRegistry()
    try:
        address, n = buffer_address(mm)
        record = reg.register(address, n, name=f"pool {path} (probe)", progress=lambda *a: None)
        snapshot = dataclasses.replace(record, _slices=list(record._slices))
        reg.unregister(address, n)
        return snapshot
    finally:
        mm.close()
