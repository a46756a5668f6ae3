"""Server counters and gauges: the STATS reply and the Prometheus exposition.

Counters only grow (since server start). Gauges are read from the registry and the allocator at
the moment of the request (or the scrape). The Prometheus endpoint reads from its own thread;
it only reads ints and copies dicts (atomic under the GIL), so it never races the event loop
into an exception, at worst into a value one request old.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from maru.protocol import ErrorCode, Op

log = logging.getLogger("maru.server.stats")

_OP_NAMES = {int(op): op.name.lower() for op in Op}

COUNTER_NAMES = (
    "hits",  # LOOKUP keys found
    "misses",  # LOOKUP keys not found
    "exists_hits",
    "exists_misses",
    "stores",  # COMMIT items stored
    "duplicates",  # COMMIT items that found the key present (space freed)
    "unknown_allocs",  # COMMIT items naming no reservation of this client
    "evictions",
    "evicted_bytes",
    "bytes_stored",  # object bytes committed
    "bytes_served",  # object bytes of LOOKUP hits (what clients then read from the pool)
    "reserves",
    "reserve_failures",  # reservations that did not fit even after eviction
    "aborts",
    "deletes",
    "pins",
    "unpins",
    "leases_expired",
    "quarantines",  # expired leases whose reservations/pins went to quarantine
    "quarantine_released_dead",  # ... released: the holder's process is gone
    "quarantine_released_fenced",  # ... released: the holder handshook again, fenced
    "quarantine_released_timed_out",  # ... released: --quarantine-timeout passed
    "reclaimed_reservations",  # freed when a quarantine was released
    "released_pins",  # released when a quarantine was released
    "integrity_failures",  # objects whose bytes failed their checksum (REPORT from readers)
    "integrity_deletes",  # ... of those, entries deleted so the key can be stored again
    "malformed_frames",  # frames too short for a header, or with a broken envelope (no reply)
    "sql_transactions",
    "state_write_errors",  # writes the state database refused (disk full, I/O error)
)


class ServerStats:
    """Counters of one server process (see ``COUNTER_NAMES``), requests by op, errors by code."""

    def __init__(self) -> None:
        self.started = time.time()
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self.requests: dict[str, int] = {op.name.lower(): 0 for op in Op}
        self.requests["unknown"] = 0
        self.errors: dict[str, int] = {c.value: 0 for c in ErrorCode}
        # Seconds the event loop spent answering each op (decode, handle, encode; not the socket
        # send): with the clients' round trips, where a request's time goes (``maru stats``).
        self.service_s: dict[str, float] = {op.name.lower(): 0.0 for op in Op}

    def add(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def add_service(self, op: int, seconds: float) -> None:
        """Count ``seconds`` of the event loop's time on one request of ``op`` (unknown ops: not)."""
        name = _OP_NAMES.get(op)
        if name is not None:
            self.service_s[name] += seconds

    def snapshot(self) -> dict[str, Any]:
        return {
            "uptime_s": time.time() - self.started,
            "counters": dict(self.counters),
            "requests": dict(self.requests),
            "errors": dict(self.errors),
            "service_s": dict(self.service_s),
        }


def service_us(snap: dict[str, Any]) -> dict[str, tuple[int, float]]:
    """``{op: (requests, mean microseconds of the server's time on one)}`` of the ops answered at
    least once, from a STATS reply (empty for a server older than ``service_s``)."""
    svc, req = snap.get("service_s") or {}, snap.get("requests") or {}
    return {op: (int(req[op]), 1e6 * float(svc[op]) / int(req[op])) for op in svc if int(req.get(op, 0))}


def start_metrics_server(port: int, collect: Callable[[], dict[str, Any]], host: str = "127.0.0.1") -> Any:
    """Serve Prometheus metrics on ``host:port`` from a private registry; returns the server.

    ``collect`` returns the same dict as the STATS reply. Metric names: ``maru_<counter>_total``,
    ``maru_requests_total{op}``, ``maru_request_seconds_total{op}``, ``maru_errors_total{code}``, ``maru_<gauge>`` (see docs/server.md).
    """
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self) -> Iterator[Any]:
            try:
                s = collect()
            except Exception:  # a scrape must never take the server down
                log.exception("metrics collection failed")
                return
            for name, value in s["counters"].items():
                yield CounterMetricFamily(f"maru_{name}", f"Maru server counter {name}", value=value)
            req = CounterMetricFamily("maru_requests", "Requests by op", labels=["op"])
            for op, n in s["requests"].items():
                req.add_metric([op], n)
            yield req
            err = CounterMetricFamily("maru_errors", "Error replies by code", labels=["code"])
            for code, n in s["errors"].items():
                err.add_metric([code], n)
            yield err
            svc = CounterMetricFamily(
                "maru_request_seconds", "Seconds the server spent answering requests, by op", labels=["op"]
            )
            for op, sec in (s.get("service_s") or {}).items():
                svc.add_metric([op], sec)
            yield svc
            for name, value in s["gauges"].items():
                yield GaugeMetricFamily(f"maru_{name}", f"Maru server gauge {name}", value=value)
            yield GaugeMetricFamily(
                "maru_uptime_seconds", "Seconds since the server started", value=s["uptime_s"]
            )

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    result = start_http_server(port, addr=host, registry=registry)
    return result
