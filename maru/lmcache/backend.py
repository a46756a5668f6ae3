"""``MaruStorageBackend``: Maru's pool as an LMCache storage backend (a storage plugin).

LMCache builds it from its YAML (``storage_plugins: [maru]`` and the ``extra_config`` keys in
docs/lmcache.md) and calls it from its storage manager. LMCache keeps its own vLLM connector,
chunking and local CPU tier; this backend only keeps chunks in the pool and finds them again.

- ``contains`` / ``batched_contains``: one ``exists`` / prefix ``exists`` round trip.
- put (``batched_submit_put_task``): queued, written by a drain thread (``maru.lmcache.puts``);
  LMCache's store path never waits for Maru.
- get (``get_blocking`` / ``batched_get_blocking``): one pinned lookup per batch, then each hit is
  copied into a memory object of LMCache's local CPU allocator and unpinned at once; or, with
  ``maru_zero_copy_get``, handed to LMCache as a memory object over the pool pages themselves
  (unpinned when LMCache frees it). docs/lmcache.md says where each copy happens and why.
- remove: ``delete``; close: drain the queued puts, close the link.

Invariants: no method raises into LMCache (a dead server reads as an empty pool, one warning);
a key is visible only with complete bytes; every pin taken is released exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from maru import checksum
from maru.errors import MaruError
from maru.lmcache.compat import installed_known_wrong
from maru.lmcache.config import LMCacheMaruConfig
from maru.lmcache.keys import pool_key
from maru.lmcache.link import ServerLink
from maru.lmcache.objects import (
    HEADER_BYTES,
    PinReleaser,
    decode_header,
    dtype_from_name,
    pool_memory_obj,
    tensor_at,
)
from maru.lmcache.puts import PutQueue

logger = logging.getLogger("maru.lmcache")


class MaruStorageBackend(StoragePluginInterface):
    """Maru's pool under LMCache (see module docs). Thread-safe: LMCache calls it from several threads."""

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Any = None,
        metadata: Any = None,
        local_cpu_backend: Any = None,
        loop: Any = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        extra = getattr(config, "extra_config", None) if config is not None else None
        self.maru_config = LMCacheMaruConfig.from_extra_config(extra)
        cfg = self.maru_config
        self._cuda = str(dst_device).startswith("cuda") and torch.cuda.is_available()
        self.link = ServerLink(cfg.server_url, cfg.timeout_s, cfg.retry_s, on_connect=self._on_connect)
        self.puts = PutQueue(self.link, cfg.max_pending_puts)
        self._releaser = PinReleaser(self._release)
        self.get_stats = {"hits": 0, "misses": 0, "bad_objects": 0, "no_local_memory": 0}
        checksum.implementation()  # build the C loop now, not in the first get (or announce numpy once)
        for why in self._unchecked():
            logger.warning("Maru (LMCache backend): %s", why)
        self._known_wrong = installed_known_wrong() if self._cuda else None
        if self._known_wrong:
            logger.error("Maru (LMCache backend): %s", self._known_wrong)
        self.link.client()  # connect now if we can (else: warned once, retried later)

    def _weaker(self) -> list[str]:
        """What ``maru doctor`` lists for this backend: the numpy checksum (puts and checked gets
        compute checksums on the CPU) and settings that serve unchecked bytes, each with its fix."""
        return (
            checksum.slow_reasons() + self._unchecked() + ([self._known_wrong] if self._known_wrong else [])
        )

    def _unchecked(self) -> list[str]:
        """Settings that serve bytes Maru does not check, each with its fix (logged at start)."""
        if self.maru_config.verify_on_get:
            return []
        return [
            "maru_verify_on_get is false: chunks are handed to LMCache without checking the checksum "
            "their writer committed, so bytes a stalled or foreign writer changed would be served. "
            "Fix: maru_verify_on_get: true (or run only trusted writers on this pool)"
        ]

    def __str__(self) -> str:
        return "MaruStorageBackend"

    # ------------------------------------------------------------------ link
    def _on_connect(self, client: Any) -> None:
        role = getattr(self.metadata, "role", None)
        local = getattr(client, "local_exists", None)
        paths = {"lmcache": "storage plugin"}
        slow = self._weaker()
        if local is not None:  # LMCache's contains / prefix-contains are EXISTS
            paths["exists"] = local.path
            slow += local.slow()
        client.set_client_info({"role": f"lmcache-{role or 'worker'}", "paths": paths, "slow": slow})
        if self._cuda and self.maru_config.zero_copy_get and self.maru_config.register_with_cuda:
            # Zero-copy gets hand LMCache pool pages, which it copies to the GPU: at pinned speed only
            # if the mapping is registered. (Copying gets land in LMCache's own pinned buffer instead.)
            from maru.client.cuda_host import register_host_mapping

            register_host_mapping(client.pool_mapping)

    def _call(self, fn: Callable[[Any], Any], default: Any) -> Any:
        client = self.link.client()
        if client is None:
            return default
        try:
            return fn(client)
        except MaruError as e:
            self.link.failed(client, e)
        except Exception as e:  # never raise into LMCache; not the link's fault, so keep it
            logger.exception("Maru (LMCache backend): unexpected error (answering as a miss): %s", e)
        return default

    def key(self, cache_key: Any) -> str:
        """The pool key of an LMCache cache key (``maru.lmcache.keys``)."""
        return pool_key(cache_key, self.maru_config.namespace)

    # ------------------------------------------------------------------ lookups
    def contains(self, key: Any, pin: bool = False) -> bool:
        """Whether the chunk is in the pool. ``pin`` is not kept: a get pins for its own read."""
        return bool(self._call(lambda c: c.exists([self.key(key)])[0], False))

    def batched_contains(self, keys: list[Any], pin: bool = False) -> int:
        """How many leading keys are in the pool (one round trip)."""
        if not keys:
            return 0
        return int(self._call(lambda c: c.exists_prefix([self.key(k) for k in keys]), 0))

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return self.batched_contains(keys, pin)

    def exists_in_put_tasks(self, key: Any) -> bool:
        return self.puts.pending(self.key(key))

    # ------------------------------------------------------------------ puts
    def batched_submit_put_task(
        self,
        keys: Sequence[Any],
        objs: list[Any],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[Any], None] | None = None,
    ) -> None:
        """Queue the chunks for the drain thread and return at once (LMCache's objects are referenced
        until copied)."""
        items = [(self.key(k), k, o) for k, o in zip(keys, objs, strict=True)]
        self.puts.submit(items, on_complete_callback)
        return None

    async def async_batched_submit_put_task(
        self,
        keys: Sequence[Any],
        objs: list[Any],
        transfer_spec: Any = None,
        on_complete_callback: Callable[[Any], None] | None = None,
    ) -> None:
        self.batched_submit_put_task(keys, objs, transfer_spec, on_complete_callback)

    # ------------------------------------------------------------------ gets
    def get_blocking(self, key: Any) -> Any:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: list[Any]) -> list[Any]:
        """One memory object per key, None where absent (or its bytes failed their checksum)."""
        if not keys:
            return []
        pool_keys = [self.key(k) for k in keys]
        verify = self.maru_config.verify_on_get
        handles = self._call(lambda c: (c, c.batch_retrieve(pool_keys, pin=True, verify=verify)), None)
        if handles is None:
            self.get_stats["misses"] += len(keys)
            return [None] * len(keys)
        client, found = handles
        base = client.pool_address if any(h is not None for h in found) else 0
        out: list[Any] = []
        done: list[Any] = []  # pins no object holds (copied out, or unreadable): released together
        for h in found:
            obj = None if h is None else self._memory_obj(base, h)
            out.append(obj)
            if h is not None and (obj is None or not self.maru_config.zero_copy_get):
                done.append(h)
        if done:
            self._unpin(client, done)
        hits = sum(o is not None for o in out)
        self.get_stats["hits"] += hits
        self.get_stats["misses"] += len(out) - hits
        return out

    def _memory_obj(self, pool_address: int, handle: Any) -> Any:
        """Turn one pinned lookup into an LMCache memory object (see module docs); None on failure.
        ``pool_address``: where the pool is mapped in this process."""
        try:
            if self.maru_config.zero_copy_get:
                return pool_memory_obj(handle, pool_address, self._releaser)
            return self._copy_out(pool_address, handle)
        except Exception as e:  # never raise into LMCache: a chunk that cannot be read is a miss
            self.get_stats["bad_objects"] += 1
            logger.warning(
                "Maru (LMCache backend): cannot read %s as an LMCache object (%s); a miss", handle.key, e
            )
            return None

    def _copy_out(self, pool_address: int, handle: Any) -> Any:
        """Copy one pinned pool object into LMCache's local CPU allocator (the caller unpins it)."""
        doc = decode_header(handle.view)
        alloc = getattr(self.local_cpu_backend, "allocate", None)
        obj = None
        if alloc is not None:
            shapes = [torch.Size(s) for s in doc["shapes"]] if doc["shapes"] else torch.Size(doc["shape"])
            dtypes = (
                [dtype_from_name(d) for d in doc["dtypes"]]
                if doc["dtypes"]
                else dtype_from_name(doc["dtype"])
            )
            from lmcache.v1.memory_management import MemoryFormat

            obj = alloc(shapes, dtypes, fmt=MemoryFormat(doc["fmt"]), eviction=True, busy_loop=False)
        if obj is None:
            self.get_stats["no_local_memory"] += 1
            return None
        try:
            size = int(doc["size"])
            src = tensor_at(pool_address + handle.offset + HEADER_BYTES, size)
            obj.raw_data.view(-1).view(torch.uint8)[:size].copy_(src)
        except BaseException:
            obj.ref_count_down()  # back to LMCache's allocator: nothing half-copied is handed out
            raise
        return obj

    def _unpin(self, client: Any, handles: list[Any]) -> None:
        """Unpin ``handles`` with one UNPIN that LMCache's thread does not wait for (the server
        applies it before this client's next request)."""
        try:
            client.batch_release(handles, wait=False)
        except MaruError as e:
            for h in handles:
                h.release()  # drop the views; the pins end with the session
            self.link.failed(client, e)

    def _release(self, handle: Any) -> None:
        """LMCache freed a zero-copy object: unpin its page (without waiting, where connected)."""
        client = self.link.client()
        if client is None:
            handle.release()
        else:
            self._unpin(client, [handle])

    def get_non_blocking(self, key: Any, location: str | None = None) -> Future | None:
        """A finished future with the memory object, or None when the chunk is absent (LMCache
        takes any returned future as a hit)."""
        obj = self.get_blocking(key)
        if obj is None:
            return None
        fut: Future = Future()
        fut.set_result(obj)
        return fut

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[Any], transfer_spec: Any = None
    ) -> list[Any]:
        """The leading run of hits (LMCache retrieves prefixes); later hits are released."""
        objs = self.batched_get_blocking(keys)
        out: list[Any] = []
        for i, o in enumerate(objs):
            if o is None:
                for rest in objs[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(o)
        return out

    # ------------------------------------------------------------------ the rest of the interface
    def pin(self, key: Any) -> bool:
        """Not supported: Maru pins only for the duration of a read."""
        return False

    def unpin(self, key: Any) -> bool:
        return False

    def remove(self, key: Any, force: bool = True) -> bool:
        return bool(self._call(lambda c: c.delete([self.key(key)])[0], False))

    def batched_remove(self, keys: list[Any], force: bool = True) -> int:
        if not keys:
            return 0
        return sum(self._call(lambda c: c.delete([self.key(k) for k in keys]), []))

    def get_allocator_backend(self) -> Any:
        """LMCache's local CPU backend: the storage manager hands puts LMCache's own objects (no copy
        on its store path); the drain thread copies them into the pool."""
        return self.local_cpu_backend

    def touch_cache(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        """Put and get counters of this backend."""
        return {"puts": self.puts.stats.as_dict(), "gets": dict(self.get_stats)}

    def close(self) -> None:
        """Finish queued puts (bounded), then disconnect. Idempotent."""
        self.puts.close()
        self.link.close()
