"""Pool keys for LMCache's cache keys.

    key = "lmcache/" + namespace + "/" + CacheEngineKey.to_string() + "/lmc1"

``to_string`` carries everything LMCache puts in a key (model name, world size, worker id, chunk
hash, KV dtype, tags), so two LMCache instances share a chunk exactly when LMCache would.
Invariant: no key of Maru's own vLLM connector equals one of these. Its keys end in a hex digest,
a ``.t<n>`` tail marker or an ``@<rank>`` suffix, never in ``/lmc1``; the readable ``lmcache/``
prefix only helps ``maru stats``. A key longer than the protocol allows is shortened to a
digest of itself, keeping the prefix and the suffix (deterministic across processes).
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol

from maru.protocol import MAX_KEY_BYTES

SUFFIX = "/lmc1"


class HasToString(Protocol):
    def to_string(self) -> str: ...


def pool_key(cache_key: HasToString | Any, namespace: str = "") -> str:
    """The pool key of one LMCache ``CacheEngineKey`` (anything with ``to_string()``)."""
    head = f"lmcache/{namespace}/"
    body = cache_key.to_string()
    key = head + body + SUFFIX
    if len(key.encode()) <= MAX_KEY_BYTES:
        return key
    return head + "sha256:" + hashlib.sha256(body.encode()).hexdigest() + SUFFIX


def is_lmcache_key(key: str) -> bool:
    """Whether ``key`` was made by ``pool_key`` (the suffix is the guarantee, not the prefix)."""
    return key.startswith("lmcache/") and key.endswith(SUFFIX)
