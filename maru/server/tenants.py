"""Who may do what: namespaces with rights per client key, and quotas per namespace.

A key's namespace is the text before its first ``/`` (the connector's keys start with
``<maru_namespace>/``). Two policies, one type each:

- ``OpenAccess`` (no ``--tenants``): every caller may do everything; STATS lists every client.
- ``TenantAccess`` (``--tenants FILE``, needs CURVE): a caller's client key grants rights ``r``
  (LOOKUP, EXISTS, PIN), ``w`` (COMMIT) and ``d`` (DELETE) on named namespaces; a key with no entry
  has none. Each namespace may cap the bytes and objects committed under it. A request that needs a
  right it lacks gets ``denied``, one that would pass a quota gets ``quota``: either way it changes
  nothing. RESERVE needs ``w`` somewhere and may hold at most the room left in the caller's
  roomiest writable namespace. STATS lists only the caller's own sessions unless its key is an
  admin's. Eviction stays global LRU: quotas bound what a tenant holds, pins are per session and
  need ``r``, so no tenant can pin (hold from eviction) or unpin another's keys.

File format (JSON, see docs/security.md)::

    {"admins": ["<z85 key>"],
     "clients": {"<z85 key>": {"name": "host-b", "namespaces": {"team-a": "rwd", "shared": "r"}}},
     "namespaces": {"team-a": {"max_bytes": "16G", "max_objects": 100000}, "shared": {}}}
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maru.config import format_size, parse_size
from maru.errors import ConfigError
from maru.pool.fingerprints import Fingerprints, KeyedFingerprints, PlainFingerprints
from maru.protocol import ErrorCode, Op, namespace_of
from maru.server import validate as V
from maru.server.auth import Caller
from maru.server.registry import Entry, Journal, KeyRegistry

RIGHTS = {"r": "read", "w": "write", "d": "delete"}
_KEY_OPS = {Op.LOOKUP: "r", Op.EXISTS: "r", Op.PIN: "r", Op.DELETE: "d"}


class OpenAccess:
    """No tenants: every caller may do everything."""

    def attach(self, registry: KeyRegistry) -> None:
        pass

    def check(self, op: int, caller: Caller, body: dict[str, Any], registry: KeyRegistry) -> None:
        pass

    def may_see(self, viewer: Caller, owner: Any) -> bool:
        return True

    def index_fingerprints(self) -> Fingerprints:
        """How the key index fingerprints keys: plainly (every caller may read every key)."""
        return PlainFingerprints()

    def readable(self, caller: Caller) -> list[str] | None:
        """Namespaces whose key-index secrets ``caller`` gets: None, there are none."""
        return None


@dataclass
class NamespaceUsage:
    max_bytes: int | None = None
    max_objects: int | None = None
    bytes: int = 0
    objects: int = 0

    def room(self) -> int | None:
        return None if self.max_bytes is None else max(0, self.max_bytes - self.bytes)


class _UsageJournal:
    """Forwards the registry's journal calls and keeps committed bytes and objects per namespace."""

    def __init__(self, inner: Journal, usage: dict[str, NamespaceUsage]) -> None:
        self._inner = inner
        self._usage = usage
        self._sizes: dict[str, int] = {}  # committed key -> size, for keys of quota'd namespaces

    def count(self, key: str, size: int) -> None:
        u = self._usage.get(namespace_of(key))
        if u is not None:
            u.bytes += size
            u.objects += 1
            self._sizes[key] = size

    def __getattr__(self, name: str) -> Any:
        # Everything but the calls that change usage goes to the real journal unchanged.
        return getattr(self._inner, name)

    def put(self, entry: Entry) -> None:
        self._inner.put(entry)
        self.count(entry.key, entry.size)

    def discard_puts(self, keys: list[str]) -> None:
        # Undone commits (the state disk refused them) no longer count against their namespace.
        self._inner.discard_puts(keys)
        for key in keys:
            self._uncount(key)

    def remove(self, key: str) -> None:
        self._inner.remove(key)
        self._uncount(key)

    def _uncount(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            u = self._usage[namespace_of(key)]
            u.bytes -= size
            u.objects -= 1


class TenantAccess:
    """Rights per client key and quotas per namespace (see the module docstring)."""

    def __init__(self, config: dict[str, Any], source: str = "--tenants") -> None:
        self.admins: set[str] = set()
        self.rights: dict[str, dict[str, str]] = {}  # key -> namespace -> letters
        self.usage: dict[str, NamespaceUsage] = {}
        self._parse(config, source)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantAccess:
        try:
            config = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read --tenants {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--tenants {path} is not valid JSON: {e}") from None
        return cls(config, f"--tenants {path}")

    def _parse(self, config: Any, source: str) -> None:
        def bad(what: str) -> ConfigError:
            return ConfigError(f"{source}: {what} (format: docs/security.md)")

        if not isinstance(config, dict):
            raise bad("the top level must be an object")
        unknown = set(config) - {"admins", "clients", "namespaces"}
        if unknown:
            raise bad(f"unknown fields {sorted(unknown)}; the fields are admins, clients, namespaces")
        for ns, spec in (config.get("namespaces") or {}).items():
            if not ns or "/" in ns or not isinstance(spec, dict):
                raise bad(f"namespace {ns!r} must be a name without '/' mapped to an object")
            extra = set(spec) - {"max_bytes", "max_objects"}
            if extra:
                raise bad(f"namespace {ns!r} has unknown fields {sorted(extra)}; use max_bytes, max_objects")
            try:
                mb = parse_size(spec["max_bytes"]) if spec.get("max_bytes") is not None else None
            except ConfigError as e:
                raise bad(f"namespace {ns!r}: max_bytes: {e}") from None
            mo = spec.get("max_objects")
            if mo is not None and (type(mo) is not int or mo < 0):
                raise bad(f"namespace {ns!r}: max_objects must be a non-negative integer, got {mo!r}")
            self.usage[ns] = NamespaceUsage(mb, mo)
        for key, spec in (config.get("clients") or {}).items():
            if not isinstance(spec, dict) or not isinstance(spec.get("namespaces", {}), dict):
                raise bad(f"client {key[:8]}...: must be an object with a 'namespaces' object")
            grants: dict[str, str] = {}
            for ns, letters in spec.get("namespaces", {}).items():
                if ns not in self.usage:
                    raise bad(
                        f"client {key[:8]}... names namespace {ns!r}, which 'namespaces' does not declare"
                    )
                if not isinstance(letters, str) or set(letters) - set(RIGHTS):
                    raise bad(
                        f"client {key[:8]}... namespace {ns!r}: rights must be letters of 'rwd', got {letters!r}"
                    )
                grants[ns] = letters
            self.rights[self._key(key, bad)] = grants
        for key in config.get("admins") or []:
            self.admins.add(self._key(key, bad))

    @staticmethod
    def _key(key: Any, bad: Any) -> str:
        if not isinstance(key, str) or len(key) != 40:
            raise bad(f"{key!r} is not a z85 client public key (40 characters, from its .key file)")
        return key

    # -- wiring -------------------------------------------------------------------------------

    def attach(self, registry: KeyRegistry) -> None:
        """Count what the registry holds now and follow its changes (wraps its journal)."""
        journal = _UsageJournal(registry.journal, self.usage)
        for key in registry.lru_keys():  # at start every entry is unpinned, so this is all of them
            e = registry.peek(key)
            if e is not None:
                journal.count(key, e.size)
        registry.journal = journal

    # -- checks -------------------------------------------------------------------------------

    def _deny(self, caller: Caller, right: str, ns: str, key: str) -> V.Reject:
        who = f"client key {caller.user[:8]}..." if caller.user else "an anonymous client"
        return V.Reject(
            ErrorCode.DENIED,
            f"{who} has no {RIGHTS[right]} right on namespace {ns!r} (key {key[:60]!r}); "
            "keys are '<namespace>/...': ask the operator to grant it in the --tenants file",
        )

    def _check_keys(self, caller: Caller, keys: Iterable[str], right: str) -> None:
        grants = self.rights.get(caller.user, {})
        seen: set[str] = set()
        for k in keys:
            ns = namespace_of(k) if type(k) is str else ""
            if ns in seen:
                continue
            if right not in grants.get(ns, ""):
                raise self._deny(caller, right, ns, k if type(k) is str else repr(k))
            seen.add(ns)

    def check(self, op: int, caller: Caller, body: dict[str, Any], registry: KeyRegistry) -> None:
        """Raise ``Reject`` (denied/quota) if ``caller`` may not do ``op`` with ``body``; else nothing.

        Runs before the handler, so a refused request changes nothing. Field shapes are checked
        again by the handler; here a malformed field is simply not matched.
        """
        right = _KEY_OPS.get(op)
        if right is not None:
            if op == Op.LOOKUP and body.get("pin") is True:
                right = "r"
            self._check_keys(caller, V.keys_field(body), right)
        elif op == Op.COMMIT:
            self._check_commit(caller, V.list_field(body, "items"), registry)
        elif op == Op.RESERVE:
            self._check_reserve(caller, V.list_field(body, "sizes"), registry)

    def _check_commit(self, caller: Caller, items: list[Any], registry: KeyRegistry) -> None:
        keys = [it[0] for it in items if type(it) is list and len(it) == 2 and type(it[0]) is str]
        self._check_keys(caller, keys, "w")
        add: dict[str, list[int]] = {}
        for it in items:
            if type(it) is not list or len(it) != 2 or type(it[0]) is not str or type(it[1]) is not int:
                continue
            key, alloc_id = it
            r = registry.reservation(alloc_id)
            if r is None or r.client != caller or registry.peek(key) is not None:
                continue  # unknown_alloc or present: adds nothing
            u = add.setdefault(namespace_of(key), [0, 0])
            u[0] += r.size
            u[1] += 1
        for ns, (nbytes, nobj) in add.items():
            q = self.usage[ns]
            if q.max_bytes is not None and q.bytes + nbytes > q.max_bytes:
                raise V.Reject(
                    ErrorCode.QUOTA,
                    f"namespace {ns!r} holds {format_size(q.bytes)} of its {format_size(q.max_bytes)} quota; "
                    f"this commit adds {format_size(nbytes)}: delete keys of {ns!r} or raise its max_bytes",
                )
            if q.max_objects is not None and q.objects + nobj > q.max_objects:
                raise V.Reject(
                    ErrorCode.QUOTA,
                    f"namespace {ns!r} holds {q.objects} of its {q.max_objects} objects quota; this commit "
                    f"adds {nobj}: delete keys of {ns!r} or raise its max_objects",
                )

    def _check_reserve(self, caller: Caller, sizes: list[Any], registry: KeyRegistry) -> None:
        writable = [ns for ns, letters in self.rights.get(caller.user, {}).items() if "w" in letters]
        if not writable:
            raise V.Reject(
                ErrorCode.DENIED,
                f"client key {caller.user[:8]}... has no write right on any namespace; grant one in --tenants",
            )
        rooms = [self.usage[ns].room() for ns in writable]
        if any(r is None for r in rooms):
            return
        room = max(r for r in rooms if r is not None)
        want = sum(s for s in sizes if type(s) is int and s > 0)
        held = registry.reserved_bytes_of(lambda c: getattr(c, "user", None) == caller.user)
        if held + want > room:
            raise V.Reject(
                ErrorCode.QUOTA,
                f"reserving {format_size(want)} on top of {format_size(held)} already reserved is over the "
                f"{format_size(room)} left in this client's writable namespaces ({', '.join(writable)}); "
                "commit or abort reservations, delete keys, or raise the quota",
            )

    def index_fingerprints(self) -> Fingerprints:
        """Keyed per declared namespace: a caller gets the secrets of those it may read
        (``readable``), so the shared key index answers it for those alone."""
        return KeyedFingerprints.drawn(self.usage)

    def readable(self, caller: Caller) -> list[str] | None:
        return [ns for ns, letters in self.rights.get(caller.user, {}).items() if "r" in letters]

    def may_see(self, viewer: Caller, owner: Any) -> bool:
        """Whether ``viewer`` may see the session ``owner`` in STATS (its own, or everything if admin)."""
        return viewer.user in self.admins or getattr(owner, "user", None) == viewer.user
