"""A Python thread that never sleeps: the GIL competition vLLM's scheduling thread meets beside the
engine's other threads at their busiest (``bench/gil_hashing.py``, ``bench/rpc_gil.py``)."""

from __future__ import annotations

import threading
import time


class BusyThread:
    """``with BusyThread():`` runs pure-Python work until the block ends; it gives the GIL up only
    when the interpreter makes it (the switch interval) or another thread's call releases it."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        x = 0
        while not self._stop.is_set():
            for _ in range(10_000):
                x += 1

    def __enter__(self) -> BusyThread:
        self._thread.start()
        time.sleep(0.05)  # running before the first measurement
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
