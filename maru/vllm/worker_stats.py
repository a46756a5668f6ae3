"""The worker side's cumulative counters (``MaruKVConnector.maru_stats()``, vLLM's stats pipeline)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class WorkerStats:
    """Cumulative counters of one worker (``MaruKVConnector.maru_stats()``)."""

    loads: int = 0
    tokens_loaded: int = 0
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    load_errors: int = 0
    load_copies_shared: int = 0  # chunks placed from another request's copy in the same step
    loads_from_held_pins: int = 0  # requests whose chunks came pinned by the scheduler (no lookup)
    load_seconds: float = 0.0  # of the loads the step waited for (not the layer loads)
    bytes_loaded_under_forward: int = 0  # of bytes_loaded: layer loads, placed under the forward
    bytes_left_unread: int = 0  # of bytes_loaded: segments a load neither placed nor read (maru.segments)
    chunks_stored: int = 0
    chunks_present: int = 0
    tokens_stored: int = 0
    bytes_stored: int = 0
    store_failures: int = 0
    stores_dropped: int = 0
    store_seconds: float = 0.0
    async_loads: int = 0  # maru_async_load: loads started on the loader thread
    async_load_failures: int = 0
    async_issued_late: int = 0  # async batches issued after the forward (slow lookup): a step later
    overlap_loads: int = 0  # maru_overlap_load_with_compute: steps placed layer by layer
    layer_waits: int = 0  # wait_for_layer_load calls that found a layer load in flight
    # maru_overlap_load_with_compute: steps loaded synchronously, before a forward that skips the
    # per-layer hook (vLLM's full CUDA graph replay of a decode-shaped batch)
    overlap_full_graph_loads: int = 0
    early_loads: int = 0  # maru_early_load: steps whose layer load was issued when the step was planned
    layer_loads_unwaited: int = 0  # layer loads whose forward never waited (requests failed: a bug)
    deferred_commits: int = 0  # maru_async_store: store batches committed by the drain thread
    helper_batches: int = 0  # maru_store_helper: store batches sent to the helper process
    # maru_store_helper: batches stored on the drain thread instead (helper starting, full, failed)
    helper_missed: int = 0
    stores_in_flight: int = 0  # maru_async_store, now: store batches issued and not yet drained
    sending_held: int = 0  # maru_async_store, now: finished requests whose blocks wait for their stores
    sending_reported: int = 0  # maru_async_store: requests reported in finished_sending (blocks freed)
    # maru_async_store: of those, how many vLLM had named finished before their stores had read their
    # blocks, and the time from that naming to their report, summed (the blocks held for the stores)
    sending_delayed: int = 0
    sending_delay_s: float = 0.0
    # start_load_kv calls not followed by wait_for_save: steps vLLM ran without a forward (e.g. while
    # finished requests wait for finished_sending)
    steps_without_forward: int = 0
    # maru_async_store: the store batches the drain thread finished, and its CPU and wall time over
    # them. Its waits for the device sleep (store done events are cudaEventBlockingSync), so the CPU
    # time is its work (an upper bound of its GIL hold: ctypes calls that block give the GIL up).
    drain_batches: int = 0
    drain_cpu_s: float = 0.0
    drain_wall_s: float = 0.0
    drain_phase_cpu_s: dict[str, float] = field(default_factory=dict)  # StoreReport.cpu, summed
    drain_gil_held_s: float = 0.0  # its GIL-holding CUDA calls' wall time (MARU_THREAD_CENSUS only)
    # maru_gil_probe_ms (maru.vllm.gil_probe): the probe thread's wake-ups while the engine ran
    # steps, how late they were in all and at most (its wait for the GIL), and their histogram
    gil_probe_wakeups: int = 0
    gil_probe_late_s: float = 0.0
    gil_probe_max_late_s: float = 0.0
    gil_probe_hist: list[int] = field(default_factory=list)
    # of those, the wake-ups while the write-behind drain thread was at work on a store
    gil_probe_drain_wakeups: int = 0
    gil_probe_drain_late_s: float = 0.0
    gil_probe_drain_over_1ms: int = 0
    # maru_store_yield_to_prefill_ms (PrefillGate): store batches the drain thread held for a step
    # without prefill, of them those released by the hold's limit, and their time held, summed
    store_holds: int = 0
    store_hold_timeouts: int = 0
    store_hold_s: float = 0.0
    preemption_waits: int = 0  # preemption barriers that waited for a store still reading the blocks
    stores_cancelled: int = 0  # store batches given up at a preemption barrier (published nothing)

    def add_load(self, rep: Any, under_forward: bool = False) -> None:
        """Count a load's ``LoadReport``. A layer load runs ``under_forward``: its bytes count, its
        host time is no transfer time (``load_seconds`` are those of the loads a step waited for)."""
        self.loads += len(rep.loaded_req_ids)
        self.tokens_loaded += rep.tokens
        self.chunks_loaded += rep.chunks
        self.bytes_loaded += rep.bytes
        self.load_copies_shared += rep.copies_shared
        self.bytes_left_unread += rep.unread_bytes
        if under_forward:
            self.bytes_loaded_under_forward += rep.bytes
        else:
            self.load_seconds += rep.seconds

    def timing_note(self) -> str:
        """What the worker's timing line adds (``maru_log_timing``): the finished requests whose blocks
        waited for their write-behind stores, vLLM's steps without a forward and the drain thread's time a
        store batch; "" when none."""
        held = (
            f"; finished requests held for their stores: {self.sending_delayed} of {self.sending_reported}, "
            f"{1e3 * self.sending_delay_s / self.sending_delayed:.1f} ms each"
            if self.sending_delayed
            else ""
        )
        idle = (
            f"; steps without a forward: {self.steps_without_forward}" if self.steps_without_forward else ""
        )
        drain = (
            f"; drain thread: {1e3 * self.drain_cpu_s / self.drain_batches:.2f} ms CPU, "
            f"{1e3 * self.drain_wall_s / self.drain_batches:.2f} ms wall a store batch"
            + (
                " (CPU: "
                + ", ".join(
                    f"{k} {1e3 * v / self.drain_batches:.2f}" for k, v in self.drain_phase_cpu_s.items()
                )
                + " ms)"
                if self.drain_phase_cpu_s
                else ""
            )
            + (
                f", GIL held in CUDA calls {1e3 * self.drain_gil_held_s / self.drain_batches:.2f} ms"
                if self.drain_gil_held_s
                else ""
            )
            if self.drain_batches
            else ""
        )
        gate = (
            f"; store batches held for a step without prefill: {self.store_holds}, "
            f"{1e3 * self.store_hold_s / self.store_holds:.1f} ms each, {self.store_hold_timeouts} "
            "released by the limit"
            if self.store_holds
            else ""
        )
        from maru.vllm.gil_probe import probe_note  # the probe imports this module

        return held + idle + drain + gate + probe_note(self)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
