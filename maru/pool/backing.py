"""Backing stores of a pool: a DAX character device or an emulated file under /dev/shm.

``open_pool`` creates or opens one and returns its ``PoolInfo``. The server never maps the
data region (it never touches KV bytes); it only reads and writes the header with pread/pwrite.

Invariants:
- A pool has a valid header at offset 0 once ``open_pool`` returns; an existing header (and so
  the UUID and every byte of data) is kept, never rewritten.
- An emulated pool file is fully reserved (``posix_fallocate``) before the server serves it, so
  a writer can never hit SIGBUS because tmpfs ran out of memory later.
- A pool that cannot fit is refused up front with a message naming the sizes and the fix.
- A pool file is created with the mode and group of a ``FileAccess`` (0600 by default) before a
  byte of it is written; ``remove_created_pool`` deletes it again when the start fails.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from maru.config import DEFAULT_ALIGNMENT, format_size
from maru.errors import PoolError
from maru.pool.header import HEADER_BYTES, PoolHeader
from maru.pool.perms import FileAccess

log = logging.getLogger("maru.pool")

DEFAULT_DAX_ALIGN = 2 << 20
_DAX_NAME = re.compile(r"^dax\d+\.\d+$")


@dataclass(frozen=True)
class PoolInfo:
    """What the server and its clients need to know about an open pool."""

    path: str
    kind: str  # "dax" or "file"
    uuid: str
    pool_size: int
    data_offset: int
    alignment: int
    created: bool  # True: this call initialised the header (a fresh pool)

    @property
    def data_size(self) -> int:
        return self.pool_size - self.data_offset


def is_dax_path(path: str) -> bool:
    """True for a path that names a device-DAX device (``/dev/daxX.Y`` or any path ending so)."""
    return bool(_DAX_NAME.match(os.path.basename(path)))


def _read_sysfs_int(p: Path) -> int:
    text = p.read_text().strip()
    try:
        return int(text, 0)
    except ValueError:
        raise PoolError(f"sysfs file {p} holds {text!r}, not a number") from None


def dax_device_geometry(path: str, sysfs_root: str = "/sys") -> tuple[int, int]:
    """Return ``(size, align)`` of DAX device ``path`` from sysfs.

    Looks in ``<sysfs_root>/bus/dax/devices/<name>/`` then ``<sysfs_root>/class/dax/<name>/``.
    ``align`` defaults to 2 MiB when the kernel does not expose it.
    """
    name = os.path.basename(path)
    candidates = [Path(sysfs_root, "bus", "dax", "devices", name), Path(sysfs_root, "class", "dax", name)]
    for d in candidates:
        if (d / "size").is_file():
            size = _read_sysfs_int(d / "size")
            align = _read_sysfs_int(d / "align") if (d / "align").is_file() else DEFAULT_DAX_ALIGN
            if size <= 0 or align <= 0 or align & (align - 1):
                raise PoolError(f"DAX device {path}: sysfs reports size={size} align={align}; not usable")
            return size, align
    raise PoolError(
        f"{path} looks like a DAX device but sysfs has no size for it (looked in "
        f"{', '.join(str(c) for c in candidates)}); check `daxctl list` or pass --sysfs-root"
    )


def _read_header(fd: int, where: str) -> PoolHeader | None:
    return PoolHeader.unpack(os.pread(fd, HEADER_BYTES, 0), where)


def _write_header(fd: int, header: PoolHeader, sync_len: int) -> None:
    raw = header.pack()
    if os.pwrite(fd, raw, 0) != len(raw):
        raise PoolError("short write of the pool header")
    # A device's header must reach the medium before another host reads it: msync the first
    # page through a shared mapping (fsync is not defined for every DAX character device).
    try:
        m = mmap.mmap(fd, sync_len, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            m.flush()
        finally:
            m.close()
    except (OSError, ValueError):
        os.fsync(fd)


def _check_alignment(alignment: int) -> None:
    if alignment < 64 or alignment & (alignment - 1):
        raise PoolError(f"alignment {alignment} must be a power of two of at least 64 bytes")


def _open_dax(path: str, size: int | None, alignment: int | None, sysfs_root: str) -> PoolInfo:
    dev_size, dev_align = dax_device_geometry(path, sysfs_root)
    if size is not None and size != dev_size:
        raise PoolError(
            f"--pool-size {format_size(size)} does not match DAX device {path} "
            f"({format_size(dev_size)} per sysfs); leave --pool-size out for a device"
        )
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise PoolError(
            f"cannot open DAX device {path} read-write: {e.strerror}; check its permissions"
        ) from None
    try:
        header = _read_header(fd, path)
        created = header is None
        if header is None:
            align = alignment or dev_align
            _check_alignment(align)
            # Data starts one device-alignment unit in, so mappings of the data stay aligned.
            header = PoolHeader.new(dev_size, max(dev_align, align), align)
            _write_header(fd, header, min(dev_align, dev_size))
            log.info("initialised DAX device %s: uuid=%s size=%s", path, header.uuid, format_size(dev_size))
        elif header.pool_size != dev_size:
            raise PoolError(
                f"DAX device {path} header says {format_size(header.pool_size)} but sysfs says "
                f"{format_size(dev_size)}; the device was resized: re-initialise it"
            )
        _check_reopen_alignment(path, header, alignment)
    finally:
        os.close(fd)
    return PoolInfo(path, "dax", header.uuid, header.pool_size, header.data_offset, header.alignment, created)


def _check_reopen_alignment(path: str, header: PoolHeader, alignment: int | None) -> None:
    if alignment is not None and alignment != header.alignment:
        raise PoolError(
            f"pool {path} was initialised with alignment {header.alignment}, --alignment asks {alignment}; "
            "leave --alignment out or use a new pool"
        )


def _reserve(fd: int, path: str, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        raise PoolError(
            f"cannot reserve {format_size(size)} for pool {path}: {e.strerror}; "
            "free memory in its filesystem or lower --pool-size"
        ) from None


def _open_file(path: str, size: int | None, alignment: int | None, access: FileAccess) -> PoolInfo:
    exists = os.path.exists(path)
    if exists:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise PoolError(f"pool path {path} is neither a regular file nor a DAX device (daxX.Y)")
        fd = os.open(path, os.O_RDWR)
        try:
            header = _read_header(fd, path)
            if header is None:
                raise PoolError(
                    f"{path} exists but is not a Maru pool (no MARUPOOL header); "
                    "delete it or choose another --pool-path"
                )
            if header.pool_size != st.st_size:
                raise PoolError(
                    f"pool file {path} is {format_size(st.st_size)} but its header says "
                    f"{format_size(header.pool_size)}; the file was truncated: delete it and start again"
                )
            if size is not None and size != header.pool_size:
                raise PoolError(
                    f"pool file {path} exists with {format_size(header.pool_size)}, --pool-size asks "
                    f"{format_size(size)}; pass the same size, leave --pool-size out, or delete the file"
                )
            _check_reopen_alignment(path, header, alignment)
            # Re-reserve: a no-op for a fully allocated file, and a repair for a sparse one.
            _check_free_space(path, header.pool_size - st.st_blocks * 512)
            _reserve(fd, path, header.pool_size)
        finally:
            os.close(fd)
        return PoolInfo(
            path, "file", header.uuid, header.pool_size, header.data_offset, header.alignment, False
        )

    align = alignment or DEFAULT_ALIGNMENT
    _check_alignment(align)
    if size is None:
        raise PoolError(f"pool file {path} does not exist; give --pool-size to create it")
    if size < 2 * align:
        raise PoolError(f"--pool-size {size} is too small: the pool needs at least {2 * align} bytes")
    if size % align:
        raise PoolError(f"--pool-size {size} is not a multiple of the alignment {align}")
    _check_free_space(path, size)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise PoolError(f"cannot create pool {path}: directory {parent} does not exist")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            access.apply_fd(fd, path)
            _reserve(fd, path, size)
            header = PoolHeader.new(size, align, align)
            _write_header(fd, header, align)
        except BaseException:
            os.unlink(path)
            raise
    finally:
        os.close(fd)
    log.info("created pool file %s: uuid=%s size=%s", path, header.uuid, format_size(size))
    return PoolInfo(path, "file", header.uuid, size, header.data_offset, header.alignment, True)


def _check_free_space(path: str, need: int) -> None:
    if need <= 0:
        return
    fsdir = os.path.dirname(os.path.abspath(path))
    try:
        vfs = os.statvfs(fsdir)
    except OSError as e:
        raise PoolError(f"cannot check free space of {fsdir}: {e.strerror}") from None
    free = vfs.f_bavail * vfs.f_frsize
    if need > free:
        raise PoolError(
            f"pool {path} needs {format_size(need)} but {fsdir} has only {format_size(free)} free; "
            f"lower --pool-size (at most {format_size(free)}), free memory there, or give a DAX device "
            "with --pool-path"
        )


def open_pool(
    path: str,
    size: int | None,
    alignment: int | None = None,
    sysfs_root: str = "/sys",
    access: FileAccess | None = None,
) -> PoolInfo:
    """Open (or create) the pool at ``path`` and return its identity and geometry.

    ``size``: bytes for a new file pool; for an existing pool it must match or be None.
    ``alignment``: allocation unit (power of two); None picks 4096 for a file, the device's
    align for DAX. ``access``: mode and group of a new pool file (an existing file and a device
    keep theirs). Raises ``PoolError`` with the fix when the pool cannot be used.
    """
    if is_dax_path(path):
        return _open_dax(path, size, alignment, sysfs_root)
    return _open_file(path, size, alignment, access or FileAccess())


def remove_created_pool(pool: PoolInfo) -> None:
    """Delete the pool file that ``open_pool`` just created (``pool.created``), after a failed start.

    Never a pool that existed before, never a device, never a file that is no longer this pool.
    """
    if not pool.created or pool.kind != "file" or read_pool_uuid(pool.path) != pool.uuid:
        return
    try:
        os.unlink(pool.path)
    except OSError as e:
        log.warning("could not remove the new pool file %s after a failed start: %s", pool.path, e.strerror)
    else:
        log.info("removed the new pool file %s (the start failed)", pool.path)


def read_pool_uuid(path: str) -> str | None:
    """The UUID in the header of ``path``, or None when it has no Maru header (or cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        header = _read_header(fd, path)
    except (OSError, PoolError):
        return None
    finally:
        os.close(fd)
    return header.uuid if header else None


def scan_devices(sysfs_root: str = "/sys", dev_root: str = "/dev") -> dict[str, str]:
    """Map pool UUID -> local device path for every DAX device that carries a Maru header.

    A client on another host uses it to find its own path to the pool the server names.
    """
    found: dict[str, str] = {}
    seen: set[str] = set()
    for sub in (("bus", "dax", "devices"), ("class", "dax")):
        d = Path(sysfs_root, *sub)
        if not d.is_dir():
            continue
        for entry in sorted(d.iterdir()):
            if not _DAX_NAME.match(entry.name) or entry.name in seen:
                continue
            seen.add(entry.name)
            uid = read_pool_uuid(os.path.join(dev_root, entry.name))
            if uid:
                found[uid] = os.path.join(dev_root, entry.name)
    return found
