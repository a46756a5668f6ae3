"""The chunk keys this engine placed in vLLM's cache lately: a guess of vLLM's own prefix hit at a
request's arrival, before vLLM computes it.

Why: pins posted at a request's arrival (``OfferPins.prefetch``) happen before vLLM says how much of
the prompt its own prefix cache holds, and what it holds is never loaded. Probing and pinning every
chunk the pool has made each arrival ask for the shared system prompt and a conversation's earlier
turns again (and made a storing instance pin its own stores): more probe keys, more pins for the
server, for nothing. The chunks this engine itself loaded or computed and stored recently are,
usually, still in vLLM's cache: the leading run of them is taken as vLLM's hit.

Invariant: only a guess, never trusted for correctness. The scheduler probes with it as vLLM's hit
(``RequestState.probed_local``); when vLLM's real hit is shorter (it evicted some of them), the
request is probed again at its offer and what is missing is pinned at the offer, as without the
guess.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

CAPACITY = 16384  # keys (~1.5 MB); far more chunks than a GPU's KV cache holds for one model


class RecentKeys:
    """A bounded set of chunk keys, the least recently noted dropped first."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def note(self, keys: Iterable[str]) -> None:
        """``keys`` are (about to be) in vLLM's cache: loaded, or computed in a step that stores them."""
        d = self._keys
        for k in keys:
            if k in d:
                d.move_to_end(k)
            else:
                d[k] = None
        while len(d) > self.capacity:
            d.popitem(last=False)

    def leading(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` (a prompt's full chunks, in order) lead the prompt noted."""
        d = self._keys
        n = 0
        for k in keys:
            if k not in d:
                break
            n += 1
        return n

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
