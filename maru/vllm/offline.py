"""Maru with vLLM's in-process engine (``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as
offline inference and RL rollouts often run it): what its callers must let happen between calls.

A write-behind store (the default) holds the blocks of a finished request until the store has read
them; vLLM frees them a step after the worker says so. A served engine keeps stepping on its own;
an in-process one steps only inside ``generate``. So right after ``generate`` returns, vLLM's own
cache reset, ``sleep`` and ``pause_generation(clear_cache=True)`` find blocks still in use and fail
(``RuntimeError: Failed to reset KV cache ...``). ``settle_stores(llm)`` first makes them work.
"""

from __future__ import annotations

import time
from typing import Any


def settle_stores(llm: Any, timeout_s: float = 60.0) -> bool:
    """Publish every write-behind store of ``llm`` (an in-process ``vllm.LLM``) and step it until
    vLLM freed the blocks they held: call it before ``llm.sleep()``, ``pause_generation(clear_cache=
    True)`` or ``reset_prefix_cache(...)``. The stores are published where the worker runs in this
    process (not under tensor parallelism: its workers are processes of their own); the frees are
    settled wherever the scheduler does. It steps the engine: call it with no requests of your own
    in flight (their outputs would be stepped past). Returns whether no block is left held; False
    where ``timeout_s`` ran out, and where vLLM's scheduler is not in this process (vLLM's default
    multi-process engine settles them on its own, and its pause waits for them)."""
    flush_write_behind(timeout_s)
    return settle_delayed_frees(llm, timeout_s) == 0


def settle_delayed_frees(llm: Any, timeout_s: float = 60.0) -> int | None:
    """In-process mode: step the engine until no finished request's blocks wait for a write-behind store.

    ``LLM.generate`` returns when every output is in, but vLLM frees the blocks of a request whose
    free the connector delayed only in a later step, when ``finished_sending`` reports it (a server
    engine keeps stepping on its own while such requests exist). Returns how many are still held;
    0 without Maru's scheduler side, None where vLLM's scheduler is not in this process.
    """
    try:
        core = llm.llm_engine.engine_core
        core = getattr(core, "engine_core", core)
        sched = core.scheduler.connector
    except Exception:
        return None  # vLLM's multi-process engine: the scheduler is in another process
    held = getattr(sched, "maru_scheduler", None)
    if held is None:
        return 0
    deadline = time.monotonic() + timeout_s
    while held.delayed_frees and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.002)  # let the drain thread run
    return len(held.delayed_frees)


def flush_write_behind(timeout_s: float = 60.0) -> bool:
    """In-process mode: wait until every write-behind store submitted so far is published.

    A finished request is reported (and its blocks freed) once its stores have *read* the
    blocks; the publish may still be queued on the drain thread. Whoever needs the stores
    visible (counters, another instance, a reset meant to force Maru hits) waits here.
    Returns False where the worker is not in this process (multi-process mode).
    """
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        w = getattr(get_kv_transfer_group(), "maru_worker", None) if has_kv_transfer_group() else None
    except Exception:
        return False
    if w is None:
        return False
    w.flush_stores(timeout_s)
    return True
