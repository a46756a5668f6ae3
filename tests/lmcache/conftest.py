"""Fixtures for the LMCache backend tests: the real ``lmcache`` package and a real ``maru server``.

``lmcache_storage`` builds LMCache's own ``StorageManager`` from an LMCache config that names
Maru's backend the way a user's YAML does (``storage_plugins`` + ``extra_config``), so every test
goes through LMCache's plugin loader, not a hand-made backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from maru.lmcache.config import PLUGIN_NAME

NEEDS = "lmcache.v1.storage_backend.storage_manager"
WHY = "lmcache is not installed (scripts/setup.sh installs it: pip install --no-deps lmcache)"

MODEL = "maru-test/tiny"
CHUNK_SHAPE = torch.Size([2, 2, 16, 32])  # [K/V, layers, tokens, hidden]: LMCache's KV_2LTD


def lmcache_config(url: str, **extra: Any) -> Any:
    """An LMCache engine config with Maru as its storage plugin (what docs/lmcache.md's YAML says)."""
    from lmcache.v1.config import LMCacheEngineConfig

    local_cpu = bool(extra.pop("local_cpu", False))
    return LMCacheEngineConfig.from_defaults(
        chunk_size=16,
        local_cpu=local_cpu,
        max_local_cpu_size=0.05,
        storage_plugins=[PLUGIN_NAME],
        extra_config={
            f"storage_plugin.{PLUGIN_NAME}.module_path": "maru.lmcache",
            f"storage_plugin.{PLUGIN_NAME}.class_name": "MaruStorageBackend",
            "maru_server_url": url,
            "maru_timeout_s": 2.0,
            **extra,
        },
    )


def lmcache_metadata(dtype: torch.dtype = torch.bfloat16) -> Any:
    try:
        from lmcache.v1.metadata import LMCacheMetadata
    except ImportError:  # LMCache before 0.5 (0.3.x, what vLLM 0.26's bundled adapter imports)
        from lmcache.config import LMCacheEngineMetadata

        return LMCacheEngineMetadata(
            model_name=MODEL,
            world_size=1,
            worker_id=0,
            fmt="vllm",
            kv_dtype=dtype,
            kv_shape=(2, 2, 16, 2, 16),
        )

    return LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=dtype,
        kv_shape=(2, 2, 16, 2, 16),
    )


def cache_keys(n: int, start: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[Any]:
    import dataclasses

    from lmcache.utils import CacheEngineKey

    # LMCache before 0.5 puts the KV format first in its keys.
    head = ("vllm",) if "fmt" in {f.name for f in dataclasses.fields(CacheEngineKey)} else ()
    return [
        CacheEngineKey(*head, MODEL, 1, 0, 0x9E3779B97F4A7C15 * (i + 1) % (1 << 63), dtype)
        for i in range(start, start + n)
    ]


def put_random(
    storage: Any, keys: list[Any], dtype: torch.dtype = torch.bfloat16, shape: torch.Size = CHUNK_SHAPE
) -> list[torch.Tensor]:
    """Store random chunks under ``keys`` through LMCache's storage manager; returns their data."""
    from lmcache.v1.memory_management import MemoryFormat

    objs = storage.batched_allocate(shape, dtype, len(keys), fmt=MemoryFormat.KV_2LTD)
    assert objs is not None, "LMCache's local CPU allocator is full"
    data = []
    for o in objs:
        t = (torch.randn(shape) * 8).to(dtype)
        o.tensor.copy_(t)
        data.append(t)
    storage.batched_put(keys, objs)
    return data


@pytest.fixture
def make_storage(maru_server: Any) -> Iterator[Callable[..., Any]]:
    """Build LMCache ``StorageManager``s with Maru as a plugin (closed at teardown)."""
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    made: list[Any] = []

    def make(url: str | None = None, dtype: torch.dtype = torch.bfloat16, **extra: Any) -> Any:
        sm = StorageManager(
            lmcache_config(url or maru_server.url, **extra), lmcache_metadata(dtype), EventManager()
        )
        made.append(sm)
        assert PLUGIN_NAME in sm.storage_backends, (
            f"LMCache did not load the plugin: {list(sm.storage_backends)}"
        )
        return sm

    yield make
    for sm in made:
        sm.close()


def backend(storage: Any) -> Any:
    return storage.storage_backends[PLUGIN_NAME]
