"""The connector's counters in vLLM's own stats pipeline (``KV Transfer metrics: ...`` log lines).

Each worker reports what changed since its last report; vLLM sums the reports of all workers and
of every step in its logging interval (``aggregate``) and logs ``reduce()``. The class must be
importable by name: vLLM ships these objects from worker to engine-core process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "tokens_loaded",
    "chunks_loaded",
    "bytes_loaded",
    "bytes_loaded_under_forward",
    "load_errors",
    "load_seconds",
    "chunks_stored",
    "chunks_present",
    "bytes_stored",
    "store_failures",
    "stores_dropped",
    "store_seconds",
)


@dataclass
class MaruKVConnectorStats(KVConnectorStats):
    """Sums of the worker counters over an interval (``data``: counter name -> amount)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "tokens_loaded": int(d.get("tokens_loaded", 0)),
            "chunks_loaded": int(d.get("chunks_loaded", 0)),
            "load_errors": int(d.get("load_errors", 0)),
            "chunks_stored": int(d.get("chunks_stored", 0)),
            "chunks_present": int(d.get("chunks_present", 0)),
            "store_failures": int(d.get("store_failures", 0)) + int(d.get("stores_dropped", 0)),
        }
        waited = d.get("bytes_loaded", 0) - d.get("bytes_loaded_under_forward", 0)
        if d.get("load_seconds") and waited > 0:
            # Layer loads run under the forward: their bytes have no transfer time of their own.
            out["load_GBps"] = round(waited / d["load_seconds"] / 1e9, 2)
        if d.get("store_seconds"):
            out["store_GBps"] = round(d.get("bytes_stored", 0) / d["store_seconds"] / 1e9, 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS)


def counters(stats: Any) -> dict[str, Any]:
    """The ``COUNTERS`` of a ``WorkerStats``, read directly: vLLM asks for the stats every step, on
    its forward thread, and ``WorkerStats.as_dict`` (``dataclasses.asdict``, every field copied
    deeply) cost ~40 us a step on the CI machine for these twelve numbers."""
    return {k: getattr(stats, k) for k in COUNTERS}


def interval_stats(now: dict[str, Any], last: dict[str, Any]) -> MaruKVConnectorStats | None:
    """The change of the counters since ``last`` (None when nothing changed)."""
    delta = {k: now.get(k, 0) - last.get(k, 0) for k in COUNTERS}
    if not any(delta.values()):
        return None
    return MaruKVConnectorStats(data=delta)
