"""``maru_early_load``: a step's layer-by-layer load issued when the step is planned.

vLLM plans a step (its scheduler, then the connector's ``build_connector_meta``) and then prepares
the step's inputs before the forward calls ``start_load_kv``: 3.5-5.7 ms between the two on the
H100 host of the fifty-third pass, with the device idle when the engine was (bench/RESULTS.md).
Where the worker-side connector runs in the scheduler's process and thread (one GPU, vLLM's
in-process executor), the scheduler side hands each step's metadata to it as soon as it is built
(``EarlyLoads.after_plan``), and the worker issues the step's layer load there
(``MaruWorkerConnector.start_early``): the pool is read while vLLM prepares the inputs.
``start_load_kv`` then finds the load started (``MaruConnectorMetadata.early_token``).

It is the same load (``LayerLoads.start``), issued earlier; a step loads at the forward, as without
the setting, unless each of these holds (why):

* the worker registered in this process for this engine (``register``; tensor parallel: never;
  two engines of one process under one ``engine_id``: neither) and is called on the thread its
  forwards run on (vLLM's in-process executor);
* the step's loads go layer by layer (``maru_overlap_load_with_compute``), and the worker's
  previous layer load was finished after its forward;
* vLLM writes none of the step's new blocks before the forward: it zeroes freshly allocated
  blocks for some models (``new_block_ids_to_zero``) and copies a partial prefix hit into a new
  block (``kv_cache_block_copies``) in its input preparation, on the forward's stream, after the
  plan. At the forward, the load's placements come after those writes; planned earlier they could
  race them;
* vLLM is a build whose writes between the plan and the forward were read (``VLLM_TESTED``): on
  another it stays off, said once (``untested_here``);
* the step preempts no request: vLLM frees a preempted request's blocks at once, and a
  write-behind gather may still read them until the worker's preemption barrier, which runs at
  the forward (``handle_preemptions``).

The placements start after the work already queued on the thread's current stream (the previous
step's forward under vLLM's async scheduling), as they do at the forward: a block freed by that
step is rewritten only after it. Where it can never apply (the worker in another process, no
layer-by-layer load) it says so once: at info level under the default (``maru_early_load`` unset:
on where it applies), as a warning where a user set it true.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from typing import Any, Protocol

from maru.versions import VLLM_TESTED, vllm_untested, vllm_version
from maru.vllm.metadata import MaruConnectorMetadata

logger = logging.getLogger("maru.vllm")

_WORKERS: dict[str, weakref.ref] = {}
_AMBIGUOUS: set[str] = set()  # engine ids two live workers registered under (``register``)
_LOCK = threading.Lock()

NO_WORKER = "no worker in this process (tensor parallel or a multi-process executor)"
SHARED_ID = "two engines of this process share the engine id"  # said by ``register``
OTHER_THREAD = "planned on another thread than the forwards"
NOT_LAYERED = "loads are not layer by layer"
UNFINISHED = "the previous layer load is unfinished"
PREEMPTS = "the step preempts a request"
BLOCKS_WRITTEN = "vLLM zeroes or copies new blocks in this step"

# Reasons that hold for every step of the engine (the setting does nothing there): said once each,
# with what to do. The others are a step's own (a preemption, new blocks vLLM writes) and only counted.
NEVER_HERE = {
    NO_WORKER: "the worker-side connector does not run in vLLM's scheduling process (tensor parallel or "
    "a multi-process executor), so each step's load is issued at its forward. Fix: none needed (set "
    "maru_early_load=false to not ask for it)",
    OTHER_THREAD: "vLLM plans steps on another thread than the one its forwards run on (an executor this "
    "module does not know), so each step's load is issued at its forward. Fix: none needed (set "
    "maru_early_load=false to not ask for it)",
    NOT_LAYERED: "this worker does not load layer by layer (CPU caches, asynchronous loads, or "
    "maru_overlap_load_with_compute=false), and only a layer-by-layer load is issued early. Fix: load "
    "layer by layer (the default on GPU caches), or set maru_early_load=false to not ask for it",
}


class EarlyWorker(Protocol):
    """What the hand-off needs of a worker (``MaruWorkerConnector``)."""

    def start_early(self, meta: MaruConnectorMetadata) -> str | None: ...


def register(engine_id: str, worker: EarlyWorker) -> None:
    """The worker-side connector of engine ``engine_id`` lives in this process.

    Two live workers under one id (two engines of one process given the same ``engine_id``) make
    the id ambiguous for good: a step of one engine must never be loaded into the other's caches,
    so neither is found (``worker_of``: None) and their steps load at the forward.
    """
    with _LOCK:
        ref = _WORKERS.get(engine_id)
        held = ref() if ref is not None else None
        if engine_id in _AMBIGUOUS or (held is not None and held is not worker):
            _AMBIGUOUS.add(engine_id)
            _WORKERS.pop(engine_id, None)
            logger.warning(
                "Maru: two engines in this process share the engine id %r: maru_early_load is off for "
                "both (each step's load is issued at its forward). Fix: give each engine its own "
                "kv_transfer_config engine_id, or leave it unset (vLLM makes one per engine)",
                engine_id,
            )
            return
        _WORKERS[engine_id] = weakref.ref(worker)


def unregister(engine_id: str, worker: EarlyWorker) -> None:
    with _LOCK:
        ref = _WORKERS.get(engine_id)
        if ref is not None and ref() in (worker, None):
            del _WORKERS[engine_id]


def worker_of(engine_id: str) -> EarlyWorker | None:
    """The live worker registered under ``engine_id``; None where there is none or the id is ambiguous."""
    with _LOCK:
        ref = _WORKERS.get(engine_id)
    return ref() if ref is not None else None


def untested_here() -> str | None:
    """Why the early load stays off in this process (a vLLM build whose input preparation was not
    read for writes to new blocks), or None."""
    found = vllm_version()
    if found is None:
        return "vLLM's version is unknown"
    dist, version = found
    if vllm_untested(version, dist) is None:
        return None
    tested = ", ".join(f"{d} {r}" for d, r in VLLM_TESTED)
    return f"{dist} {version} is not a build it was checked on (tested: {tested})"


def blocks_written_before_forward(scheduler_output: Any) -> bool:
    """Whether vLLM writes some of this step's new blocks itself between the plan and the forward."""
    return bool(getattr(scheduler_output, "new_block_ids_to_zero", None)) or bool(
        getattr(scheduler_output, "kv_cache_block_copies", None)
    )


