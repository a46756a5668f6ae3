"""Maru as an LMCache storage backend (LMCache's storage-plugin interface).

LMCache loads ``maru.lmcache.MaruStorageBackend`` from its YAML; docs/lmcache.md shows the
configuration. Importing this package does not import LMCache; ``MaruStorageBackend`` does, on
first access, so ``maru doctor`` can report what is missing instead of failing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MaruStorageBackend", "lmcache_status"]


def __getattr__(name: str) -> Any:
    if name == "MaruStorageBackend":
        from maru.lmcache.backend import MaruStorageBackend

        return MaruStorageBackend
    raise AttributeError(name)


def lmcache_status() -> tuple[str | None, str | None]:
    """(LMCache's installed version or None, why the backend cannot load or None if it loads)."""
    from importlib import metadata

    try:
        version: str | None = metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        version = None
    try:
        from maru.lmcache.backend import MaruStorageBackend  # noqa: F401
    except Exception as e:
        return version, f"{type(e).__name__}: {e}"
    return version, None
