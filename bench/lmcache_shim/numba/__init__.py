"""Stand-in for numba on the H200 machine, used only when the real numba is missing
(bench/gpu_lmcache_pass.sh puts this folder on PYTHONPATH then, and says so).

LMCache imports ``numba.njit`` at module level to compile CPU codec kernels (cachegen, the
multiprocess token hasher) that its in-process vLLM connector and storage plugins never call.
``njit`` here returns the Python function unchanged, so those imports succeed; calling one of
those kernels would run plain Python (correct, slow; announced on its first call), which the
benchmark never does.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

__version__ = "0.0-maru-shim"


def njit(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return _announced(args[0])
    return _announced


def _announced(fn: Any) -> Any:
    """``fn`` as plain Python, saying so on its first call (a slow path is never silent)."""

    @functools.wraps(fn)
    def run(*a: Any, **k: Any) -> Any:
        if not run.warned:  # type: ignore[attr-defined]
            run.warned = True  # type: ignore[attr-defined]
            logging.getLogger("maru.bench").warning(
                "numba stand-in: %s.%s runs as plain Python (slow); install numba for LMCache's CPU kernels",
                fn.__module__,
                fn.__qualname__,
            )
        return fn(*a, **k)

    run.warned = False  # type: ignore[attr-defined]
    return run


jit = njit
