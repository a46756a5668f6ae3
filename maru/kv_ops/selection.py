"""Which placement implementation runs, and why: chosen per device, announced once.

Rules (the project's "no silent fallback"):
* CUDA tensors + triton importable -> "triton".
* CUDA tensors, triton not importable -> "reference", announced once as a WARNING with the
  import error and the fix (the reference is 4-20x slower on a GPU).
* CPU tensors -> "reference" (normal; announced once at INFO). Triton runs on CPU tensors only
  when explicitly asked for under ``TRITON_INTERPRET=1`` (the tests do this).
* Asking for ``"triton"`` where it cannot run raises ``BackendUnavailable`` with the reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache

from maru.announce import announce_once
from maru.errors import BackendUnavailable

log = logging.getLogger("maru.kv_ops")

BACKENDS = ("reference", "triton")
_FIX = "install triton (pip install 'maru[gpu]', or the triton wheel matching your torch)"


@dataclass(frozen=True)
class BackendChoice:
    """The implementation that runs for tensors on ``device`` and the one-line reason."""

    name: str
    device: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "device": self.device, "reason": self.reason}


@lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """None when triton imports, else the error text (cached: importing is slow and stable)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # any failure (ImportError, a broken install) means "not available"
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_interpreted() -> bool:
    """True when triton runs kernels in its CPU interpreter (must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def choose(device_type: str | None = None) -> BackendChoice:
    """What ``backend=None`` runs for tensors on ``device_type`` ("cuda", "cpu"; None: cuda if present)."""
    if device_type is None:
        device_type = "cuda" if _cuda_available() else "cpu"
    if device_type == "cuda":
        err = triton_import_error()
        if err is None:
            return BackendChoice("triton", "cuda", "CUDA tensors and triton importable")
        return BackendChoice("reference", "cuda", f"triton not importable: {err}; {_FIX}")
    if device_type == "cpu":
        return BackendChoice(
            "reference", "cpu", "no CUDA device (CPU tensors); the PyTorch reference is the CPU path"
        )
    return BackendChoice(
        "reference", device_type, f"{device_type} tensors: Maru's triton kernels target CUDA"
    )


def _announce(choice: BackendChoice) -> None:
    key = f"kv_ops.backend:{choice.device}:{choice.name}"
    if choice.name == "reference" and choice.device == "cuda":
        announce_once(
            log,
            key,
            logging.WARNING,
            "maru.kv_ops: SLOW PATH: placing KV with the PyTorch reference on a GPU; %s",
            choice.reason,
        )
    else:
        announce_once(log, key, logging.INFO, "maru.kv_ops: placing KV with %s", choice)


_RESOLVED: dict[tuple, str] = {}


def resolve(requested: str | None, device_type: str) -> str:
    """The backend name one call uses; raises ``BackendUnavailable`` when the request cannot run.

    Answers are memoised (every public call asks, and the answer is fixed for a process: triton
    imports or not, the interpreter flag is read before triton is imported); the key holds the
    import check itself, so a test's stand-in for it is asked again. Refusals are not memoised."""
    key = (requested, device_type, triton_import_error)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    name = _resolve(requested, device_type)
    _RESOLVED[key] = name
    return name


def _resolve(requested: str | None, device_type: str) -> str:
    if requested is None:
        choice = choose(device_type)
        _announce(choice)
        return choice.name
    if requested not in BACKENDS:
        raise BackendUnavailable(
            f"unknown kv_ops backend {requested!r}; choose one of {BACKENDS} or None (best available)"
        )
    if requested == "reference":
        return requested
    err = triton_import_error()
    if err is not None:
        raise BackendUnavailable(
            f"backend 'triton' was asked for but triton is not importable: {err}; {_FIX}"
        )
    if device_type == "cuda" or (device_type == "cpu" and triton_interpreted()):
        return requested
    raise BackendUnavailable(
        f"backend 'triton' was asked for on {device_type} tensors: the kernels need CUDA tensors (or "
        f"TRITON_INTERPRET=1 set before triton is imported, for testing on the CPU); use backend='reference' or None"
    )
