"""ChunkKeyCache: a prompt's chunk keys with the chunks seen before found by vLLM's block hashes.

The block hashes here are made as vLLM makes them (a chain: each block's hash covers its parent's),
with sha256; the real ones are exercised by the CPU vLLM end-to-end tests."""

from __future__ import annotations

import hashlib
import random

import pytest

from maru.vllm.key_cache import ChunkKeyCache
from maru.vllm.keys import ChunkKeyer, KeySpace

BLOCK = 16  # != the heads, != the chunk
SPACE = KeySpace(
    model="m",
    revision="r",
    kv_dtype="torch.bfloat16",
    num_layers=4,
    num_kv_heads=2,
    head_size=64,
    chunk_tokens=64,
)


def block_hashes(tokens: list[int], block: int = BLOCK, salt: bytes = b"") -> list[bytes]:
    out, parent = [], salt
    for b in range(len(tokens) // block):
        parent = hashlib.sha256(parent + repr(tokens[b * block : (b + 1) * block]).encode()).digest()
        out.append(parent)
    return out


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 128_000) for _ in range(n)]


def test_keys_match_the_keyer_and_shared_chunks_are_not_hashed_again() -> None:
    rng = random.Random(3)
    keyer = ChunkKeyer(SPACE)
    cache = ChunkKeyCache(keyer, BLOCK)
    system = rand_tokens(rng, 5 * 64 + 7)  # a shared prefix ending mid-chunk
    histories: list[list[int]] = [[] for _ in range(6)]
    for _ in range(3):  # three turns of six users
        for u in range(6):
            histories[u] += rand_tokens(rng, rng.randrange(1, 150))
            prompt = system + histories[u]
            before = (cache.hits, cache.hashed)
            got = cache.prompt_keys(prompt, block_hashes(prompt), len(prompt))
            want = keyer.prompt_keys(prompt)
            assert got.full == want.full and got.chain == want.chain and got.root == want.root
            assert cache.hits + cache.hashed - sum(before) == len(want.full)
    # Five chunks of the system prompt hashed once in all; each user's earlier turns once.
    assert cache.hits > cache.hashed
    n_chunks = [len(system + h) // 64 for h in histories]
    assert cache.hashed <= 5 + sum(n - 5 for n in n_chunks)


@pytest.mark.parametrize("hashes", ["none", "short", "other block size"])
def test_block_hashes_that_do_not_line_up_are_not_used(hashes: str) -> None:
    rng = random.Random(5)
    keyer = ChunkKeyer(SPACE)
    cache = ChunkKeyCache(keyer, BLOCK)
    prompt = rand_tokens(rng, 4 * 64 + 20)
    bh = {
        "none": None,
        "short": block_hashes(prompt)[:-1],
        "other block size": block_hashes(prompt, block=32),
    }[hashes]
    for _ in range(2):
        assert cache.prompt_keys(prompt, bh, len(prompt)).full == keyer.prompt_keys(prompt).full
    assert cache.hits == 0 and cache.hashed == 8


def test_a_different_earlier_block_never_reuses_a_later_chunk() -> None:
    """Same tokens from chunk 1 on, a different chunk 0: vLLM's chained hashes differ, so nothing
    of the first prompt is reused for the second."""
    rng = random.Random(9)
    keyer = ChunkKeyer(SPACE)
    cache = ChunkKeyCache(keyer, BLOCK)
    a = rand_tokens(rng, 64) + rand_tokens(rng, 3 * 64)
    b = rand_tokens(rng, 64) + a[64:]
    cache.prompt_keys(a, block_hashes(a), len(a))
    got = cache.prompt_keys(b, block_hashes(b), len(b))
    assert got.full == keyer.prompt_keys(b).full
    assert cache.hits == 0
    # The same tokens under another cache salt (vLLM's hashes differ): hashed again, same keys.
    got = cache.prompt_keys(a, block_hashes(a, salt=b"tenant-2"), len(a))
    assert got.full == keyer.prompt_keys(a).full and cache.hits == 0


def test_a_request_with_output_after_its_prompt_uses_the_prompts_blocks() -> None:
    """A resumed request: vLLM's hashes cover its output too; the prompt's chunks are still found."""
    rng = random.Random(11)
    keyer = ChunkKeyer(SPACE)
    cache = ChunkKeyCache(keyer, BLOCK)
    prompt = rand_tokens(rng, 3 * 64 + 5)
    cache.prompt_keys(prompt, block_hashes(prompt), len(prompt))
    everything = prompt + rand_tokens(rng, 40)
    got = cache.prompt_keys(prompt, block_hashes(everything), len(everything))
    assert got.full == keyer.prompt_keys(prompt).full and cache.hits == 3


def test_the_cache_stays_within_its_capacity_and_keeps_the_recent_ones() -> None:
    rng = random.Random(13)
    keyer = ChunkKeyer(SPACE)
    cache = ChunkKeyCache(keyer, BLOCK, capacity=6)
    prompts = [rand_tokens(rng, 2 * 64) for _ in range(10)]
    for p in prompts:
        cache.prompt_keys(p, block_hashes(p), len(p))
    assert len(cache._digests) == 6
    last = prompts[-1]
    hits = cache.hits
    assert cache.prompt_keys(last, block_hashes(last), len(last)).full == keyer.prompt_keys(last).full
    assert cache.hits == hits + 2  # the most recent prompt's two chunks are still there
    first = prompts[0]
    assert cache.prompt_keys(first, block_hashes(first), len(first)).full == keyer.prompt_keys(first).full
    assert cache.hits == hits + 2  # long gone: hashed again


def test_a_chunk_that_is_not_whole_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="not whole blocks"):
        ChunkKeyCache(ChunkKeyer(SPACE), 48)


def test_salted_requests_get_their_salts_keys_even_where_vllms_hashes_ignore_the_salt() -> None:
    """vLLM's ``cache_salt`` isolates requests (tenants): a salted request's keys are the keyer's for
    its salt, never another salt's or the unsalted ones, also when the block hashes it brings are
    the same (a vLLM whose hashes did not include the salt) and the cache holds the others."""
    rng = random.Random(7)
    keyer = ChunkKeyer(SPACE)
    cache = ChunkKeyCache(keyer, BLOCK)
    prompt = rand_tokens(rng, 4 * 64 + 20)
    same_hashes = block_hashes(prompt)
    seen: dict[str | None, list[str]] = {}
    for _ in range(2):  # the second round: every digest remembered
        for salt in (None, "tenant-a", "tenant-b"):
            got = cache.prompt_keys(prompt, same_hashes, len(prompt), salt=salt)
            want = keyer.prompt_keys(prompt, salt=salt)
            assert got.full == want.full and got.root == want.root == keyer.root_for(salt)
            assert seen.setdefault(salt, got.full) == got.full
    assert cache.hits == 3 * 4 and cache.hashed == 3 * 4
    keys = list(seen.values())
    assert all(not set(a) & set(b) for i, a in enumerate(keys) for b in keys[i + 1 :])
