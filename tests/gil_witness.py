"""Seeing whether a call gives the GIL up, without timing anything.

``GilWitness`` runs a thread that counts only while it holds the GIL and gives it back every few
thousand counts (``time.sleep(0)``), so the main thread gets it back quickly after each of those.
With a switch interval far longer than the test and the garbage collector off (``quiet_interpreter``:
a collection may run the finalizer of any unrelated object, which may give the GIL up, e.g. a
socket's close), the witness can count during a call of the main thread only if that call gave
the GIL up.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest


class GilWitness:
    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop:
            for _ in range(2000):
                self.count += 1
            time.sleep(0)

    def __enter__(self) -> GilWitness:
        self._thread.start()
        while self.count == 0:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join(5)

    def gave_up(self, call: Callable[[], object]) -> bool:
        """Whether ``call`` gave the GIL up (the witness counted while it ran)."""
        before = self.count
        call()
        return self.count != before


@pytest.fixture
def quiet_interpreter() -> Iterator[None]:
    before = sys.getswitchinterval()
    gc.collect()
    gc.disable()
    sys.setswitchinterval(30.0)  # no forced switch within a test: only a call that gives the GIL up
    try:
        yield
    finally:
        sys.setswitchinterval(before)
        gc.enable()
