"""LMCache and vLLM releases whose combination was measured to serve wrong outputs (docs/lmcache.md).

Maru cannot fix these (the KV is placed by LMCache's own connector), but it must not let them pass
silently: the backend logs the sentence at start on a GPU, ``maru doctor`` shows it, and the
client info lists it. Only measured combinations are named; a later LMCache is not assumed broken.
"""

from __future__ import annotations

import re

from maru.versions import installed_version, vllm_version

# Measured on an NVIDIA H200 (2026-12-01): LMCache 0.5.3 and 0.5.6 under vLLM 0.26, with LMCache's own
# CPU tier as with Maru under it. From the oldest to the newest LMCache measured (0.3.12, the one
# release vLLM 0.26's bundled adapter matches, does not load beside torch 2.11 at all: not named);
# from the vLLM that packs K|V.
LMCACHE_FROM = (0, 5, 3)
LMCACHE_UP_TO = (0, 5, 6)
VLLM_FROM = (0, 26)


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string (``"0.26.0+cu130"`` -> (0, 26, 0))."""
    nums = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in nums.group(0).split(".")) if nums else ()


def known_wrong_outputs(lmcache_version: str | None, vllm_version: str | None) -> str | None:
    """The warning for a measured-wrong combination, with its fix; None otherwise."""
    if not lmcache_version or not vllm_version:
        return None
    lmc, vllm = _release(lmcache_version), _release(vllm_version)
    if not lmc or not vllm or not LMCACHE_FROM <= lmc <= LMCACHE_UP_TO or vllm < VLLM_FROM:
        return None
    return (
        f"LMCache {lmcache_version} under vLLM {vllm_version} on a GPU: LMCache's vLLM connector served "
        "outputs that differ from recomputing in Maru's tests (NVIDIA H200; with LMCache's own CPU tier "
        "as with Maru under it): its layout detection swaps block size and KV heads on vLLM's packed "
        "cache, and a run where that cannot matter still differed. Do not serve through LMCache's "
        "connector on this vLLM; Maru's own connector (MaruKVConnector) places the same caches "
        "correctly. docs/lmcache.md"
    )


def installed_known_wrong() -> str | None:
    """``known_wrong_outputs`` for the LMCache and vLLM installed here (distribution versions)."""
    lmc, vllm = installed_version("lmcache"), vllm_version()
    return known_wrong_outputs(lmc and lmc[1], vllm and vllm[1])


def gpu_known_wrong() -> str | None:
    """``installed_known_wrong`` where it applies: a process that sees a CUDA device."""
    import torch

    return installed_known_wrong() if torch.cuda.is_available() else None
