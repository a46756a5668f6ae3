"""Stand-in for numba on the H200 machine, used only when the real numba is missing
(bench/gpu_lmcache_pass.sh puts this folder on PYTHONPATH then, and says so).

LMCache imports ``numba.njit`` at module level to compile CPU codec kernels (cachegen, the
multiprocess token hasher) that its in-process vLLM connector and storage plugins never call.
``njit`` here returns the Python function unchanged, so those imports succeed; calling one of
those kernels would run plain Python (correct, slow), which the benchmark never does.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.0-maru-shim"


def njit(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda fn: fn


jit = njit
