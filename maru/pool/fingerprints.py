"""Key fingerprints of the key index (``maru.pool.key_index``): who can compute which.

A slot of the index holds a key's 64-bit fingerprint. ``PlainFingerprints`` (a server without
``--tenants``) are blake2b of the key: any client computes them. ``KeyedFingerprints`` (under
``--tenants``) are blake2b keyed with a random secret of the key's namespace: the server draws one
per declared namespace at start and gives a client, in its handshake, the secrets of the
namespaces it may read; a key of any other namespace has no fingerprint on that client, which
then asks the server (and the table tells it nothing about such keys).

Each type names the table magic it writes and reads, so a reader of the other kind never takes
the table for its own.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Iterable, Mapping

from maru.protocol import namespace_of

MAGIC = int.from_bytes(b"MARUKIX1", "little")
MAGIC_KEYED = int.from_bytes(b"MARUKIK1", "little")  # an older client reads it as another server's
EMPTY, TOMBSTONE = 0, 1  # slot values no fingerprint takes (TOMBSTONE: the first version's deletes)


def fingerprint(key: str, secret: bytes = b"") -> int:
    """The 64-bit fingerprint a key is stored under (never EMPTY or TOMBSTONE); ``secret``: its
    namespace's, in a keyed table (empty: the plain fingerprint)."""
    v = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, key=secret).digest(), "little")
    return v if v > TOMBSTONE else v + 2


MEMO_KEYS = 1 << 14  # fingerprints remembered per side (~2 MiB of keys); forgotten all at once when full


class _Memo(dict):  # type: ignore[type-arg]
    """Fingerprints computed before, by key. vLLM's scheduler asks about the same keys for every
    request that shares a prefix (a system prompt's chunks: 8 of a 2.4k-token request's 9): a
    dict lookup (~16 ns) instead of a blake2b (~530 ns, CI machine) per key."""

    def get_or(self, key: str, compute: Callable[[str], int | None]) -> int | None:
        fp = self.get(key)
        if fp is None:
            fp = compute(key)
            if fp is not None:
                if len(self) >= MEMO_KEYS:
                    self.clear()
                self[key] = fp
        return fp


class PlainFingerprints:
    """Fingerprints any client computes (a server without ``--tenants``)."""

    magic = MAGIC
    complete = True  # every key has a fingerprint here

    def __init__(self) -> None:
        self._memo = _Memo()

    def of(self, key: str) -> int | None:
        return self._memo.get_or(key, fingerprint)

    def missing(self, keys: Iterable[str]) -> str | None:
        """The first namespace among ``keys`` this side cannot fingerprint: none here."""
        return None


class KeyedFingerprints:
    """Fingerprints keyed per namespace (``--tenants``; see the module docstring).

    ``secrets``: namespace -> secret, the namespaces this side may read. ``fallback``: the server's
    secret for any other namespace (no client has it); a client has none, and a key of a namespace
    it holds no secret for has no fingerprint here (``of`` is None: the server answers it).
    """

    magic = MAGIC_KEYED

    def __init__(self, secrets: Mapping[str, bytes], fallback: bytes | None = None) -> None:
        self.secrets = dict(secrets)
        self._fallback = fallback
        self._memo = _Memo()

    @classmethod
    def drawn(cls, namespaces: Iterable[str]) -> KeyedFingerprints:
        """The server's: a fresh random secret per namespace, and one for every other namespace."""
        return cls({ns: secrets.token_bytes(16) for ns in namespaces}, secrets.token_bytes(16))

    @property
    def complete(self) -> bool:
        """Every key has a fingerprint here (the server's, with its fallback secret)."""
        return self._fallback is not None

    def of(self, key: str) -> int | None:
        return self._memo.get_or(key, self._compute)

    def _compute(self, key: str) -> int | None:
        secret = self.secrets.get(namespace_of(key), self._fallback)
        return None if secret is None else fingerprint(key, secret)

    def missing(self, keys: Iterable[str]) -> str | None:
        """The first namespace among ``keys`` this side holds no secret for (None: it covers them)."""
        if self.complete:
            return None
        for k in keys:
            ns = namespace_of(k)
            if ns not in self.secrets:
                return ns
        return None

    def for_reader(self, namespaces: Iterable[str]) -> dict[str, str]:
        """The wire form of the secrets of ``namespaces`` (those a client may read), hex."""
        return {ns: self.secrets[ns].hex() for ns in namespaces if ns in self.secrets}

    @classmethod
    def from_wire(cls, d: object) -> KeyedFingerprints | None:
        """A client's, from its handshake; None for anything malformed."""
        if not isinstance(d, dict):
            return None
        try:
            got = {str(ns): bytes.fromhex(h) for ns, h in d.items() if isinstance(h, str)}
        except ValueError:
            return None
        if len(got) != len(d) or any(not 1 <= len(v) <= 64 for v in got.values()):
            return None
        return cls(got)


Fingerprints = PlainFingerprints | KeyedFingerprints
