"""Admission of asynchronous loads on the scheduler side: the window, and loads shared in flight.

With ``maru_async_load`` a hit is loaded while its request waits (WAITING_FOR_REMOTE_KVS), and
vLLM adds the loaded blocks to its own prefix cache only once the load is reported finished. So
requests that arrive together with the same prefix (a system prompt, a conversation continued by
several users) would each load it again: 16 users in one step loaded 16 copies of a 2k-token
system prompt (4.3 GB for 0.27 GB of distinct KV on an 8B geometry), and the bus time showed as
queueing. A request whose next chunk is already being loaded for another request therefore waits
("ask again later") instead: once that load is reported, vLLM's prefix cache holds the chunk and
the request only loads (or computes) what lies beyond it. This needs vLLM's prefix cache; without
it nothing is shared and every hit loads its own copy.
"""

from __future__ import annotations

import collections
import time

SHARED_LOAD_WAIT_S = 2.0  # longest wait for another request's load of the same chunks


class LoadAdmission:
    """The async loads in flight in one engine: whether a new one may start, and which chunk keys
    are already on their way.

    Invariants: ``_loads`` holds exactly the admitted loads not yet finished (``finish``), with the
    number of chunks each counts against the window and the keys it places; ``_keys[k]`` is the
    number of those loads whose keys include ``k`` (no entry for zero). ``_landing`` holds the keys
    of loads finished since the last ``settle``: vLLM caches a finished load's blocks when its
    scheduler next reaches the request, which may come after it asked about a request waiting for
    them, so they count as in flight until the end of that scheduling pass.
    """

    def __init__(self, max_loads: int, max_chunks: int, chunk_tokens: int, share: bool = True) -> None:
        self.max_loads = max_loads
        self.max_chunks = max_chunks
        self.chunk = chunk_tokens
        self.share = share
        self._loads: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._keys: collections.Counter[str] = collections.Counter()
        self._landing: set[str] = set()

    def ids(self) -> set[str]:
        return set(self._loads)

    def chunks_of(self, tokens: int) -> int:
        """Chunks a load of ``tokens`` tokens touches at most (it may start inside one)."""
        return -(-tokens // self.chunk) + 1

    def window_full(self, tokens: int) -> bool:
        """Whether a new load of ``tokens`` tokens must wait (``maru_max_inflight_loads``,
        ``maru_max_inflight_load_chunks``). An empty window always admits: a load larger than the
        window alone still loads, rather than wait for ever."""
        if not self._loads:
            return False
        if len(self._loads) >= self.max_loads:
            return True
        return sum(n for n, _ in self._loads.values()) + self.chunks_of(tokens) > self.max_chunks

    def in_flight(self, key: str) -> bool:
        """Whether an admitted load places ``key`` (and sharing is on): a request needing it next
        gets it from vLLM's prefix cache once that load is reported."""
        return self.share and (key in self._keys or key in self._landing)

    def admit(self, req_id: str, tokens: int, keys: tuple[str, ...]) -> None:
        self.finish(req_id)  # a request has one load in flight at most
        self._loads[req_id] = (self.chunks_of(tokens), keys)
        self._keys.update(set(keys))

    def finish(self, req_id: str) -> bool:
        """Forget ``req_id``'s load (reported finished, failed or not); whether it was in flight."""
        entry = self._loads.pop(req_id, None)
        if entry is None:
            return False
        keys = set(entry[1])
        self._keys.subtract(keys)
        for k in keys:
            if self._keys[k] <= 0:
                del self._keys[k]
        self._landing |= keys
        return True

    def settle(self) -> None:
        """End of a scheduling pass: the loads finished before it are in vLLM's prefix cache now."""
        self._landing.clear()


class SharedWaits:
    """How long each request has waited for another request's load of the chunk it needs next.

    A load in flight is reported within a step or a few (a 16k-token load is ~40 ms of bus), so a
    wait past ``bound_s`` means its report was lost (a case not seen): the request then loads its
    own copy rather than wait for ever. A wait lasts until ``end`` (the request was admitted, or
    nothing it needs is in flight any more); ``timeouts`` counts the waits that ran out, once each.
    """

    def __init__(self, bound_s: float = SHARED_LOAD_WAIT_S) -> None:
        self.bound_s = bound_s
        self.timeouts = 0
        self._since: dict[str, float] = {}
        self._expired: set[str] = set()

    def may_wait(self, req_id: str) -> bool:
        """Whether ``req_id`` may (still) wait; starts its clock on the first call of a wait."""
        now = time.monotonic()
        since = self._since.setdefault(req_id, now)
        if req_id in self._expired:
            return False
        if now - since <= self.bound_s:
            return True
        self._expired.add(req_id)
        self.timeouts += 1
        return False

    def waited(self, req_id: str) -> float:
        """Seconds ``req_id``'s current wait has lasted (0 when it is not waiting)."""
        since = self._since.get(req_id)
        return 0.0 if since is None else time.monotonic() - since

    def end(self, req_id: str) -> None:
        self._since.pop(req_id, None)
        self._expired.discard(req_id)