class EarlyLoads:
    """The scheduler side's hand-off of each planned step to an in-process worker.

    ``started``: steps whose load was issued at the plan; ``at_forward``: the others with loads,
    by reason (the module docstring lists them).
    """

    def __init__(self, engine_id: str, *, explicit: bool = True) -> None:
        self.engine_id = engine_id
        # Set by the user (maru_early_load=true): what keeps it from applying is a warning; under
        # the default (unset: on where it applies) the same sentence at info level.
        self._say = logger.warning if explicit else logger.info
        self.started = 0
        self.at_forward: Counter[str] = Counter()

    @classmethod
    def for_engine(cls, engine_id: str, *, explicit: bool = True) -> EarlyLoads | None:
        """The hand-off for engine ``engine_id``, or None (said once; a warning if ``explicit``, the
        user set it) where this vLLM build was not checked: a build that writes new blocks between
        the plan and the forward in a way this module does not know would race the loads."""
        why = untested_here()
        if why is not None:
            (logger.warning if explicit else logger.info)(
                "Maru: maru_early_load is off: %s; vLLM writes some new blocks between planning a "
                "step and its forward (zeroing, copy-on-write), and on this build where it does was "
                "not checked. Each step's load is issued at its forward. Fix: a tested vLLM build, or "
                "set maru_early_load=false to not ask for it",
                why,
            )
            return None
        return cls(engine_id, explicit=explicit)

    def after_plan(self, meta: MaruConnectorMetadata, scheduler_output: Any) -> None:
        """Issue ``meta``'s loads now where that is safe (never raises: the forward loads them)."""
        if not meta.loads:
            return
        try:
            why = self._why_not(meta, scheduler_output)
        except Exception as e:  # the worker's own failures are its requests'; anything else: later
            logger.exception("Maru: issuing a step's load at its plan failed; it loads at the forward")
            why = f"{type(e).__name__}"
        if why is None:
            self.started += 1
            return
        self.at_forward[why] += 1
        if self.at_forward[why] == 1 and why in NEVER_HERE:
            self._say("Maru: maru_early_load has no effect here: %s", NEVER_HERE[why])

    def _why_not(self, meta: MaruConnectorMetadata, scheduler_output: Any) -> str | None:
        if meta.preempted_req_ids or getattr(scheduler_output, "preempted_req_ids", None):
            return PREEMPTS
        if blocks_written_before_forward(scheduler_output):
            return BLOCKS_WRITTEN
        worker = worker_of(self.engine_id)
        if worker is None:
            return SHARED_ID if self.engine_id in _AMBIGUOUS else NO_WORKER
        return worker.start_early(meta)

    def snapshot(self) -> dict[str, Any]:
        return {"started": self.started, "at_forward": dict(self.at_forward)}

    def line(self) -> str:
        """For the scheduler's timing line: how many steps loaded at the plan, and where not, why."""
        out = f"{self.started} at the plan"
        if self.at_forward:
            out += ", at the forward: " + ", ".join(
                f"{n} ({why})" for why, n in self.at_forward.most_common()
            )
        return out
