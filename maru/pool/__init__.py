"""Maru's memory layer: backing stores (DAX device, emulated /dev/shm file), the pool header
and the extent allocator the server uses to place objects."""

from __future__ import annotations

from maru.pool.allocator import ExtentAllocator
from maru.pool.backing import (
    PoolInfo,
    dax_device_geometry,
    is_dax_path,
    open_pool,
    read_pool_uuid,
    scan_devices,
)
from maru.pool.header import PoolHeader

__all__ = [
    "ExtentAllocator",
    "PoolHeader",
    "PoolInfo",
    "dax_device_geometry",
    "is_dax_path",
    "open_pool",
    "read_pool_uuid",
    "scan_devices",
]
