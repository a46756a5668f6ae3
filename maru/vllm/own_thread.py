"""Set Maru's device state up outside vLLM's memory pools.

vLLM's sleep mode (``enable_sleep_mode``) registers the KV caches with the connector while it routes
the registering thread's CUDA allocations into its KV-cache memory pool (torch's ``use_mem_pool``
routes the current thread only), and a sleep discards that pool without keeping its contents.
What Maru allocates there (the transfer engine's scratch, the tables its captured graphs read)
would then hold garbage after a wake-up, and a load placing through it would place wrong bytes: seen
on an H100 (tests/e2e/test_gpu_vllm_sleep_e2e.py, the load after a sleep gave another output). Made
on a thread of its own, that state comes from torch's default pool, which a sleep does not touch.
Used for engines with vLLM's sleep mode (run on an H100: tests/e2e/test_gpu_vllm_sleep_e2e.py, the
load after a sleep and an engine that never slept give the cold run's output).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[[], T], device: Any = None) -> T:
    """``fn()`` run on a short-lived thread (on CUDA ``device``, if given), its result or its
    exception returned or raised here."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            if device is not None:
                import torch

                torch.cuda.set_device(device)
            out["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name="maru-device-setup", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
