"""What the scheduler-side connector tells the worker-side connector each step.

Plain data (picklable: in vLLM's multi-process mode it crosses a process boundary) and torch-free:
the scheduler side imports it without torch or vLLM. ``maru.vllm.connector`` registers the class as
a virtual subclass of vLLM's ``KVConnectorMetadata``. The scheduler decides *what* moves; the
worker only executes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from maru.transfer.records import RequestTransfer


@dataclass
class MaruConnectorMetadata:
    """One step's work.

    ``loads``: requests whose leading tokens come from Maru this step; the worker places them
    before the forward and reports every placed block of a request that fails (all or nothing).
    ``stores``: chunks whose last token is computed in this step; the worker gathers them after
    the forward and publishes them in one batch. A store of a request whose load failed in the
    same step is dropped (its KV was computed on top of missing context).
    ``async_loads`` (``maru_async_load``): requests parked in ``WAITING_FOR_REMOTE_KVS``; the
    worker loads them on its loader thread and reports each in ``finished_recving`` once placed
    (or failed: then its blocks also go to ``get_block_ids_with_load_errors``).
    ``preempted_req_ids`` (vLLM's ``scheduler_output.preempted_req_ids``): requests preempted in
    this step. vLLM already freed their blocks; with ``maru_async_store`` the worker's
    ``handle_preemptions`` waits, before the forward, until no write-behind store still reads them,
    and neither side owes them a ``finished_sending`` any more.
    """

    loads: list[RequestTransfer] = field(default_factory=list)
    stores: list[RequestTransfer] = field(default_factory=list)
    async_loads: list[RequestTransfer] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    # With ``maru_log_timing`` only, for the worker's step clock: the tokens vLLM scheduled in this
    # step, and whether some request got more than one (a prefill step).
    step_tokens: int = 0
    prefill: bool = False
    # With ``maru_log_timing`` only: ``time.monotonic()`` (system-wide, so comparable in the worker's
    # process too) when the scheduler side planned this step (``build_connector_meta``); 0: unknown.
    scheduled_at: float = 0.0
    # With it: ``step_clock.cpu_stamp()`` at that moment (process, thread, their CPU times).
    scheduled_cpu: tuple = ()
    # With ``MARU_THREAD_CENSUS`` too, in prefill steps: ``thread_census.snapshot()`` at that moment.
    scheduled_threads: dict = field(default_factory=dict)
    # ``maru_early_load``: set by an in-process worker that issued this step's loads when the step
    # was planned (``maru.vllm.early_loads``); its ``start_load_kv`` then finds them started. 0: not.
    early_token: int = 0

    def is_empty(self) -> bool:
        return not self.loads and not self.stores and not self.async_loads and not self.preempted_req_ids


@dataclass
class MaruWorkerMeta:
    """What the workers tell the scheduler side after a step (vLLM's ``kv_connector_worker_meta``).

    ``done``: ticket -> how many workers report it: the loads whose held chunks (``OfferPins``)
    the reporting workers no longer read, whatever came of them (placed, failed, never started).
    vLLM merges the workers' records with ``aggregate`` (counts add up), and the scheduler side
    releases a ticket's pins once every tensor-parallel rank reported it.
    ``ready`` / ``unready``: how many workers can load now (KV cache layout supported, connected)
    and how many cannot; sent every step only where a failed load ends its request
    (``MaruConnectorConfig.load_failures_fail``): the scheduler side offers loads there only while
    every rank is ready.
    """

    done: dict[str, int] = field(default_factory=dict)
    ready: int = 0
    unready: int = 0

    def aggregate(self, other: MaruWorkerMeta) -> MaruWorkerMeta:
        merged = dict(self.done)
        for ticket, n in getattr(other, "done", {}).items():
            merged[ticket] = merged.get(ticket, 0) + n
        return MaruWorkerMeta(
            merged, self.ready + getattr(other, "ready", 0), self.unready + getattr(other, "unready", 0)
        )

    def __bool__(self) -> bool:
        return bool(self.done) or bool(self.ready or self.unready)
