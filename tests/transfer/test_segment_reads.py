"""Segment sums through the transfer engine (``maru.segments``): stores commit them, a load that
places a chunk's last tokens reads only their segments, and a store whose sums do not add up to
the bytes it wrote publishes nothing.

A real server and shared-memory pool; bytes are changed behind the engine's back by another
process (``flip_behind``). CPU caches: the CPU path (the GPU's direct layer kernel is covered by
the kernel selfcheck and ``tests/kv_ops/test_segments_gpu.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from maru import kv_ops
from maru import segments as sg
from maru.client import MaruHandler
from maru.kv_ops.testing import CacheCase, bits, naive_token
from maru.transfer.engine import KVTransferEngine
from maru.transfer.paths import CpuPath
from maru.transfer.records import ChunkRef, RequestTransfer
from maru.vllm.metadata import MaruConnectorMetadata
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client
from tests.transfer.helpers import BS, CHUNK, case, flip_behind, load_in_mode, request

server = module_server("segments")
client = pool_client()

FMT = ("kv_first", "NHD")


def _case(seed: int) -> CacheCase:
    return case(*FMT, seed, torch.bfloat16)


def _engine(c: CacheCase, client: Any, path: Any = None, segment_tokens: int | None = BS) -> KVTransferEngine:
    layout = kv_ops.detect_layouts(c.caches, **c.detect_kwargs())
    caches = [c.caches] if isinstance(c.caches, torch.Tensor) else c.caches
    return KVTransferEngine(
        caches, layout, client, path=path, chunk_tokens=CHUNK, segment_tokens=segment_tokens
    )


def _row_bytes(eng: KVTransferEngine) -> int:
    """Bytes of one token's row of one plane (an object is [L, KV, T, ROW])."""
    return eng.geometry.nbytes(CHUNK) // (3 * 2 * CHUNK)


def test_stores_commit_segment_sums_that_add_up_to_their_checksums(client: MaruHandler) -> None:
    src = _case(11)
    req = request("seg-commit", [2, 9, 4, 13, 0], 2 * CHUNK + 3)  # a short last chunk: 3 tokens
    eng = _engine(src, client)
    assert eng.path.segment_tokens == BS
    assert eng.store([req]).stored == 3
    got = client.batch_retrieve([c.key for c in req.chunks], segments=True)
    try:
        for r, c in zip(got, req.chunks, strict=True):
            assert r is not None and r.segments is not None
            assert r.segments.tokens == BS and r.segments.fits(c.num_tokens)
            assert r.segments.consistent(r.checksum, r.size) and r.verify()
    finally:
        client.batch_release([r for r in got if r is not None])
    # The default: the cache's block size (here, chunks of two blocks give two segments each).
    assert _engine(src, client, segment_tokens=None).path.segment_tokens == sg.segment_tokens(BS, CHUNK)
    assert _engine(src, client, segment_tokens=0).path.segment_tokens is None


