"""Chunk keys: which bytes in the pool belong to which token prefix.

A key names the KV of one *prefix* of a prompt, not of a chunk's tokens alone, because a
token's K and V depend on every token before it. Keys are chained:

    h[-1] = sha256(namespace)                       (32 bytes; see ``KeySpace``)
    h[i]  = blake2b(b"C" + h[i-1] + tokens of chunk i as int64 LE, 16 bytes)
    tail  = blake2b(b"T" + h[i-1] + the first n tokens of chunk i,  16 bytes)

so computing every key of a prompt is linear in its length, and two prompts share the key of
chunk i exactly when they share every token up to the end of chunk i. A request with vLLM's
``cache_salt`` (per-request isolation of the prefix cache, e.g. per tenant) starts its chain at
``blake2b(b"S" + h[-1] + salt)`` instead (``ChunkKeyer.root_for``): it shares keys only with
requests of the same salt, as in vLLM's own prefix cache. A LoRA request's chain starts at
``blake2b(b"A" + h[-1] + adapter digest)`` (the digest of its adapter's files,
``maru.vllm.adapters``), salted after that when it has a salt too. A chunk that holds part of a
multimodal input (an image's placeholder tokens) hashes the input's identity and place after its
tokens (``MediaItem``); a tail never reaches an input. A *tail* key names a
partial chunk (the block-aligned end of one prompt, ``n < chunk_tokens`` tokens); the domain
bytes ``C``/``T`` keep a tail of ``chunk_tokens`` tokens from ever equalling a full chunk key.

Hashing uses hashlib only, never Python's ``hash()``: keys are identical across processes,
hosts and ``PYTHONHASHSEED`` values.

The namespace covers everything that makes the stored bytes differ for the same tokens:
model id and revision, KV dtype, number of layers, KV heads, head size, chunk tokens,
tensor-parallel rank and size (each rank stores its own head shard), the stored format's
version, an optional tenant namespace, what the engine computes KV with beyond the checkpoint
(``KeySpace.compute``), and the engine's key epoch (empty until vLLM resets the connector's cache:
see ``KeySpace.epoch``). Block size and the attention backend's layout are
deliberately *not* in it: stored bytes are canonical (``[L, 2, T, NH*HS]``, token-major), so
instances with different block sizes or backends of the same model share one cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# Bump when the stored object's byte layout changes (kv_ops' canonical [L, 2, T, NH*HS]).
FORMAT_VERSION = "maru-kv-L2TD-v1"
_DIGEST_SIZE = 16

# CPython's hashlib gives the GIL up for any one input of HASHLIB_GIL_MINSIZE (2048) bytes or more
# and must take it back after. Beside a Python thread that is running (vLLM's input and output
# threads, Maru's worker threads in a one-GPU engine) taking it back waits for that thread's
# switch interval, 5 ms. A 256-token chunk is 2081 bytes to hash, and vLLM's scheduling thread
# hashes a prompt's chunks for every new request: 9 chunks of a 2.3k-token prompt took 5.1 ms
# beside a busy thread instead of 28 us (bench/gil_hashing.py). Input is therefore fed in pieces
# below that size: the same digest, the GIL kept throughout (62 us beside the busy thread).
_HASH_PIECE = 2047


def _digest(head: bytes, body: bytes | memoryview) -> bytes:
    """blake2b(head + body) of ``_DIGEST_SIZE`` bytes, no single input reaching the GIL threshold."""
    h = hashlib.blake2b(head, digest_size=_DIGEST_SIZE)
    _feed(h, body)
    return h.digest()


def _feed(h: Any, body: bytes | memoryview) -> None:
    """``h.update(body)`` in pieces of at most ``_HASH_PIECE`` bytes (see the constant)."""
    if len(body) <= _HASH_PIECE:
        h.update(body)
        return
    view = memoryview(body)  # slices without copies
    for at in range(0, len(body), _HASH_PIECE):
        h.update(view[at : at + _HASH_PIECE])


@dataclass(frozen=True)
class KeySpace:
    """What must match for two instances to share KV bytes. Its digest seeds every chain."""

    model: str
    revision: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    chunk_tokens: int
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""
    format_version: str = FORMAT_VERSION
    # Set when vLLM resets the connector's cache (a weight update, a sleep): a fresh random value,
    # so this engine's keys from then on match nothing stored before (``MaruSchedulerConnector.
    # reset_cache``). Empty: the keys every engine of the same model derives at start.
    epoch: str = ""
    # What the engine computes KV with beyond the checkpoint that ``model`` and ``revision`` name:
    # weight quantization, vLLM's ``hf_overrides`` (a RoPE scaling, say), the model's dtype where
    # the KV cache has its own (``maru.vllm.engine_config.compute_overrides``). Empty: none.
    compute: str = ""

    def digest(self) -> bytes:
        """sha256 of the fields as canonical JSON (sorted keys): stable across processes and hosts.
        An empty ``epoch`` or ``compute`` is left out, so the keys of an engine with neither are
        those it had before the fields existed."""
        fields = asdict(self)
        for optional in ("epoch", "compute"):
            if not fields[optional]:
                del fields[optional]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).digest()

    def prefix(self) -> str:
        """The readable start of every key of this space, e.g. ``"kv1/3fa2.../"`` (tenant first if set)."""
        tenant = f"{self.tenant}/" if self.tenant else ""
        return f"{tenant}kv1/{self.digest().hex()[:16]}/"


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as int64 little-endian. A list goes through ``struct`` (4x faster than numpy's
    conversion of Python ints: 16 against 61 us for 2400 tokens, paid on vLLM's scheduling thread);
    anything else (arrays, tensors) through numpy. The bytes are the same either way."""
    if type(token_ids) is list or type(token_ids) is tuple:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    return np.asarray(token_ids, dtype="<i8").tobytes()


