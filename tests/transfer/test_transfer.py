"""The transfer engine (maru.transfer) on synthetic caches of every layout, against a real server.

No vLLM: caches are built the way vLLM builds them (physical order, viewed back), with block
size != number of heads so a swapped axis cannot hide. Each test stores a request's chunks from
one cache and loads them into a *different*, poisoned cache under a different block table, then
checks every placed token through the naive per-format oracle and every other byte untouched.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from maru.client import MaruHandler
from maru.kv_ops.testing import CacheCase, naive_token
from maru.transfer.records import (
    ChunkRef,
    RequestTransfer,
    block_table,
    chunk_slots,
    many_chunk_slots,
    slot_mapping,
)
from tests.helpers import ServerProcess, reported_slow
from tests.pool_fixtures import module_server, pool_client, release_pool, stop_worker
from tests.transfer.helpers import BS, CHUNK, bits_equal, case, plain_engine, request, worker

server = module_server("transfer")
client = pool_client()


CASES = [
    ("kv_first", "NHD"),
    ("kv_first", "HND"),
    ("blocks_first", "NHD"),
    ("blocks_first", "HND"),
    ("packed", "HND"),
    ("cpu_attn", "NHD"),
    ("mla", "NHD"),
    ("cross_layer", "NHD"),
    ("cross_layer", "HND"),
]


DEVICE = os.environ.get("MARU_TEST_DEVICE", "cpu")  # "cuda" runs the same tests on a GPU


def _case(fmt: str, physical: str, seed: int, dtype: torch.dtype = torch.float32) -> CacheCase:
    return case(fmt, physical, seed, dtype, device=DEVICE)


@pytest.mark.parametrize("fmt,physical", CASES)
def test_store_then_load_into_another_cache_places_every_token_byte_exact(
    fmt: str, physical: str, client: MaruHandler
) -> None:
    src, dst = _case(fmt, physical, 1), _case(fmt, physical, 2)
    n_tokens = 3 * CHUNK + BS  # three full chunks and a one-block tail
    src_blocks = [9, 3, 14, 0, 7, 11, 5]
    dst_blocks = [2, 15, 6, 10, 1, 13, 8]
    tag = f"{fmt}-{physical}"
    rep = plain_engine(src, client).store([request(tag, src_blocks, n_tokens)])
    assert (rep.stored, rep.failed) == (4, 0)

    before = dst.snapshot()
    # Load everything but the first block (as if vLLM had it locally) and up to the tail's end.
    base = request(tag, dst_blocks, n_tokens)
    chunks = list(base.chunks)
    chunks[0] = ChunkRef(chunks[0].key, 0, CHUNK, place_begin=BS)
    lrep = plain_engine(dst, client).load([RequestTransfer(base.req_id, base.block_ids, tuple(chunks))])
    assert lrep.loaded_req_ids == [base.req_id] and not lrep.failed
    assert lrep.tokens == n_tokens - BS

    n_kv = 1 if fmt == "mla" else 2
    touched = set()
    for t in range(BS, n_tokens):
        s_src = src_blocks[t // BS] * BS + t % BS
        s_dst = dst_blocks[t // BS] * BS + t % BS
        touched.add(s_dst)
        for layer in range(3):
            for kv in range(n_kv):
                assert bits_equal(naive_token(dst, layer, kv, s_dst), naive_token(src, layer, kv, s_src)), (
                    t,
                    layer,
                    kv,
                )
    # Every other slot (including the first block, which was not to be placed) is untouched.
    after_case = _case(fmt, physical, 2)
    for s in range(16 * BS):
        if s in touched:
            continue
        for layer in range(3):
            for kv in range(n_kv):
                assert bits_equal(naive_token(dst, layer, kv, s), naive_token(after_case, layer, kv, s))
    assert len(before) == len(dst.snapshot())


def test_stored_object_is_the_canonical_layer_major_gather(client: MaruHandler) -> None:
    src = _case("cpu_attn", "NHD", 3)
    blocks = [4, 1, 12, 7]
    req = request("canon", blocks, 2 * CHUNK)
    eng = plain_engine(src, client)
    eng.store([req])
    h = client.retrieve(req.chunks[1].key)
    assert h is not None
    try:
        obj = torch.frombuffer(bytearray(h.tobytes()), dtype=torch.float32).view(3, 2, CHUNK, 24)
    finally:
        h.release()
    for t in range(CHUNK):
        slot = blocks[(CHUNK + t) // BS] * BS + (CHUNK + t) % BS
        for layer in range(3):
            for kv in range(2):
                assert bits_equal(obj[layer, kv, t], naive_token(src, layer, kv, slot))


def test_load_is_all_or_nothing_per_request_when_a_chunk_was_evicted(client: MaruHandler) -> None:
    src, dst = _case("blocks_first", "HND", 4), _case("blocks_first", "HND", 5)
    eng_src, eng_dst = plain_engine(src, client), plain_engine(dst, client)
    a = request("evict-a", [0, 1, 2, 3, 4, 5], 3 * CHUNK)
    b = request("evict-b", [6, 7, 8, 9], 2 * CHUNK)
    eng_src.store([a, b])
    assert client.delete([a.chunks[2].key]) == [True]
    rep = eng_dst.load([a, b])
    assert rep.loaded_req_ids == [b.req_id]
    assert a.req_id in rep.failed and "gone" in rep.failed[a.req_id]
    # Every pin was released: the remaining keys of a can be deleted (pinned keys cannot).
    assert client.delete([a.chunks[0].key, a.chunks[1].key]) == [True, True]


def test_a_request_with_too_few_blocks_fails_alone_before_anything_is_copied(client: MaruHandler) -> None:
    """Slot mappings are made after the copies are queued (``DeferredSlots``), so a block table too
    short for the placed tokens is caught at the check, for that request only; the others load."""
    src, dst = _case("blocks_first", "HND", 31), _case("blocks_first", "HND", 32)
    a = request("short-a", [0, 1, 2, 3], 2 * CHUNK)
    b = request("short-b", [4, 5, 6, 7], 2 * CHUNK)
    plain_engine(src, client).store([a, b])
    a_short = RequestTransfer(a.req_id, a.block_ids[:3], a.chunks)  # the last chunk needs block 4
    rep = plain_engine(dst, client).load([a_short, b])
    assert rep.loaded_req_ids == [b.req_id]
    assert "need 4 blocks" in rep.failed[a.req_id] and "has 3" in rep.failed[a.req_id]
    fresh = _case("blocks_first", "HND", 32)  # what dst held before the load
    for s in range(16 * BS):  # b placed byte exact (same blocks as stored); every other slot untouched
        want = src if s // BS in b.block_ids else fresh
        for layer in range(3):
            for kv in range(2):
                assert bits_equal(naive_token(dst, layer, kv, s), naive_token(want, layer, kv, s)), (s, layer)
    assert client.usage()["pinned"] == 0


def test_a_store_whose_request_lacks_blocks_fails_only_the_chunks_without_them(client: MaruHandler) -> None:
    """A step's store mappings are made in one pass; a request short of blocks is made chunk by
    chunk instead: its chunk without blocks fails, its other chunk and the other request are
    stored, and what was stored loads byte exact."""
    src, dst = _case("kv_first", "HND", 33), _case("kv_first", "HND", 34)
    a = request("store-short-a", [0, 1, 2, 3], 2 * CHUNK)
    b = request("store-short-b", [4, 5, 6, 7], 2 * CHUNK)
    a_short = RequestTransfer(a.req_id, a.block_ids[:3], a.chunks)  # its second chunk needs block 4
    rep = plain_engine(src, client).store([a_short, b])
    assert (rep.stored, rep.failed) == (3, 1)
    assert a.chunks[1].key in rep.error and "blocks" in rep.error
    loaded = plain_engine(dst, client).load([b, RequestTransfer(a.req_id, a.block_ids, a.chunks[:1])])
    assert sorted(loaded.loaded_req_ids) == sorted([a.req_id, b.req_id])
    for s in [*range(4 * BS, 8 * BS), *range(0, CHUNK)]:
        for layer in range(3):
            for kv in range(2):
                assert bits_equal(naive_token(dst, layer, kv, s), naive_token(src, layer, kv, s)), (s, layer)
    assert client.exists([a.chunks[1].key]) == [False]


def test_a_shared_chunk_in_one_step_is_stored_once(client: MaruHandler) -> None:
    src = _case("kv_first", "NHD", 6)
    a = request("shared", [0, 1, 2, 3], 2 * CHUNK)
    b = RequestTransfer("r-other", (0, 1, 5, 6), (a.chunks[0],))
    rep = plain_engine(src, client).store([a, b])
    assert (rep.stored, rep.present, rep.failed) == (2, 0, 0)
    rep2 = plain_engine(src, client).store([a])
    assert (rep2.stored, rep2.present) == (0, 2)


def test_requests_sharing_chunks_in_one_step_each_get_them_placed(client: MaruHandler) -> None:
    """Three requests of one load share prefix chunks (a system prompt): each is placed into its
    own blocks, byte exact, whatever order the path copies them in; on a GPU every shared chunk
    crosses the bus once (``copies_shared``: the repeats)."""
    src, dst = _case("blocks_first", "HND", 21), _case("blocks_first", "HND", 22)
    a = request("share-a", [5, 0, 9, 2, 12, 7], 3 * CHUNK)  # chunks k0 k1 k2
    b_own = request("share-b", [1, 3, 4, 6], 2 * CHUNK)
    c_own = request("share-c", [8, 10, 11, 13], 2 * CHUNK)
    eng = plain_engine(src, client)
    assert eng.store([a, b_own, c_own]).stored == 7
    k = a.chunks
    # b: k0 k1 then its own second chunk; c: k0 then its own; each in other destination blocks.
    b = RequestTransfer(
        "r-b", (0, 1, 2, 3, 4, 5), (k[0], k[1], ChunkRef(b_own.chunks[1].key, 2 * CHUNK, CHUNK))
    )
    c = RequestTransfer("r-c", (6, 7, 8, 9), (k[0], ChunkRef(c_own.chunks[1].key, CHUNK, CHUNK)))
    a_dst = RequestTransfer("r-a", (10, 11, 12, 13, 14, 15), k)
    rep = plain_engine(dst, client).load([b, a_dst, c])
    assert sorted(rep.loaded_req_ids) == ["r-a", "r-b", "r-c"] and not rep.failed
    assert rep.chunks == 8
    assert rep.copies_shared == (3 if DEVICE == "cuda" else 0)  # k0 twice, k1 once on the GPU path
    # (request placed, source request of each chunk, source chunk index) -> every token checked
    plan = [
        (a_dst, [(a, 0), (a, 1), (a, 2)]),
        (b, [(a, 0), (a, 1), (b_own, 1)]),
        (c, [(a, 0), (c_own, 1)]),
    ]
    for dst_req, sources in plan:
        for ci, (sreq, sci) in enumerate(sources):
            for t in range(CHUNK):
                ts, td = sci * CHUNK + t, ci * CHUNK + t
                s_src = sreq.block_ids[ts // BS] * BS + ts % BS
                s_dst = dst_req.block_ids[td // BS] * BS + td % BS
                for layer in range(3):
                    for kv in range(2):
                        got, want = naive_token(dst, layer, kv, s_dst), naive_token(src, layer, kv, s_src)
                        assert bits_equal(got, want), (dst_req.req_id, ci, t, layer, kv)
    assert client.usage()["pinned"] == 0


def test_bfloat16_round_trip_is_byte_exact(client: MaruHandler) -> None:
    src, dst = _case("packed", "HND", 7, torch.bfloat16), _case("packed", "HND", 8, torch.bfloat16)
    req = request("bf16", [3, 2, 1, 0], 2 * CHUNK)
    plain_engine(src, client).store([req])
    dst_req = RequestTransfer(req.req_id, (8, 9, 10, 11), req.chunks)
    assert plain_engine(dst, client).load([dst_req]).loaded_req_ids == [req.req_id]
    for t in range(2 * CHUNK):
        s1, s2 = req.block_ids[t // BS] * BS + t % BS, dst_req.block_ids[t // BS] * BS + t % BS
        for layer in range(3):
            for kv in range(2):
                assert bits_equal(naive_token(dst, layer, kv, s2), naive_token(src, layer, kv, s1))


def test_slot_mapping_marks_unplaced_tokens_and_needs_blocks_only_for_placed_ones() -> None:
    s = slot_mapping([5, 2], 4, 4, 8, (1, 3))
    assert s.tolist() == [-1, 9, 10, -1, -1, -1, -1, -1]
    with pytest.raises(ValueError):
        slot_mapping([5], 4, 0, 8)


@pytest.mark.parametrize("with_table", [False, True])
def test_slot_mapping_matches_a_per_token_reference_on_random_requests(with_table: bool) -> None:
    rng = random.Random(7 + with_table)
    for _ in range(200):
        bs = rng.choice([1, 3, 16])
        nblocks = rng.randint(1, 12)
        ids = rng.sample(range(1000), nblocks)
        start = rng.randint(0, nblocks * bs - 1)
        num = rng.randint(1, nblocks * bs - start)
        pb = rng.randint(0, num)
        pe = rng.randint(pb, num)
        want = [ids[(start + i) // bs] * bs + (start + i) % bs if pb <= i < pe else -1 for i in range(num)]
        table = block_table(ids) if with_table else None
        got = slot_mapping(ids, bs, start, num, (pb, pe), table=table)
        assert got.dtype == torch.int64 and got.tolist() == want


@pytest.mark.parametrize("whole", [False, True])
def test_chunk_slots_equal_each_chunks_slot_mapping_concatenated_on_random_requests(whole: bool) -> None:
    rng = random.Random(11 + whole)
    for _ in range(300):
        bs = rng.choice([1, 3, 16])
        nblocks = rng.randint(1, 12)
        ids = rng.sample(range(1000), nblocks)
        chunks, start = [], rng.randint(0, bs)
        usual = rng.random() < 0.4  # whole chunks one after the other (the fast path)
        while start < nblocks * bs and len(chunks) < 5:
            num = rng.randint(1, nblocks * bs - start)
            pb = 0 if usual else rng.randint(0, num)
            pe = num if usual else rng.randint(pb, num)
            chunks.append(
                ChunkRef(f"k{len(chunks)}", start, num, pb, pe if pe < num or rng.random() < 0.5 else -1)
            )
            start += num + (0 if usual else rng.choice([0, 0, 0, bs]))  # mostly contiguous, sometimes a gap
        if not chunks:
            continue
        if whole and max(c.end for c in chunks) > nblocks * bs:
            with pytest.raises(ValueError):
                chunk_slots(ids, bs, chunks, whole=True)
            continue
        parts = [
            slot_mapping(
                ids, bs, c.start, c.num_tokens, None if whole else c.placed(), table=block_table(ids)
            )
            for c in chunks
        ]
        got = chunk_slots(ids, bs, chunks, whole=whole)
        assert got.dtype == torch.int64 and got.tolist() == torch.cat(parts).tolist()
    # a placed token without a block is an error, an unplaced one is not
    with pytest.raises(ValueError, match="need 3 blocks"):
        chunk_slots([5, 2], 4, [ChunkRef("a", 0, 12)])
    assert chunk_slots([5, 2], 4, [ChunkRef("a", 4, 8, 1, 3)]).tolist() == [-1, 9, 10, -1, -1, -1, -1, -1]


def test_unreachable_server_comes_back_as_a_failed_report_not_an_exception(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, pool_size="16M")
    srv.start()
    h = MaruHandler(srv.url, timeout_s=0.5)
    try:
        eng = plain_engine(_case("kv_first", "NHD", 9), h)
        req = request("dead", [0, 1, 2, 3], 2 * CHUNK)
        srv.kill()
        rep = eng.store([req])
        assert rep.failed == 2 and rep.server_lost
        lrep = eng.load([req])
        assert req.req_id in lrep.failed and lrep.server_lost
    finally:
        release_pool(h)
        h.close()
        srv.cleanup()


# ---------------------------------------------------------------------------- the worker side


def test_worker_orders_layers_by_name_and_round_trips_through_metadata(server: ServerProcess) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    src, dst = _case("blocks_first", "HND", 10), _case("blocks_first", "HND", 11)
    ws, wd = worker(server, src), worker(server, dst)
    try:
        assert ws.engine is not None and ws.caches[0] is src.caches[0]
        req = request("worker", [5, 9, 1, 3], 2 * CHUNK)
        ws.start_load_kv(MaruConnectorMetadata())
        ws.wait_for_save(MaruConnectorMetadata(stores=[req]))
        ws.flush_stores()  # write-behind (the default): published once drained
        assert ws.stats.chunks_stored == 2
        dreq = RequestTransfer(req.req_id, (0, 2, 4, 6), req.chunks)
        wd.start_load_kv(MaruConnectorMetadata(loads=[dreq]))
        assert wd.get_block_ids_with_load_errors() == set()
        for t in range(2 * CHUNK):
            s1, s2 = req.block_ids[t // BS] * BS + t % BS, dreq.block_ids[t // BS] * BS + t % BS
            for layer in range(3):
                assert bits_equal(naive_token(dst, layer, 1, s2), naive_token(src, layer, 1, s1))
    finally:
        stop_worker(ws)
        stop_worker(wd)


def test_worker_reports_failed_blocks_and_drops_stores_built_on_them(server: ServerProcess) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    w = worker(server, _case("kv_first", "NHD", 12))
    try:
        missing = request("never-stored", [3, 4, 5, 6], 2 * CHUNK)
        later = RequestTransfer(
            "r-never-stored", (3, 4, 5, 6, 7, 8), (ChunkRef("test/never-stored/c2", 2 * CHUNK, CHUNK),)
        )
        meta = MaruConnectorMetadata(loads=[missing], stores=[later])
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        assert w.get_block_ids_with_load_errors() == {3, 4, 5, 6}
        assert w.get_block_ids_with_load_errors() == set()  # reported once
        assert (w.stats.load_errors, w.stats.stores_dropped, w.stats.chunks_stored) == (1, 1, 0)
    finally:
        stop_worker(w)


def test_worker_with_an_unsupported_layout_stays_off_and_fails_loads_cleanly(server: ServerProcess) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    case = _case("kv_first", "NHD", 13)
    case.num_kv_heads = 5  # does not match the tensors: detection must refuse, not guess
    w = worker(server, case)
    assert w.engine is None and w.disabled_reason and "unsupported" in w.disabled_reason
    req = request("off", [0, 1, 2, 3], 2 * CHUNK)
    w.start_load_kv(MaruConnectorMetadata(loads=[req]))
    assert w.get_block_ids_with_load_errors() == {0, 1, 2, 3}
    # ... and says so to the server, for `maru doctor` (a client that never maps the pool).
    assert w._refusal is not None and w._refusal.reported.wait(20)
    said = [s for slow in reported_slow(server).values() for s in slow if "unsupported KV-cache layout" in s]
    assert len(said) == 1 and "Fix:" in said[0]
    w.shutdown()
    assert not w._refusal._thread.is_alive()


def test_a_lost_server_closes_the_engine_before_the_client_unmaps_the_pool(
    server: ServerProcess, client: MaruHandler
) -> None:
    """The engine drains its transfers and drops its CUDA registration before the pool is unmapped."""
    pytest.importorskip("vllm")
    w = worker(server, _case("kv_first", "NHD", 61))
    order: list[str] = []
    engine, real = w.engine, w._client
    assert engine is not None and real is not None
    engine_close, client_close = engine.close, real.close
    engine.close = lambda: (order.append("engine"), engine_close())[1]  # type: ignore[method-assign]
    real.close = lambda: (order.append("client"), client_close())[1]  # type: ignore[method-assign]
    w._lost("test: server gone")
    assert order == ["engine", "client"]
    assert w.engine is None and w._client is None
    w.shutdown()


def test_the_pipelined_path_reports_which_layer_launch_it_runs_and_why_a_slower_one(monkeypatch) -> None:
    """``maru stats`` / ``maru doctor`` (client info): one launch for all layers, or per-layer replays
    with the reason and the fix, or no graphs at all; and whether kernels launch directly."""
    from types import SimpleNamespace

    from maru.kv_ops import launch
    from maru.transfer.device_path import PipelinedPath

    monkeypatch.setattr(launch, "_LAUNCHERS", [])  # only the launchers of this test

    def report(graphs: bool, one: bool, can: bool, way: tuple = (None, None)) -> tuple[dict, list[str]]:
        placer = SimpleNamespace(can_launch_all=lambda: can)
        pipe = SimpleNamespace(
            layer_graphs=graphs, one_launch_layers=one, _layer_placer=placer, layer_way=lambda: way
        )
        return PipelinedPath.report(SimpleNamespace(pipeline=pipe), True)  # type: ignore[arg-type]

    want = {"kernel_launch": "direct", "layer_graphs": "on", "layer_launch": "one"}
    assert report(True, True, True) == (want, [])
    for one, can in ((False, True), (True, False)):
        paths, slow = report(True, one, can)
        assert paths["layer_launch"] == "per layer" and len(slow) == 1
        assert "one graph per layer" in slow[0] and "Fix:" in slow[0]
    paths, slow = report(False, True, True)
    assert paths["layer_graphs"] == "off" and "without CUDA graphs" in slow[0]
    # maru_layer_path=copied (kv_ops.layer_copies): the copy engines, no layer graphs to speak of;
    # or the direct way it fell back to, with the reason as a slow path.
    assert report(True, True, True, ("copy engines", None)) == (
        {"kernel_launch": "direct", "layer_way": "copy engines"}, [],
    )  # fmt: skip
    paths, slow = report(
        True, True, True, ("direct (the SMs read the pool)", "layer_path 'copied' ... CUDA 12.4")
    )
    assert paths["layer_way"].startswith("direct") and slow == ["layer_path 'copied' ... CUDA 12.4"]
    assert paths["layer_launch"] == "one"  # the direct way it runs, reported as ever
    assert PipelinedPath.report(SimpleNamespace(pipeline=None), False) == ({"kernel_launch": "direct"}, [])  # type: ignore[arg-type]
    # A kernel that gave up on the direct launch (an unknown Triton) shows, with its reason and fix.
    gave_up = launch.Launcher(SimpleNamespace(params=None, fn=SimpleNamespace(__name__="_k")))
    gave_up.unavailable, gave_up.interpreted = "no parameter list", False
    paths, slow = PipelinedPath.report(SimpleNamespace(pipeline=None), False)  # type: ignore[arg-type]
    assert paths == {"kernel_launch": "triton binding"}
    assert len(slow) == 1 and "_k: no parameter list" in slow[0] and "Fix:" in slow[0]
    monkeypatch.setattr(launch, "_LAUNCHERS", [])
    assert PipelinedPath.report(SimpleNamespace(pipeline=SimpleNamespace()), False)[1] == []  # type: ignore[arg-type]
    # Tail sizes whose graphs CUDA refused (kv_ops.paced_store): a slow path with its reason.
    why = "the graphs for a 48-token partial tail could not be captured (...). Fix: ..."
    assert PipelinedPath.report(SimpleNamespace(pipeline=SimpleNamespace(tails_unwarmed=why)), False)[1] == [
        why
    ]  # type: ignore[arg-type]
    # The chunk load's checksum way (MARU_FUSED_LOAD_CHECKSUM): shown, and why it is not fused
    # where the setting asks for it and cannot apply.
    for way, why in (
        ("fused (3 objects)", None),
        ("separate kernel", "the fused load checksum (the default) needs CUDA graphs ..."),
    ):
        pipe = SimpleNamespace(load_checksum_way=lambda way=way, why=why: (way, why))
        paths, slow = PipelinedPath.report(SimpleNamespace(pipeline=pipe), False)  # type: ignore[arg-type]
        assert paths["load_checksum"] == way and slow == ([why] if why else [])
    # The engine paces write-behind stores only where asked for and the path really paces.
    from maru.transfer.engine import KVTransferEngine

    for asked, path_paces in ((True, True), (True, False), (False, True)):
        eng = SimpleNamespace(paced_store=asked, path=SimpleNamespace(paces_stores=path_paces))
        assert KVTransferEngine.paces_stores.fget(eng) == (asked and path_paces)  # type: ignore[attr-defined]


def test_the_engine_reads_the_pool_address_of_the_clients_current_mapping() -> None:
    """A load's first copy is queued from the pool's address in this process (``prestage``): the
    engine follows the client's mapping as it is now (a server back with another pool is mapped
    anew, and the lookups' offsets are in the new mapping); a client that maps no pool: 0, and
    nothing is prestaged."""
    from types import SimpleNamespace

    client = SimpleNamespace(pool_mapping=SimpleNamespace(address=0x7F0000000000))
    eng = plain_engine(case("kv_first", "NHD", 1), client)
    assert eng._pool_address() == 0x7F0000000000
    client.pool_mapping = SimpleNamespace(address=0x7E0000000000)  # remapped
    assert eng._pool_address() == 0x7E0000000000
    del client.pool_mapping  # a client of a test: no mapping
    assert eng._pool_address() == 0


@pytest.mark.parametrize("whole", [False, True])
def test_a_steps_slots_made_at_once_equal_each_requests_chunk_slots(whole: bool) -> None:
    """``many_chunk_slots`` against ``chunk_slots`` request by request, on random steps: contiguous
    chunks placed in part or whole, gaps (made alone), requests short of blocks (None: the others
    are made, ``chunk_slots`` alone raises why), nothing placed, block sizes 1, 3 and 16 (never the
    8 heads of a model)."""
    rng = random.Random(41 + whole)
    for _ in range(150):
        bs = rng.choice([1, 3, 16])
        step = []
        for _ in range(rng.randint(1, 6)):
            nblocks = rng.randint(1, 10)
            ids = rng.sample(range(1000), nblocks)
            chunks, start = [], rng.randint(0, 2 * bs)
            usual = rng.random() < 0.5
            while start < nblocks * bs + bs and len(chunks) < 4:
                num = rng.randint(1, 2 * bs + 5)
                pb = 0 if usual else rng.randint(0, num)
                pe = num if usual else rng.randint(pb, num)
                chunks.append(
                    ChunkRef(f"k{len(chunks)}", start, num, pb, pe if pe < num or rng.random() < 0.5 else -1)
                )
                start += num + (0 if usual or rng.random() < 0.8 else bs)
            step.append((ids, chunks))
        want: list[Any] = []
        for ids, chunks in step:
            try:
                want.append(chunk_slots(ids, bs, chunks, whole=whole).tolist())
            except ValueError as e:
                want.append(str(e))
        assert all("blocks of" in w for w in want if isinstance(w, str))
        got = many_chunk_slots(step, bs, whole=whole)
        assert [g.dtype for g in got if g is not None] == [torch.int64] * sum(
            not isinstance(w, str) for w in want
        )
        assert [None if isinstance(w, str) else w for w in want] == [
            None if g is None else g.tolist() for g in got
        ]
