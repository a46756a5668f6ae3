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
from typing import Any

CAPACITY = 16384  # keys (~1.5 MB); far more chunks than a GPU's KV cache holds for one model


class RecentKeys:
    """A bounded set of chunk keys, the least recently noted dropped first."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def note(self, keys: Iterable[str]) -> None:
        """``keys`` are (about to be) in vLLM's cache: loaded, or computed in a step that stores them."""
        _note_recent(self._keys, keys, self.capacity)

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


BLOCK_CAPACITY = 65536  # vLLM block hashes noted (~6 MB; at a chunk's or a turn's end: far past a KV cache)


class RecentBlocks:
    """vLLM's block hashes of the requests that finished lately: a finer guess of vLLM's own hit
    at a request's arrival than ``RecentKeys`` (whose chunks end at the last whole chunk this
    engine placed or stored).

    Why: a conversation's next turn repeats the previous turn's prompt and answer, which vLLM's
    own cache holds up to their last full block, past the last whole chunk. Guessed at that chunk,
    the arrival probe asked about every block-aligned tail after it (15 candidate keys hashed and
    looked up a request, on vLLM's scheduling thread, 16 requests in a row a round); guessed at the
    block, it asks about the tails past the previous answer only. vLLM's block hashes are a chain
    (a block's hash stands for every token before it), so the hash of a new request's block ``i``
    seen in a finished request means that request had the same first ``i + 1`` blocks.

    Only every ``stride``-th block's hash (a chunk's last: ``stride`` blocks a chunk) and the
    request's last computed block's are noted: by the chain, the last stands for the whole turn
    (what a next turn needs), the others for its chunks (a prefix shared with other
    conversations, guessed as ``RecentKeys`` would); noting all 160 of a 2.5k-token turn cost a
    finished request ~30 us of vLLM's scheduling thread on the CI machine.

    Invariant: a guess only, like ``RecentKeys`` (the offer probes again when vLLM's real hit is
    shorter). Block hashes that do not line up with the request's tokens (another hash block size)
    give no guess.
    """

    def __init__(self, block_size: int, stride: int = 1, capacity: int = BLOCK_CAPACITY) -> None:
        if stride < 1:
            raise ValueError(f"stride of {stride} blocks: must be >= 1")
        self.block_size = block_size
        self.stride = stride
        self.capacity = capacity
        self._hashes: OrderedDict[Any, None] = OrderedDict()

    def note(self, request: Any) -> None:
        """``request`` finished: its computed full blocks (prompt and output) are in vLLM's cache
        now. Only those: an aborted request's hashes also cover blocks it never computed."""
        hashes = _lined_up(request, self.block_size)
        if not hashes:
            return
        n = len(hashes)
        computed = getattr(request, "num_computed_tokens", None)
        if isinstance(computed, int):
            n = min(n, max(0, computed) // self.block_size)
        if n == 0:
            return
        noted = list(hashes[self.stride - 1 : n : self.stride])
        if n % self.stride:
            noted.append(hashes[n - 1])
        _note_recent(self._hashes, noted, self.capacity)

    def leading_tokens(self, request: Any) -> int:
        """Tokens of ``request`` a finished request had as its prefix, in whole blocks (0: none)."""
        hashes = _lined_up(request, self.block_size)
        if not hashes or not self._hashes:
            return 0
        d = self._hashes
        for i in range(len(hashes), 0, -1):  # a new turn's own blocks are its last few: from the end
            if hashes[i - 1] in d:
                return i * self.block_size
        return 0

    def __len__(self) -> int:
        return len(self._hashes)


def _note_recent(d: OrderedDict[Any, None], items: Iterable[Any], capacity: int) -> None:
    """Mark ``items`` the most recent in ``d``; the least recent go past ``capacity``."""
    for k in items:
        if k in d:
            d.move_to_end(k)
        else:
            d[k] = None
    while len(d) > capacity:
        d.popitem(last=False)


def _lined_up(request: Any, block_size: int) -> Sequence[Any] | None:
    """``request.block_hashes`` when there is one per full block of its tokens, else None."""
    hashes = getattr(request, "block_hashes", None)
    n = getattr(request, "num_tokens", None)
    if not hashes or not isinstance(n, int) or len(hashes) != n // block_size:
        return None
    return hashes  # type: ignore[no-any-return]