@dataclass(frozen=True)
class MediaItem:
    """A multimodal input's placeholder tokens, ``[offset, offset + length)`` of the prompt: their
    K and V (and every later token's) depend on the input that ``identifier`` names (vLLM's hash
    of its content, ``mm_features[i].identifier``), not on the placeholder ids."""

    offset: int
    length: int
    identifier: str
    modality: str = ""

    def overlaps(self, begin: int, end: int) -> bool:
        return self.offset < end and begin < self.offset + self.length

    def code(self, chunk_start: int) -> bytes:
        """What a chunk starting at ``chunk_start`` that holds part of the item mixes into its digest."""
        where = struct.pack("<qq", self.offset - chunk_start, self.length)
        return b"M" + self.modality.encode() + b"\0" + self.identifier.encode() + b"\0" + where


@dataclass(frozen=True)
class PromptKeys:
    """The keys of one prompt: one per full chunk, and the chain digests they come from.

    ``chain[i]`` is ``h[i]``; ``parent(i)`` is ``h[i-1]`` (the namespace digest for i == 0).
    ``media``: the prompt's multimodal inputs, mixed into the digest of each chunk they overlap.
    """

    full: list[str]
    chain: list[bytes]
    root: bytes
    media: tuple[MediaItem, ...] = ()

    def parent(self, chunk_index: int) -> bytes:
        return self.root if chunk_index == 0 else self.chain[chunk_index - 1]

    def plain_tokens_from(self, start: int) -> int | None:
        """How many tokens from ``start`` on come before the first multimodal input that ends after
        ``start`` (None: none does). A tail key names tokens only, so a tail may not reach it."""
        ahead = [m.offset for m in self.media if m.offset + m.length > start]
        return max(0, min(ahead) - start) if ahead else None


