"""The client's own mapping of the pool.

Every object's bytes live in the pool; a client reads and writes them through one shared,
writable mmap of the whole pool (file under /dev/shm or a DAX device). Offsets the server
hands out are absolute offsets into that mapping, so a slice of it *is* the object: no copy.

Invariant: a ``PoolMapping`` exists only for a pool whose header carries the UUID the server
announced, so a client can never read or write a different pool that happens to sit at the
same path (a re-created file, another host's device).

Fencing. ``fence(ranges)`` replaces those pages of the mapping, in place, by private anonymous
memory (``mmap(MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS)``): every view into them, held by any
thread, keeps working but no longer reaches the pool (a write lands in private pages, a read
sees zeros). A fenced range stays private until ``read_views`` or ``unfence`` is asked for an
object that overlaps it (the server granted that space again): then the pool is mapped back
over exactly the fenced range. Ranges are rounded out to whole pages, so fencing is exact when
the pool's alignment is at least the page size (the default 4 KiB for a file, the device
alignment for DAX). It acts on the CPU mapping only: a GPU that reaches the pool through a
CUDA registration of this mapping still reaches the pool pages.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import stat
import sys
import weakref

from maru.errors import PoolError
from maru.pool.header import HEADER_BYTES, PoolHeader

log = logging.getLogger("maru.client")

PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10  # Linux; not exported by the mmap module
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]


def _remap(address: int, length: int, flags: int, fd: int, offset: int) -> None:
    """mmap(MAP_FIXED) over ``[address, address + length)`` of this process; raises PoolError."""
    got = _libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags | _MAP_FIXED, fd, offset)
    if got is None or got == _MAP_FAILED or got != address:
        err = ctypes.get_errno()
        raise PoolError(f"cannot remap {length} bytes at {address:#x}: {os.strerror(err)}")


def _end_cuda_registration(path: str, address: int, size: int) -> None:
    """End a CUDA registration of ``[address, address + size)`` made in this process, if any."""
    cuda_host = sys.modules.get("maru.client.cuda_host")
    if cuda_host is None:
        return  # nothing in this process registered anything
    try:
        cuda_host.default_registry().unregister(address, size)
    except Exception as e:  # never keep a mapping open over this; say what may follow
        log.warning(
            "pool %s: ending its CUDA registration failed (%s: %s); a pool mapped later at the same "
            "address may have its GPU copies go to the old pages",
            path,
            type(e).__name__,
            e,
        )


class PoolMapping:
    """A shared read/write mapping of one pool, checked against the server's pool UUID."""

    def __init__(self, path: str, expected_uuid: str, pool_size: int, data_offset: int) -> None:
        self.path = path
        self.uuid = expected_uuid
        self.size = pool_size
        self.data_offset = data_offset
        self._mmap = self._map(path, pool_size)
        try:
            self._check_header(expected_uuid)
        except BaseException:
            self._mmap.close()
            raise
        self._view: memoryview | None = memoryview(self._mmap)
        self._ro_view: memoryview | None = self._view.toreadonly()
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self._fenced: list[tuple[int, int]] = []  # sorted [start, end) page ranges, private now
        self._tensors: dict[object, object] = {}  # dtype -> the whole mapping as a tensor (read_tensor)
        # Runs once: at close(), or when a mapping nobody closed is collected (before its unmap).
        self._end_registration = weakref.finalize(
            self, _end_cuda_registration, self.path, self._base, pool_size
        )

    @staticmethod
    def _map(path: str, pool_size: int) -> mmap.mmap:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PoolError(
                f"pool {path} does not exist on this host; if the device has another path here, "
                "pass MaruHandler(..., pool_path='/dev/daxX.Y')"
            ) from None
        except PermissionError:
            raise PoolError(
                f"no permission to open pool {path} read-write as uid {os.getuid()}; "
                "run as the server's user or give this user rw access to the pool file/device"
            ) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_size < pool_size:
                raise PoolError(
                    f"pool file {path} holds {st.st_size} bytes but the server says the pool has "
                    f"{pool_size}; it is not the server's pool (was it re-created?)"
                )
            try:
                return mmap.mmap(fd, pool_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as e:
                raise PoolError(f"cannot map pool {path} ({pool_size} bytes) read-write: {e}") from None
        finally:
            os.close(fd)

    def _check_header(self, expected_uuid: str) -> None:
        header = PoolHeader.unpack(bytes(self._mmap[:HEADER_BYTES]), self.path)
        if header is None:
            raise PoolError(
                f"{self.path} carries no Maru pool header; it is not the pool the server serves "
                "(pass the right pool_path=..., or check `maru doctor`)"
            )
        if header.uuid != expected_uuid:
            raise PoolError(
                f"pool {self.path} has UUID {header.uuid} but the server serves pool {expected_uuid}: "
                "this path names another pool here; pass MaruHandler(..., pool_path=<this host's "
                "path to the server's pool>)"
            )

    @property
    def mmap(self) -> mmap.mmap:
        """The raw mapping (for example to register the whole pool with CUDA)."""
        return self._mmap

    @property
    def address(self) -> int:
        """Virtual address of the mapping's first byte in this process."""
        # from_buffer exports the buffer only while the ctypes object lives: it dies right here.
        return ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))

    def view(self, offset: int, size: int) -> memoryview:
        """A zero-copy slice ``[offset, offset + size)`` of the pool; refuses anything outside the data region."""
        if self._view is None:
            raise PoolError(f"mapping of pool {self.path} is closed")
        if offset < self.data_offset or size < 0 or offset + size > self.size:
            raise PoolError(
                f"server placed an object at [{offset}, {offset + size}) outside the data region "
                f"[{self.data_offset}, {self.size}) of pool {self.path}; client and server disagree on the pool"
            )
        if self._fenced:
            self.unfence(offset, size)
        return self._view[offset : offset + size]

    def read_views(self, entries: list[list[int] | None]) -> list[memoryview | None]:
        """Read-only slices for ``[offset, size]`` entries (None stays None); the fast path of lookups."""
        ro = self._ro_view
        if ro is None:
            raise PoolError(f"mapping of pool {self.path} is closed")
        lo, hi = self.data_offset, self.size
        fenced = self._fenced
        out: list[memoryview | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            offset, size = e
            if (
                type(offset) is not int
                or type(size) is not int
                or offset < lo
                or size < 0
                or offset + size > hi
            ):
                raise PoolError(
                    f"server placed an object at {e!r}, outside the data region [{lo}, {hi}) of pool "
                    f"{self.path}; client and server disagree on the pool"
                )
            if fenced:
                self.unfence(offset, size)
            out.append(ro[offset : offset + size])
        return out

    def read_tensor(self, dtype: object) -> object:
        """The whole mapping as one 1-D torch tensor of ``dtype`` (made once a dtype), for objects
        made by offset (``kv_ops.pool_objects.PoolObjects``: one ``as_strided`` an object, ~1.5 us,
        where a page's ``read_views`` slice and ``torch.frombuffer`` cost ~3 us on the CI machine).
        Read only, by contract (loads only read); it checks nothing: its callers use offsets that
        ``read_views`` bounds-checked and unfenced. Over a slice of the read-only view, so that
        ``close`` can still release that view while the tensor lives (it then unmaps when the
        last tensor over the pool goes, as with every view)."""
        import warnings

        import torch

        hit = self._tensors.get(dtype)
        if hit is None:
            ro = self._ro_view
            if ro is None:
                raise PoolError(f"mapping of pool {self.path} is closed")
            with warnings.catch_warnings():
                # torch warns that writing through a tensor over a read-only buffer is undefined.
                warnings.simplefilter("ignore", UserWarning)
                size = torch.empty((), dtype=dtype).element_size()  # type: ignore[arg-type]
                hit = torch.frombuffer(ro[: self.size // size * size], dtype=dtype)  # type: ignore[arg-type]
            self._tensors[dtype] = hit
        return hit

    # -- fencing (see the module docstring) ------------------------------------------------------

    @property
    def fenced_ranges(self) -> list[tuple[int, int]]:
        """Page ranges ``[start, end)`` (pool offsets) that are private memory now."""
        return list(self._fenced)

    def fence(self, ranges: list[tuple[int, int]]) -> int:
        """Make ``(offset, size)`` ranges private memory (their views stop reaching the pool).
        Returns the bytes fenced. Raises PoolError if the kernel refuses (the caller must then
        not tell the server it fenced)."""
        if self._view is None:
            return 0
        total = 0
        for offset, size in ranges:
            start = offset - offset % PAGE
            end = min(-(-(offset + max(size, 1)) // PAGE) * PAGE, self.size)
            if start < self.data_offset or self._is_fenced(start, end):
                continue
            _remap(
                self._base + start, end - start, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0
            )
            bisect.insort(self._fenced, (start, end))
            total += end - start
        return total

    def unfence(self, offset: int, size: int) -> None:
        """Map the pool back over every fenced range that overlaps ``[offset, offset + size)``."""
        end = offset + max(size, 1)
        hits = [r for r in self._fenced if r[0] < end and offset < r[1]]
        if not hits:
            return
        fd = os.open(self.path, os.O_RDWR)
        try:
            for start, stop in hits:
                _remap(self._base + start, stop - start, mmap.MAP_SHARED, fd, start)
                self._fenced.remove((start, stop))
        finally:
            os.close(fd)

    def _is_fenced(self, start: int, end: int) -> bool:
        return any(s <= start and end <= e for s, e in self._fenced)

    def close(self) -> None:
        """Unregister from CUDA, then unmap, unless views are still alive (then the OS unmaps when
        the last one goes).

        The CUDA registration must end before the unmap: the driver keeps the old pages pinned and
        its DMA keeps using them, so a later mapping at the same address (the next pool this process
        maps) would read and write stale pages behind every copy while the CPU sees its own, and a
        checksum taken on the CPU would vouch for bytes the GPU never wrote."""
        self._end_registration()
        self._tensors = {}  # our own tensors over the pool: not a caller's live view
        for v in (self._ro_view, self._view):
            if v is not None:
                v.release()
        self._view = self._ro_view = None
        try:
            self._mmap.close()
        except BufferError:
            # A caller still holds a view into the pool; unmapping now would make it fault.
            log.debug("pool %s still has live views; it is unmapped when they are released", self.path)
