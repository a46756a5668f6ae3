"""Every load path checks the bytes it placed against the checksum their writer committed.

A real server and a real shared-memory pool; between the store and the load another process
(a child Python with its own mapping of the pool file) changes bytes of a committed chunk behind
the engine's back. Each load path on CPU caches (the CPU path, the staged path, the pipelined
path over a CPU ``DevicePipeline``), each load mode (synchronous, asynchronous, layer by layer)
must report that request failed (all or nothing: nothing of it counts as loaded), load the
request next to it byte for byte, count the corrupt chunk in ``integrity()``, report it to the
server (``maru stats``) and release every pin. The GPU variants are in
``test_transfer_integrity_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from maru import kv_ops
from maru.client import MaruHandler
from maru.kv_ops.device_pipeline import DevicePipeline
from maru.kv_ops.testing import CacheCase, bits, naive_token
from maru.transfer.device_path import PipelinedPath
from maru.transfer.engine import KVTransferEngine
from maru.transfer.paths import CpuPath, StagedPath
from maru.transfer.records import ChunkRef, RequestTransfer
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client
from tests.transfer.helpers import BS, CHUNK, case, flip_behind, load_in_mode, request

server = module_server("integrity")
client = pool_client()

PATHS = ("cpu", "staged", "pipelined")
MODES = ("sync", "async", "layers")


def _engine(case: CacheCase, client: Any, path: str = "cpu") -> KVTransferEngine:
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    caches = [case.caches] if isinstance(case.caches, torch.Tensor) else case.caches
    p: Any = {
        "cpu": lambda: CpuPath(caches, layout),
        "staged": lambda: StagedPath(caches, layout),
        "pipelined": lambda: PipelinedPath(DevicePipeline(case.caches, layout)),
    }[path]()
    return KVTransferEngine(caches, layout, client, path=p)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
def test_a_byte_changed_behind_a_committed_chunk_fails_its_request_on_every_load_path(
    path: str, mode: str, server: ServerProcess, client: MaruHandler
) -> None:
    fmt, physical, dtype = (
        ("kv_first", "HND", torch.bfloat16) if path != "cpu" else ("cpu_attn", "NHD", torch.float16)
    )
    tag = f"integ-{path}-{mode}"
    src = case(fmt, physical, 1, dtype)
    victim = request(tag + "-v", [9, 3, 14, 0, 7], 2 * CHUNK + BS)
    good = request(tag + "-g", [1, 12, 5, 10, 6], 2 * CHUNK)
    store = _engine(src, client).store([victim, good])
    assert store.stored == 5 and store.failed == 0
    nbytes = _engine(src, client).geometry.nbytes(CHUNK)
    flip_behind(server, client, victim.chunks[1].key, nbytes // 2 + 3)

    before_client = client.integrity()
    before_server = client.stats()["counters"].get("integrity_failures", 0)
    dst, ref = case(fmt, physical, 2, dtype), case(fmt, physical, 2, dtype)
    assert _engine(ref, client).load([good]).loaded_req_ids == [good.req_id]
    rep = load_in_mode(_engine(dst, client, path), [victim, good], mode)

    assert rep.loaded_req_ids == [good.req_id]
    assert victim.req_id in rep.failed and "checksum" in rep.failed[victim.req_id]
    assert victim.chunks[1].key in rep.failed[victim.req_id]
    # The good request's tokens hold exactly its bytes; the failed one's are vLLM's to recompute.
    slots = [good.block_ids[t // BS] * BS + t % BS for t in range(2 * CHUNK)]
    for layer in range(3):
        for kv in range(2):
            for s in slots:
                assert torch.equal(bits(naive_token(dst, layer, kv, s)), bits(naive_token(ref, layer, kv, s)))
    after = client.integrity()
    assert after["integrity_failures"] == before_client["integrity_failures"] + 1
    assert after["verified"] > before_client["verified"]
    assert client.stats()["counters"]["integrity_failures"] == before_server + 1
    assert client.usage()["pinned"] == 0
    # Reported and deleted: the next load of it is a plain miss, the others are still there.
    assert client.exists([c.key for c in victim.chunks]) == [True, False, True]


def test_a_change_in_a_skipped_row_still_fails_the_request(
    server: ServerProcess, client: MaruHandler
) -> None:
    """Rows not placed (already computed locally) are part of the object the checksum covers:
    the layer path and the chunk path both read them for the check."""
    src = case("kv_first", "NHD", 3, torch.bfloat16)
    req = request("integ-skip", [4, 8, 2], 2 * CHUNK)
    _engine(src, client).store([req])
    flip_behind(server, client, req.chunks[0].key, 5)  # layer 0, plane 0, token 0
    c0 = req.chunks[0]
    partial = RequestTransfer(
        req.req_id, req.block_ids, (ChunkRef(c0.key, c0.start, c0.num_tokens, BS), req.chunks[1])
    )
    for mode in ("sync", "layers"):
        rep = load_in_mode(_engine(case("kv_first", "NHD", 4, torch.bfloat16), client), [partial], mode)
        assert rep.failed and not rep.loaded_req_ids, mode
        if mode == "sync":
            # The report deleted it; store it again, corrupt it again for the layer mode.
            _engine(src, client).store([req])
            flip_behind(server, client, req.chunks[0].key, 5)


def test_stores_commit_the_checksum_of_the_bytes_they_wrote(client: MaruHandler) -> None:
    """Every path's stored objects verify on a plain ``retrieve`` (checksums from the device
    paths are of the bytes in the pool, not of something else)."""
    for path in PATHS:
        src = case("kv_first", "HND", 5, torch.bfloat16)
        req = request(f"integ-store-{path}", [3, 7, 11, 13, 1], 2 * CHUNK + 1)
        assert _engine(src, client, path).store([req]).stored == 3
        got = client.batch_retrieve([c.key for c in req.chunks])
        assert all(r is not None and r.verify() for r in got), path
        client.batch_release(got)


def test_an_engine_not_verifying_on_its_path_leaves_the_check_to_the_client(
    server: ServerProcess, client: MaruHandler
) -> None:
    """``verify=False``: the client checks on the CPU before placing (the slower way); the change
    is still a counted miss, never placed."""
    src = case("kv_first", "HND", 6, torch.float32)
    req = request("integ-noverify", [2, 9], CHUNK)
    _engine(src, client).store([req])
    flip_behind(server, client, req.chunks[0].key, 17)
    dst = case("kv_first", "HND", 7, torch.float32)
    before = dst.snapshot()
    layout = kv_ops.detect_layouts(dst.caches, **dst.detect_kwargs())
    eng = KVTransferEngine(list(dst.caches), layout, client, verify=False)
    failures = client.integrity()["integrity_failures"]
    rep = eng.load([req])
    assert not rep.loaded_req_ids and "gone" in rep.failed[req.req_id]
    assert client.integrity()["integrity_failures"] == failures + 1
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(dst.snapshot(), before, strict=True))