class ChunkKeyer:
    """Computes chunk and tail keys for one ``KeySpace``. Stateless apart from the space."""

    def __init__(self, space: KeySpace) -> None:
        self.space = space
        self.chunk_tokens = space.chunk_tokens
        self._root = space.digest()
        self._prefix = space.prefix()

    def prompt_keys(
        self,
        token_ids: Sequence[int],
        num_chunks: int | None = None,
        salt: str | None = None,
        adapter: bytes | None = None,
        media: tuple[MediaItem, ...] = (),
    ) -> PromptKeys:
        """Keys of the first ``num_chunks`` full chunks (default: every full chunk of ``token_ids``),
        of a request with vLLM's ``cache_salt`` ``salt``, the LoRA adapter whose files digest to
        ``adapter`` (None or empty: none) and the multimodal inputs ``media``."""
        ct = self.chunk_tokens
        n = len(token_ids) // ct if num_chunks is None else num_chunks
        if n * ct > len(token_ids):
            raise ValueError(f"{n} chunks of {ct} tokens need {n * ct} tokens, got {len(token_ids)}")
        root = self.root_for(salt, adapter)
        chain = self.chain_digests(token_ids, 0, n, root, media)
        return PromptKeys(full=[self._prefix + h.hex() for h in chain], chain=chain, root=root, media=media)

    def root_for(self, salt: str | None, adapter: bytes | None = None) -> bytes:
        """The chain's start for a request with vLLM's ``cache_salt`` ``salt`` and a LoRA adapter
        whose files digest to ``adapter``: the key space's digest with neither; otherwise a digest
        of it and each that is set, the adapter first (no chain of one adapter or salt meets a
        chain without it or of another)."""
        root = self._root
        if adapter:
            root = _digest(b"A" + root, adapter)
        if salt:
            root = _digest(b"S" + root, salt.encode())
        return root

    def chain_key(self, digest: bytes) -> str:
        """The chunk key of a chain digest."""
        return self._prefix + digest.hex()

    @property
    def root(self) -> bytes:
        """The chain's start: the key space's digest (the parent of chunk 0)."""
        return self._root

    def chain_digests(
        self,
        token_ids: Sequence[int],
        start: int,
        stop: int,
        parent: bytes,
        media: tuple[MediaItem, ...] = (),
    ) -> list[bytes]:
        """The chain digests of full chunks ``start`` to ``stop - 1`` of ``token_ids``, the chunk
        before ``start`` having digest ``parent`` (the root for ``start`` 0). A chunk that holds part
        of a multimodal input of ``media`` mixes the input's identity and place in after its tokens
        (chunks before the first input are keyed as a text-only prompt's: they share with it)."""
        ct = self.chunk_tokens
        data = memoryview(_token_bytes(token_ids[start * ct : stop * ct]))
        step = ct * 8
        # Each chunk's bytes in pieces at the same offsets (``_HASH_PIECE``), worked out once.
        cuts = [(a, min(a + _HASH_PIECE, step)) for a in range(0, step, _HASH_PIECE)]
        blake2b = hashlib.blake2b
        chain: list[bytes] = []
        prev = parent
        for c, base in enumerate(range(0, (stop - start) * step, step), start=start):
            h = blake2b(b"C" + prev, digest_size=_DIGEST_SIZE)
            for a, b in cuts:
                h.update(data[base + a : base + b])
            for m in media:
                if m.overlaps(c * ct, (c + 1) * ct):
                    h.update(m.code(c * ct))
            prev = h.digest()
            chain.append(prev)
        return chain

    def tail_key(self, parent: bytes, tail_token_ids: Sequence[int]) -> str:
        """Key of a partial chunk: the tokens after the chunk boundary whose chain digest is ``parent``."""
        n = len(tail_token_ids)
        if not 0 < n < self.chunk_tokens:
            raise ValueError(f"a tail has 1..{self.chunk_tokens - 1} tokens, got {n}")
        h = _digest(b"T" + parent, _token_bytes(tail_token_ids))
        return f"{self._prefix}{h.hex()}.t{n}"

    def tail_candidates(
        self, parent: bytes, tokens_after: Sequence[int], step: int, longer_than: int = 0
    ) -> list[tuple[int, str]]:
        """Tail keys of length ``step, 2*step, ...`` up to ``len(tokens_after)`` (below one chunk),
        those longer than ``longer_than`` tokens only.

        Computed incrementally (one pass over the tokens), so probing every block-aligned tail
        of a chunk costs about as much as hashing the chunk once.
        """
        limit = min(len(tokens_after), self.chunk_tokens - 1)
        out: list[tuple[int, str]] = []
        if limit < step:
            return out
        data = memoryview(_token_bytes(tokens_after[:limit]))
        h = hashlib.blake2b(b"T" + parent, digest_size=_DIGEST_SIZE)
        feed = h.update if step * 8 <= _HASH_PIECE else functools.partial(_feed, h)
        done = 0
        for n in range(step, limit + 1, step):
            feed(data[done * 8 : n * 8])
            done = n
            if n > longer_than:
                out.append((n, f"{self._prefix}{h.copy().hexdigest()}.t{n}"))
        return out


def rank_keys(key: str, tp_size: int) -> list[str]:
    """The per-rank keys of one chunk: with tensor parallelism each rank stores its own head shard."""
    return [key] if tp_size == 1 else [f"{key}@{r}" for r in range(tp_size)]