@pytest.mark.parametrize("mode", ["sync", "layers"])
def test_a_partial_load_reads_only_the_segments_it_places(
    mode: str, server: ServerProcess, client: MaruHandler
) -> None:
    src = _case(12)
    req = request(f"seg-read-{mode}", [5, 1, 8, 11], 2 * CHUNK)
    eng = _engine(src, client)
    assert eng.store([req]).stored == 2
    c0 = req.chunks[0]
    # vLLM's own cache holds the first block of chunk 0: segment 0 is neither placed nor read.
    partial = RequestTransfer(
        req.req_id, req.block_ids, (ChunkRef(c0.key, c0.start, c0.num_tokens, BS), req.chunks[1])
    )
    row = _row_bytes(eng)
    flip_behind(server, client, c0.key, 1)  # layer 0, plane 0, token 0: segment 0
    dst = _case(13)
    rep = load_in_mode(_engine(dst, client), [partial], mode)
    assert rep.loaded_req_ids == [req.req_id] and not rep.failed
    assert rep.unread_bytes == BS * row * 3 * 2  # segment 0: BS tokens of 3 layers x 2 planes
    slots = [req.block_ids[t // BS] * BS + t % BS for t in range(BS, 2 * CHUNK)]
    for layer in range(3):
        for kv in range(2):
            for s in slots:
                assert torch.equal(bits(naive_token(dst, layer, kv, s)), bits(naive_token(src, layer, kv, s)))
    # A byte of segment 1 (token BS, placed) changed: caught, the request fails, the entry goes.
    flip_behind(server, client, c0.key, BS * row + 2)
    before = client.integrity()["integrity_failures"]
    bad = load_in_mode(_engine(_case(14), client), [partial], mode)
    assert req.req_id in bad.failed and "checksum" in bad.failed[req.req_id]
    assert client.integrity()["integrity_failures"] == before + 1
    assert client.usage()["pinned"] == 0


def test_without_segment_sums_a_skipped_row_is_still_read(server: ServerProcess, client: MaruHandler) -> None:
    """Entries committed without segment sums (an older writer) are read whole."""
    src = _case(15)
    req = request("seg-none", [3, 6, 10, 15], 2 * CHUNK)
    assert _engine(src, client, segment_tokens=0).store([req]).stored == 2
    c0 = req.chunks[0]
    partial = RequestTransfer(
        req.req_id, req.block_ids, (ChunkRef(c0.key, c0.start, c0.num_tokens, BS), req.chunks[1])
    )
    flip_behind(server, client, c0.key, 1)
    rep = _engine(_case(16), client).load([partial])
    assert req.req_id in rep.failed and not rep.loaded_req_ids


class _ScramblingPath(CpuPath):
    """A store path with a bug: its segment sums are of the cache, its bytes (and checksum) are not."""

    def _gather_one(self, obj: torch.Tensor, slots: torch.Tensor) -> tuple[int | None, Any]:
        cs, segs = super()._gather_one(obj, slots)
        obj.view(torch.uint8)[0, 0, 0, 0] ^= 1  # the bytes it leaves in the pool differ
        from maru.checksum import checksum

        return checksum(obj.reshape(-1).view(torch.uint8).numpy()), segs


def test_a_store_whose_bytes_differ_from_the_cache_publishes_nothing(client: MaruHandler) -> None:
    src = _case(17)
    layout = kv_ops.detect_layouts(src.caches, **src.detect_kwargs())
    caches = [src.caches] if isinstance(src.caches, torch.Tensor) else src.caches
    req = request("seg-scrambled", [7, 2, 12, 14], 2 * CHUNK)
    rep = _engine(src, client, path=_ScramblingPath(caches, layout)).store([req])
    assert rep.stored == 0 and rep.failed == 2
    assert "do not match the KV cache" in (rep.error or "")
    assert client.exists([c.key for c in req.chunks]) == [False, False]
    assert client.usage()["reserved"] == 0  # the objects were handed back


def test_a_worker_reports_its_segment_sums_and_why_it_has_none(
    server: ServerProcess, client: MaruHandler
) -> None:
    """``maru stats`` and ``maru doctor`` show what the connector's stores commit: the segment size,
    and a reason (a slower later load) when a store could not have segment sums."""
    from tests.pool_fixtures import stop_worker
    from tests.transfer.helpers import worker

    w = worker(server, case("kv_first", "NHD", 21))
    try:
        req = request("seg-doctor", [1, 2, 3, 4], 2 * CHUNK)
        w.start_load_kv(None)
        w.wait_for_save(MaruConnectorMetadata(stores=[req]))
        w.flush_stores()
        info = w.data_paths()
        assert info["paths"]["segment_sums"] == f"{BS} tokens"
        assert not [s for s in info["slow"] if "segment sums" in s]
        w.engine.path.no_segments = "a test's reason"
        slow = [s for s in w.data_paths()["slow"] if "segment sums" in s]
        assert len(slow) == 1 and "a test's reason" in slow[0] and "Fix:" in slow[0]
    finally:
        stop_worker(w)


def test_an_engine_over_rows_of_partial_words_says_it_has_no_segment_sums(client: MaruHandler) -> None:
    odd = case("kv_first", "NHD", 22, torch.float16, num_kv_heads=1, head_size=3)  # 6-byte rows
    eng = _engine(odd, client, segment_tokens=None)
    assert eng.path.segment_tokens is None
    assert "not whole 8-byte words" in (eng.path.segments_off() or "")
