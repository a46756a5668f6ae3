"""``maru_store_helper`` on CUDA caches (``-m gpu``; skipped without CUDA): the drain in a helper
process that reaches the worker's caches and each forward's event through CUDA IPC.

Real geometry (32 layers, 8 KV heads of 128, bf16, block size 16 != heads), a real server. The
forward's writes are queued behind a device-side sleep right before the stores are issued, so a
helper gather not ordered after the worker's event would read the old bytes; a preempted
request's freed blocks are overwritten right after the barrier, so a gather still running then
would publish the new ones. A fresh poisoned cache loads the chunks: every placed token must equal
the source as the forward left it, byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from maru.client import MaruHandler
from maru.transfer.records import RequestTransfer
from tests.helpers import ServerProcess
from tests.pool_fixtures import release_pool, stop_worker
from tests.transfer.helpers import make_case, requests
from tests.vllm.test_write_behind_gpu import (
    CHUNK,
    GEOM,
    NAMES,
    assert_loaded,
    overwrite_behind_a_device_sleep,
)

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("store-helper-gpu"), pool_size="2G")
    srv.start()
    try:
        yield srv
    finally:
        srv.cleanup()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[MaruHandler]:
    h = MaruHandler(server.url, timeout_s=10)
    try:
        yield h
    finally:
        release_pool(h)
        h.close()


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_the_helper_stores_what_the_forward_wrote_and_waits_at_preemption(
    physical: str, server: ServerProcess, client: MaruHandler
) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.config import MaruConnectorConfig
    from maru.vllm.metadata import MaruConnectorMetadata as Meta
    from maru.vllm.worker import MaruWorkerConnector

    bs = GEOM["block_size"]
    a_src, a_dst = requests(f"helper-gpu-a-{physical}", bs, CHUNK, GEOM["num_blocks"])
    b_src, b_dst = requests(f"helper-gpu-b-{physical}", bs, CHUNK, GEOM["num_blocks"])
    a_src = RequestTransfer("a", a_src.block_ids, a_src.chunks)  # finishes
    b_src = RequestTransfer("b", b_src.block_ids, b_src.chunks)  # is preempted
    src, want = make_case(physical, 21, GEOM), make_case(physical, 23, GEOM)
    cfg = MaruConnectorConfig(
        server_url=server.url, kv_chunk_tokens=CHUNK, async_store=True, store_helper=True
    )
    w = MaruWorkerConnector(
        cfg,
        block_size=bs,
        num_kv_heads=GEOM["num_kv_heads"],
        head_size=GEOM["head_size"],
        client_factory=lambda: MaruHandler(server.url, timeout_s=10),
    )
    assert isinstance(src.caches, list)
    w.register_kv_caches(dict(zip(NAMES, src.caches, strict=True)))
    try:
        h = w.write_behind.helper
        assert h is not None
        deadline = time.monotonic() + 180
        while not h.ready():
            assert h.state == "starting", h.why
            assert time.monotonic() < deadline
            time.sleep(0.1)
        forward = torch.cuda.Stream()  # vLLM's forward may run on a stream of its own
        with torch.cuda.stream(forward):
            overwrite_behind_a_device_sleep(src, want)  # the forward's writes, still queued
            w.wait_for_save(Meta(stores=[a_src]))
            w.wait_for_save(Meta(stores=[b_src]))
            assert w.stats.helper_batches == 2 and w.stats.helper_missed == 0
            w.handle_preemptions(Meta(preempted_req_ids={"b"}))  # before the next forward
            freed = torch.tensor(sorted(set(b_src.block_ids) - set(a_src.block_ids)), device="cuda")
            for t in src.caches:
                t.index_fill_(1, freed, -2.0)  # the next forward writes b's freed blocks
        w.flush_stores(60)
        sending, _ = w.get_finished({"a", "b"})
        assert sending == {"a"}  # b was preempted: no report owed
        assert (w.stats.store_failures, w.stats.chunks_stored) == (0, 8)
        assert h.state == "ready"
    finally:
        stop_worker(w)
    assert h.state == "closed"
    assert_loaded(client, physical, a_src, RequestTransfer("a", a_dst.block_ids, a_dst.chunks), want)
    assert_loaded(client, physical, b_src, RequestTransfer("b", b_dst.block_ids, b_dst.chunks), want)
