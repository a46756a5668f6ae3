"""Which vLLM model runner an engine runs (vLLM issue #49250), and advice that names the V1 runner
only where this vLLM still has one.

vLLM 0.26-0.33 have two model runners, chosen by ``VLLM_USE_V2_MODEL_RUNNER`` and reported as
``VllmConfig.use_v2_model_runner``. vLLM 0.34 removed the V1 runner and that flag with it: every
engine runs the V2 runner (CPU too), and ``VLLM_USE_V2_MODEL_RUNNER=0`` stops it at start. A
missing flag must therefore not read as "V1" (the protocol for a runner that recomputes failed
loads, which the V2 runner cannot), and no fix may tell a user to set it there.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"  # the V1 runner; gone from vLLM 0.34


@functools.cache
def has_v1_runner() -> bool:
    """Whether this vLLM still has the V1 model runner (True where vLLM cannot be looked at: the
    advice that names it is then only as wrong as before)."""
    try:
        return importlib.util.find_spec(V1_RUNNER_MODULE) is not None
    except Exception:
        return True


def runs_v2_runner(vllm_config: Any) -> bool:
    """Whether the engine of ``vllm_config`` runs vLLM's V2 model runner. Raises what reading
    ``use_v2_model_runner`` raises where the config has it: the caller cannot tell then."""
    has_flag = hasattr(type(vllm_config), "use_v2_model_runner") or "use_v2_model_runner" in getattr(
        vllm_config, "__dict__", {}
    )
    if has_flag:
        return bool(vllm_config.use_v2_model_runner)
    # No flag: a vLLM with one runner. Without the V1 runner's module that is the V2 runner.
    return not has_v1_runner()


def or_v1_runner(purpose: str = "") -> str:
    """``", or run vLLM with VLLM_USE_V2_MODEL_RUNNER=0<purpose>"`` to end a fix with, where this vLLM
    has the V1 runner; ``""`` where it has none (the setting would stop it at start)."""
    if not has_v1_runner():
        return ""
    return f", or run vLLM with VLLM_USE_V2_MODEL_RUNNER=0{purpose}"
