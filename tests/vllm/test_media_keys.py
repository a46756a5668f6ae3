"""Multimodal inputs in the keys (``MediaItem``): a chunk holding part of an image is keyed by the
image's identity and place, chunks before it as a text-only prompt's, and no tail reaches one."""

from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace

import pytest

from maru.vllm.adapters import MULTIMODAL, RequestScope, RequestScopes, media_items
from maru.vllm.key_cache import ChunkKeyCache
from maru.vllm.keys import ChunkKeyer, KeySpace, MediaItem
from maru.vllm.prefix_probe import PrefixProbe

CT, BLOCK = 64, 16  # block != heads != chunk
SPACE = KeySpace("m", "r", "torch.bfloat16", 4, 2, 64, CT)
IMG = 7  # the placeholder id: the same for every image


def prompt_with(rng: random.Random, at: int, length: int, total: int) -> list[int]:
    toks = [rng.randrange(10, 50_000) for _ in range(total)]
    toks[at : at + length] = [IMG] * length
    return toks


def feature(offset: int, length: int, ident: str | None, modality: str = "image") -> SimpleNamespace:
    return SimpleNamespace(
        identifier=ident,
        mm_hash=None,
        modality=modality,
        mm_position=SimpleNamespace(offset=offset, length=length),
    )


def test_chunks_before_an_image_are_a_text_prompts_and_the_rest_are_the_images() -> None:
    keyer = ChunkKeyer(SPACE)
    toks = prompt_with(random.Random(1), 150, 16, 5 * CT)
    a, b = (MediaItem(150, 16, "hash-a", "image"),), (MediaItem(150, 16, "hash-b", "image"),)
    text = keyer.prompt_keys(toks).full
    ka, kb = keyer.prompt_keys(toks, media=a).full, keyer.prompt_keys(toks, media=b).full
    assert ka[:2] == kb[:2] == text[:2]  # 0-127: before the image
    assert all(x != y and x != t for x, y, t in zip(ka[2:], kb[2:], text[2:], strict=True))
    assert keyer.prompt_keys(toks, media=a).full == ka  # the same image: the same keys
    # The same image elsewhere (or another modality with the same hash) is another prompt.
    moved = keyer.prompt_keys(toks, media=(MediaItem(140, 16, "hash-a", "image"),)).full
    assert moved[:2] == text[:2] and not set(moved[2:]) & set(ka)
    audio = keyer.prompt_keys(toks, media=(MediaItem(150, 16, "hash-a", "audio"),)).full
    assert not set(audio[2:]) & set(ka)


def test_an_image_across_a_chunk_boundary_keys_both_chunks() -> None:
    keyer = ChunkKeyer(SPACE)
    toks = prompt_with(random.Random(2), 120, 16, 3 * CT)
    m = (MediaItem(120, 16, "h", "image"),)
    text, keys = keyer.prompt_keys(toks).full, keyer.prompt_keys(toks, media=m).full
    assert keys[0] == text[0] and keys[1] != text[1] and keys[2] != text[2]
    other = keyer.prompt_keys(toks, media=(MediaItem(120, 16, "h2", "image"),)).full
    assert other[1] != keys[1]


def test_plain_tokens_stop_at_the_first_image_not_yet_in_the_chain() -> None:
    keyer = ChunkKeyer(SPACE)
    toks = prompt_with(random.Random(3), 150, 16, 5 * CT)
    k = keyer.prompt_keys(toks, media=(MediaItem(150, 16, "h"), MediaItem(270, 16, "g")))
    assert k.plain_tokens_from(128) == 22  # the first image starts 22 tokens in
    assert k.plain_tokens_from(155) == 0  # inside it
    assert k.plain_tokens_from(192) == 78  # past the first (in the chain), before the second
    assert k.plain_tokens_from(300) is None
    assert keyer.prompt_keys(toks).plain_tokens_from(0) is None


def test_the_probe_never_asks_for_a_tail_reaching_an_image() -> None:
    keyer = ChunkKeyer(SPACE)
    probe = PrefixProbe(keyer, CT, BLOCK)
    toks = prompt_with(random.Random(4), 4 * CT + 40, 16, 4 * CT + 63)
    plain = keyer.prompt_keys(toks)
    with_image = keyer.prompt_keys(toks, media=(MediaItem(4 * CT + 40, 16, "h"),))
    assert [n for _, n, _ in probe.tails_at(toks, plain, 4)] == [16, 32, 48]
    # Tails of 16 and 32 tokens end before the image at 40; 48 would reach it.
    assert [n for _, n, _ in probe.tails_at(toks, with_image, 4)] == [16, 32]
    assert [k for _, n, k in probe.tails_at(toks, with_image, 4)] == [
        k for _, n, k in probe.tails_at(toks, plain, 4)
    ][:2]


def vllm_block_hashes(tokens: list[int], media: tuple[MediaItem, ...], block: int = BLOCK) -> list[bytes]:
    """Block hashes as vLLM makes them for a multimodal prompt: a chain with each block's inputs."""
    out, parent = [], b""
    for b in range(len(tokens) // block):
        lo, hi = b * block, (b + 1) * block
        extra = [(m.identifier, m.offset - lo) for m in media if m.overlaps(lo, hi)]
        parent = hashlib.sha256(parent + repr((tokens[lo:hi], extra)).encode()).digest()
        out.append(parent)
    return out


def test_the_digest_cache_gives_each_images_keys() -> None:
    keyer = ChunkKeyer(SPACE)
    cache = ChunkKeyCache(keyer, BLOCK)
    toks = prompt_with(random.Random(5), 150, 16, 4 * CT + 10)
    for _ in range(2):  # the second round: remembered
        for ident in ("a", "b", None):
            media = (MediaItem(150, 16, ident),) if ident else ()
            got = cache.prompt_keys(toks, vllm_block_hashes(toks, media), len(toks), media=media)
            want = keyer.prompt_keys(toks, media=media)
            assert got.full == want.full and got.media == media
    # Chunks 0-1 (before the image) hashed once for all three; 2-3 once per image and once plain.
    assert cache.hashed == 2 + 3 * 2 and cache.hits == 3 * 4 + (2 * 2)


def test_vllms_features_become_media_items_and_one_without_an_identifier_is_left_to_vllm() -> None:
    items = media_items([feature(56, 16, "h2"), feature(38, 16, "h1")])
    assert items == (MediaItem(38, 16, "h1", "image"), MediaItem(56, 16, "h2", "image"))
    assert media_items([feature(38, 16, None)]) is None
    assert media_items([SimpleNamespace(identifier="h", modality="image", mm_position=None)]) is None
    scopes = RequestScopes()
    req = SimpleNamespace(prompt_token_ids=[1] * 80, cache_salt="t", lora_request=None)
    req.mm_features = [feature(38, 16, "h1")]
    assert scopes.of(req) == RequestScope(salt="t", media=(MediaItem(38, 16, "h1", "image"),))
    req.mm_features = [feature(38, 16, None)]
    assert scopes.of(req) is MULTIMODAL


@pytest.mark.parametrize("n_images", [1, 3])
def test_text_only_prompts_keys_are_unchanged_by_the_media_path(n_images: int) -> None:
    keyer = ChunkKeyer(SPACE)
    toks = prompt_with(random.Random(6), 10, 1, 3 * CT)
    # Images after the last full chunk change nothing of the full chunks' keys.
    media = tuple(MediaItem(3 * CT + i, 1, f"h{i}") for i in range(n_images))
    assert keyer.prompt_keys(toks, media=media).full == keyer.prompt_keys(toks).full
