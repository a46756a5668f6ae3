"""Chunk keys remembered by vLLM's own block hashes: a prompt's keys without hashing its tokens again.

A new request's chunk keys cost vLLM's scheduling thread ~40 us on the CI machine and 140-170 us on
an H200 host for a ~2.3k-token prompt (packing the token ids, one blake2b a chunk). Most of those
chunks were keyed before: every user's copy of a shared system prompt, and a conversation's earlier
turns, which its next turn repeats. vLLM has already hashed each full block of the request for its
own prefix cache (``request.block_hashes``: a chain, so the hash of a chunk's last block stands for
every token before it). ``ChunkKeyCache`` maps that hash to the chunk's chain digest, so a chunk
seen before costs a dict lookup.

Invariants: the keys are those of ``ChunkKeyer.prompt_keys`` for the same tokens, whatever the
cache holds (a remembered digest is reused only at a block hash vLLM computed over the same
prefix; the first chunk not remembered and all after it are hashed); block hashes that do not
line up with the prompt (another hash block size, none at all) make it hash every chunk; at most
``capacity`` digests are kept (the least recently used go). Its trust in vLLM's block hashes is
vLLM's own: its prefix cache serves KV by the same hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from maru.vllm.keys import ChunkKeyer, MediaItem, PromptKeys

CAPACITY = 65536  # chunk digests remembered (~200 bytes each with the dict's overhead)


class ChunkKeyCache:
    """``prompt_keys`` with the chunks seen before looked up by vLLM's block hash (see the module)."""

    def __init__(self, keyer: ChunkKeyer, block_size: int, capacity: int = CAPACITY) -> None:
        if keyer.chunk_tokens % block_size:
            raise ValueError(f"chunk of {keyer.chunk_tokens} tokens is not whole blocks of {block_size}")
        self.keyer = keyer
        self.block_size = block_size
        self.blocks_per_chunk = keyer.chunk_tokens // block_size
        self.capacity = capacity
        self._digests: OrderedDict[Any, bytes] = OrderedDict()
        self.hits = 0  # chunks whose digest was remembered
        self.hashed = 0  # chunks hashed (not remembered, or no usable block hashes)

    def prompt_keys(
        self,
        prompt: Sequence[int],
        block_hashes: Sequence[Any] | None,
        num_tokens: int,
        salt: str | None = None,
        adapter: bytes | None = None,
        media: tuple[MediaItem, ...] = (),
    ) -> PromptKeys:
        """The keys of every full chunk of ``prompt``. ``block_hashes``: vLLM's, of the request's
        ``num_tokens`` tokens (the prompt, and any output after it); None or inconsistent: hash all.
        ``salt``: the request's ``cache_salt``; ``adapter``: its LoRA adapter's digest. The digests
        of a request with either are remembered under its chain's root too: whatever vLLM puts in
        its hashes (it names an adapter, not its files), one scope's keys never stand for another's.
        ``media``: its multimodal inputs (vLLM's block hashes cover them too: a remembered digest
        is one of the same inputs at the same places)."""
        keyer = self.keyer
        root = keyer.root_for(salt, adapter)
        scope = root if root != keyer.root else None
        n = len(prompt) // keyer.chunk_tokens
        bpc = self.blocks_per_chunk
        usable = block_hashes is not None and len(block_hashes) == num_tokens // self.block_size
        chain: list[bytes] = []
        if usable:
            assert block_hashes is not None
            digests = self._digests
            for c in range(n):
                bh = _scoped(scope, block_hashes[(c + 1) * bpc - 1])
                d = digests.get(bh)
                if d is None:
                    break
                digests.move_to_end(bh)  # recently used: kept longest
                chain.append(d)
        self.hits += len(chain)
        if len(chain) < n:
            parent = chain[-1] if chain else root
            new = keyer.chain_digests(prompt, len(chain), n, parent, media)
            self.hashed += len(new)
            if usable:
                assert block_hashes is not None
                for c, d in enumerate(new, start=len(chain)):
                    self._digests[_scoped(scope, block_hashes[(c + 1) * bpc - 1])] = d
                while len(self._digests) > self.capacity:
                    self._digests.popitem(last=False)
            chain += new
        return PromptKeys(full=[keyer.chain_key(d) for d in chain], chain=chain, root=root, media=media)


def _scoped(scope: bytes | None, block_hash: Any) -> Any:
    """The digest cache's key of a block hash: the hash itself, or (chain root, hash) for a request
    whose chain starts elsewhere (a salt, an adapter)."""
    return (scope, block_hash) if scope is not None else block_hash
