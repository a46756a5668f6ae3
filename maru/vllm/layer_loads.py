"""``maru_overlap_load_with_compute`` on one worker: a step's loads placed layer by layer under the forward.

``LayerLoads`` pins every chunk of the step before the forward and places the layers behind it;
the forward waits per layer (``wait_for_layer``). Invariants: a request that cannot be loaded
completely is failed through the worker (recomputed) before the step's stores are filtered (at
issue when known then, else in ``finish`` after the forward); a layer load's pins are released
exactly once, after its transfer is ``done()``; a layer load whose forward never waited for a
layer (vLLM did not call the per-layer hook) fails every request it placed, after the forward:
that forward may have read layers before they were placed, and vLLM discards its output of them.

Which forwards call the per-layer hook is vLLM's choice per step (``forward_runs_layer_hooks``): a
forward replayed as one full CUDA graph skips it, so the worker loads that step synchronously,
before the forward, instead of layer by layer.
"""

from __future__ import annotations

import logging
from typing import Any

from maru.transfer.loads import LayerByLayerLoad
from maru.transfer.records import RequestTransfer
from maru.vllm.load_hooks import LoadHooks
from maru.vllm.worker_stats import WorkerStats

logger = logging.getLogger("maru.vllm")

# What a forward that never waited for its layer load means, and the fix (the log line, and the
# worker's reported slow path, after the count: ``maru stats``, ``maru doctor``).
UNWAITED = (
    "layer-by-layer loads ran under a forward that never called wait_for_layer_load (a forward mode "
    "the connector did not recognise as skipping the per-layer hook); their requests were reported "
    "as failed loads, so vLLM kept nothing that forward read of them. Fix: set "
    "maru_overlap_load_with_compute=false and report the vLLM version and its cudagraph_mode"
)


def forward_runs_layer_hooks(forward_context: Any) -> bool:
    """Whether vLLM's forward for this ``forward_context`` calls ``wait_for_layer_load`` before each
    attention layer (read in ``start_load_kv``, before that forward runs).

    vLLM's attention calls the hook only with attention metadata in the forward context, and not
    inside a full CUDA graph's replay: the V1 model runner says ``cudagraph_runtime_mode`` FULL
    then; the V2 runner starts the loads of a full-graph step outside any forward context (vLLM
    makes an empty one, no metadata). Piecewise graphs and eager forwards run attention, and the
    hook, in Python. Anything else (a mode this code does not know) answers False: the load is then
    complete before the forward, never read half placed.
    """
    if forward_context is None or getattr(forward_context, "attn_metadata", None) is None:
        return False
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", None) in ("NONE", "PIECEWISE")


