"""``maru_store_yield_to_prefill_ms``: write-behind stores wait for a step without prefill.

A burst of new requests (users arriving together, a conversation's next turns) is prefilled over
several engine steps. A store batch queued at the end of the burst's first step, drained at once,
runs its device work (the gather and the copies) and its drain thread's Python beside the burst's
later prefill steps, and those requests' first tokens pay for it: in real vLLM on an H100 a cold
storing instance paid ~6% of its time to first token (bench/RESULTS.md, sixty-first pass), of it
~2-3% the store's device work and the rest host work, both landing in the prefill
(`bench/gpu_vllm_e2e.py`'s breakdown by vLLM's own timings). Decode steps are short and
memory-bound, and no request waits for its first token in them: there a store's work costs the
time between tokens a little, not the time to the first one.

``PrefillGate`` holds each batch on the drain thread, before its RESERVE round trip and its gather,
until the step that started last schedules no prefill (``MaruConnectorMetadata.prefill``: some
request got more tokens than one plus its speculative ones), or the batch has waited ``hold_s``
since it was queued (an engine that goes idle, or one that is never without a prefill: the store
then goes as it would without the gate), or at once while the gate is open (a flush or a shutdown
waits for the stores, and no step may come).

Invariants:

* A wait never outlives ``hold_s`` from when its batch was queued; ``open`` releases every waiter,
  and the gate stays open until the next step starts.
* A held batch has reserved nothing and read no block: the preemption barrier gathers it on the
  forward thread itself (``KVTransferEngine.wait_store_read``), never waiting for the gate, and
  vLLM's delayed free keeps a finished request's blocks until then (``WriteBehind``). Holding
  changes when a store is made, never its bytes.
* The forward thread only flips a flag under a lock each step (``step_started``).
"""

from __future__ import annotations

import threading
import time
from typing import Any


def prefill_step(scheduler_output: Any) -> bool:
    """Whether vLLM's ``scheduler_output`` schedules any prefill: more tokens than one a request
    plus the speculative ones (a decode step schedules exactly that). O(1) without speculative
    decoding (its per-request drafts are summed otherwise)."""
    counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    if total is None:
        total = sum(counts.values())
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    drafts = sum(len(v) for v in spec.values()) if spec else 0
    return int(total) > len(counts) + drafts


class PrefillGate:
    """Holds write-behind store batches until a step without prefill (see the module docstring).

    ``stats`` (``WorkerStats``) counts ``store_holds`` (batches that found the gate closed),
    ``store_hold_timeouts`` (of those, released by ``hold_s``) and ``store_hold_s`` (their wait).
    """

    def __init__(self, stats: Any, hold_s: float) -> None:
        if hold_s <= 0:
            raise ValueError(f"hold_s must be positive, got {hold_s}")
        self.stats = stats
        self.hold_s = hold_s
        self._cond = threading.Condition()
        self._quiet = True  # no step started yet: nothing to yield to
        self._open = False
        self.waiting = 0  # drain threads blocked in ``wait`` now

    def step_started(self, prefill: bool) -> None:
        """A step's forward is about to run (the forward thread, ``start_load_kv``)."""
        with self._cond:
            self._quiet = not prefill
            self._open = False
            if self._quiet and self.waiting:
                self._cond.notify_all()

    def open(self) -> None:
        """Release every held batch, and the next ones until a step starts (a flush, a shutdown)."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def wait(self, queued_at: float) -> None:
        """Block (the GIL released) until the last step started has no prefill, the gate is open,
        or ``hold_s`` after ``queued_at`` (``time.monotonic()`` when the batch was queued)."""
        with self._cond:
            if self._open or self._quiet:
                return
            t0 = time.monotonic()
            self.waiting += 1
            try:
                passed = self._cond.wait_for(
                    lambda: self._open or self._quiet, max(0.0, queued_at + self.hold_s - t0)
                )
            finally:
                self.waiting -= 1
            self.stats.store_holds += 1
            self.stats.store_hold_timeouts += not passed
            self.stats.store_hold_s += time.monotonic() - t0
