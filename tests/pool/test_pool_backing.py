"""Pool backing stores: the emulated file, the DAX device (faked sysfs), the header, the scanner."""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from maru.errors import PoolError
from maru.pool import open_pool, read_pool_uuid, scan_devices
from maru.pool.header import HEADER_BYTES, PoolHeader


@pytest.fixture
def shm_path() -> Iterator[str]:
    path = f"/dev/shm/maru-test-{uuid.uuid4().hex[:12]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def fake_dax(
    tmp_path: Path, name: str = "dax0.0", size: int = 8 << 20, align: int | None = 2 << 20
) -> tuple[str, str]:
    """A regular file standing in for /dev/<name> and a sysfs tree describing it."""
    sysfs = tmp_path / "sys"
    d = sysfs / "bus" / "dax" / "devices" / name
    d.mkdir(parents=True)
    (d / "size").write_text(f"{size}\n")
    if align is not None:
        (d / "align").write_text(f"{align}\n")
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    with open(dev / name, "wb") as f:
        f.truncate(size)
    return str(dev / name), str(sysfs)


def test_a_new_pool_file_is_reserved_private_and_carries_a_header(shm_path: str) -> None:
    info = open_pool(shm_path, 8 << 20)
    st = os.stat(shm_path)
    assert info.created and info.kind == "file"
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == 8 << 20
    assert st.st_blocks * 512 >= 8 << 20  # reserved up front, not sparse
    assert (info.data_offset, info.alignment) == (4096, 4096)
    with open(shm_path, "rb") as f:
        h = PoolHeader.unpack(f.read(HEADER_BYTES), shm_path)
    assert h is not None and h.uuid == info.uuid and h.pool_size == 8 << 20


def test_reopening_a_pool_keeps_its_uuid_and_its_bytes(shm_path: str) -> None:
    first = open_pool(shm_path, 8 << 20)
    payload = os.urandom(10_000)
    with open(shm_path, "r+b") as f:
        f.seek(first.data_offset)
        f.write(payload)
    again = open_pool(shm_path, None)
    assert again.uuid == first.uuid and not again.created and again.pool_size == 8 << 20
    with open(shm_path, "rb") as f:
        f.seek(first.data_offset)
        assert f.read(len(payload)) == payload


def test_reopening_with_another_size_is_refused_with_the_fix(shm_path: str) -> None:
    open_pool(shm_path, 8 << 20)
    with pytest.raises(PoolError, match="exists with 8.0 MiB.*asks 16.0 MiB"):
        open_pool(shm_path, 16 << 20)


def test_a_pool_larger_than_shm_free_space_is_refused_before_creating_anything(shm_path: str) -> None:
    with pytest.raises(PoolError) as e:
        open_pool(shm_path, 10 << 40)
    msg = str(e.value)
    assert "10.0 TiB" in msg and "free" in msg and "--pool-size" in msg
    assert not os.path.exists(shm_path)


def test_a_file_that_is_not_a_pool_is_refused_not_overwritten(shm_path: str) -> None:
    with open(shm_path, "wb") as f:
        f.write(b"precious" * 1000)
    with pytest.raises(PoolError, match="not a Maru pool"):
        open_pool(shm_path, 8 << 20)
    with open(shm_path, "rb") as f:
        assert f.read(8) == b"precious"


def test_a_corrupt_header_is_refused(shm_path: str) -> None:
    open_pool(shm_path, 8 << 20)
    with open(shm_path, "r+b") as f:
        f.seek(20)
        f.write(b"\xff\xff")
    with pytest.raises(PoolError, match="corrupt"):
        open_pool(shm_path, None)


def test_dax_device_geometry_comes_from_sysfs_and_data_starts_one_align_unit_in(tmp_path: Path) -> None:
    dev, sysfs = fake_dax(tmp_path, size=8 << 20, align=2 << 20)
    info = open_pool(dev, None, sysfs_root=sysfs)
    assert info.kind == "dax" and info.created
    assert (info.pool_size, info.data_offset, info.alignment) == (8 << 20, 2 << 20, 2 << 20)
    again = open_pool(dev, None, sysfs_root=sysfs)
    assert again.uuid == info.uuid and not again.created


def test_dax_alignment_is_configurable_and_class_dax_is_read_too(tmp_path: Path) -> None:
    dev, sysfs = fake_dax(tmp_path, name="dax3.1", size=4 << 20, align=None)
    # Move the entry to the other sysfs location the kernel may use.
    src = Path(sysfs, "bus", "dax", "devices", "dax3.1")
    dst = Path(sysfs, "class", "dax")
    dst.mkdir(parents=True)
    src.rename(dst / "dax3.1")
    info = open_pool(dev, None, alignment=4096, sysfs_root=sysfs)
    assert (info.alignment, info.data_offset) == (4096, 2 << 20)  # missing align file: 2 MiB default


def test_dax_without_sysfs_entry_or_with_wrong_size_is_refused(tmp_path: Path) -> None:
    dev, sysfs = fake_dax(tmp_path)
    with pytest.raises(PoolError, match="sysfs has no size"):
        open_pool(dev, None, sysfs_root=str(tmp_path / "elsewhere"))
    with pytest.raises(PoolError, match="does not match DAX device"):
        open_pool(dev, 1 << 20, sysfs_root=sysfs)


def test_scan_devices_maps_uuid_to_this_hosts_path(tmp_path: Path) -> None:
    dev0, sysfs = fake_dax(tmp_path, "dax0.0")
    d = Path(sysfs, "bus", "dax", "devices", "dax1.0")
    d.mkdir()
    (d / "size").write_text(str(4 << 20))
    with open(tmp_path / "dev" / "dax1.0", "wb") as f:  # a device without a Maru header
        f.truncate(4 << 20)
    info = open_pool(dev0, None, sysfs_root=sysfs)
    found = scan_devices(sysfs, dev_root=str(tmp_path / "dev"))
    assert found == {info.uuid: dev0}
    assert read_pool_uuid(dev0) == info.uuid