class LayerLoads:
    """The layer-overlap loads of one worker (see the module docstring for the invariants).

    ``hooks`` are the worker's (``LoadHooks``); a step's load is accounted as " (layer by layer)",
    under the forward.
    """

    def __init__(self, stats: WorkerStats, hooks: LoadHooks) -> None:
        self.stats = stats
        self._hooks = hooks
        self._load: LayerByLayerLoad | None = None
        self._reqs: dict[str, RequestTransfer] = {}
        self._step: list[RequestTransfer] = []  # the step's loads, whose tickets go with the layer load
        self._waited = False  # the forward called wait_for_layer since the step's layer load was issued
        # Layer loads after their forward, still running on the device: unpinned once done()
        # (get_finished polls them), with the step's loads to report done then.
        self._releases: list[tuple[LayerByLayerLoad, list[RequestTransfer]]] = []

    def start(self, loads: list[RequestTransfer]) -> None:
        """Pin every chunk of the step now (the lookup decides), then place layer by layer behind.

        A failure at issue is reported at once, before the forward reads anything.
        """
        self.release()
        engine = self._hooks.connect()
        if isinstance(engine, str):
            for rt in loads:
                self._hooks.fail(rt, engine)
            self._hooks.done(loads)
            return
        by_id = {rt.req_id: rt for rt in loads}
        pinned = engine.pin([self._hooks.rank(rt) for rt in loads])
        for req_id, why in pinned.failed.items():
            self._hooks.fail(by_id[req_id], why)
        if pinned.server_lost:
            self._hooks.lost(next(iter(pinned.failed.values())))
            engine.release(pinned)
            self._hooks.done(loads)
            return
        if not pinned.ready:
            engine.release(pinned)
            self._hooks.done(loads)
            return
        pinned.failed = {}  # reported above; the layer load reports only its own failures
        self._reqs = by_id
        self._step = loads
        self._waited = False
        ll = engine.start_layer_load(pinned)
        self._load = ll
        self.stats.overlap_loads += 1
        for req_id, why in ll.report.failed.items():
            self._hooks.fail(by_id[req_id], why)

    @property
    def in_flight(self) -> bool:
        """A layer load of the current step was issued (``finish`` reports its requests done)."""
        return self._load is not None

    def wait_for_layer(self, index: int | None) -> None:
        """The forward waits until layer ``index`` of the step's load is placed (GPU-side on CUDA);
        None (a layer name the worker does not know): every layer rather than risk a partial read."""
        ll = self._load
        if ll is None:
            return
        self.stats.layer_waits += 1
        self._waited = True
        if index is None or index >= ll.num_layers:
            ll.wait_all()
        else:
            ll.wait_for_layer(index)

    def wait_before_forward(self) -> None:
        """A forward that will not wait per layer (a full-graph replay) waits for every layer of the
        step's load before it starts (GPU-side on CUDA); the load counts as waited for."""
        ll = self._load
        if ll is None:
            return
        self._waited = True
        ll.wait_all()

    def finish(self) -> None:
        """After the forward: account for the step's layer load; failures known now -> recompute.

        Everything queued after the forward waits for every layer (GPU-side on CUDA: the host
        does not block). A load still running on the device keeps its pins until ``done()``
        (``get_finished`` polls it) rather than stall the forward thread here.
        """
        ll, self._load = self._load, None
        if ll is None:
            return
        by_id, self._reqs = self._reqs, {}
        step, self._step = self._step, []
        ll.wait_all()
        taken = self._unwaited(ll) if not self._waited and ll.handle is not None else []
        if not ll.done():
            for req_id in taken:  # a load still running reports no late failure of its own
                self._hooks.fail(by_id[req_id], ll.late_failures[req_id])
            self._releases.append((ll, step))
            self._hooks.account(ll.report, " (layer by layer)", True)
            return
        rep = ll.finish()
        for req_id, why in ll.late_failures.items():
            self._hooks.fail(by_id[req_id], why)
        ll.release()
        self._hooks.done(step)
        self._hooks.account(rep, " (layer by layer)", True)

    def _unwaited(self, ll: LayerByLayerLoad) -> list[str]:
        """The forward ran without waiting for any layer: what it read of the load's requests may
        not have been placed yet. Take every placed request back (reported failed: vLLM discards
        the step's output of them and recomputes, or ends them where it cannot) and say so once,
        loudly. The requests taken back."""
        taken = ll.fail_placed("the forward did not wait for the layer-by-layer load")
        self.stats.layer_loads_unwaited += 1
        if self.stats.layer_loads_unwaited == 1:
            logger.error("Maru: 1 of the %s (%d requests)", UNWAITED, len(taken))
        return taken

    def release(self, wait: bool = False) -> None:
        """Unpin the finished layer loads (every one with ``wait``: shutdown)."""
        keep: list[tuple[LayerByLayerLoad, list[RequestTransfer]]] = []
        for ll, step in self._releases:
            if wait or ll.done():
                ll.release()  # waits only when not done (wait=True); a late failure is logged
                self._hooks.done(step)
            else:
                keep.append((ll, step))
        self._releases = keep
