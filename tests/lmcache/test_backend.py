"""Maru's LMCache backend with the real ``lmcache`` package and a real ``maru server``: every test
goes through LMCache's ``StorageManager``, which loaded the backend from its config."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from tests.lmcache.conftest import NEEDS, WHY, backend, cache_keys, put_random

pytest.importorskip(NEEDS, reason=WHY)


@pytest.mark.parametrize(
    "dtype,shape",
    [
        (torch.bfloat16, torch.Size([2, 2, 16, 32])),
        (torch.float32, torch.Size([2, 3, 16, 24])),
        (torch.float16, torch.Size([2, 1, 7, 40])),
    ],
)
def test_put_then_get_returns_the_same_bytes(make_storage, dtype, shape):
    sm = make_storage(dtype=dtype)
    keys = cache_keys(6, dtype=dtype)
    data = put_random(sm, keys, dtype=dtype, shape=shape)
    be = backend(sm)
    assert be.puts.flush(10)
    assert be.stats()["puts"]["stored"] == 6
    got = sm.batched_get(keys, location="maru")
    for g, t in zip(got, data, strict=True):
        assert g is not None
        assert g.get_shape() == shape and g.get_dtype() == dtype
        assert torch.equal(g.tensor.view(torch.uint8), t.view(torch.uint8))
        g.ref_count_down()


def test_a_second_lmcache_instance_finds_what_the_first_stored(make_storage):
    a, b = make_storage(), make_storage()
    keys = cache_keys(3)
    data = put_random(a, keys)
    assert backend(a).puts.flush(10)
    assert b.batched_contains(keys)[0] == 3
    got = b.batched_get(keys, location="maru")
    assert all(torch.equal(g.tensor, t) for g, t in zip(got, data, strict=True))
    for g in got:
        g.ref_count_down()


def test_contains_and_batched_contains_count_the_leading_run(make_storage):
    sm = make_storage()
    keys = cache_keys(5)
    put_random(sm, [keys[0], keys[1], keys[3]])
    be = backend(sm)
    assert be.puts.flush(10)
    assert [be.contains(k) for k in keys] == [True, True, False, True, False]
    assert be.batched_contains(keys) == 2
    assert be.batched_contains(keys[3:]) == 1
    assert be.batched_contains([]) == 0
    assert sm.batched_contains(keys)[0] == 2


def test_a_missing_key_gets_none(make_storage):
    sm = make_storage()
    be = backend(sm)
    missing = cache_keys(1, start=50)[0]
    assert be.get_blocking(missing) is None
    assert be.get_non_blocking(missing) is None
    keys = cache_keys(2)
    put_random(sm, keys[:1])
    assert be.puts.flush(10)
    fut = be.get_non_blocking(keys[0])
    assert fut is not None and fut.result() is not None
    fut.result().ref_count_down()


def test_non_blocking_batched_get_returns_the_leading_run_of_hits(make_storage):
    import asyncio

    sm = make_storage()
    be = backend(sm)
    keys = cache_keys(4)
    put_random(sm, [keys[0], keys[1], keys[3]])
    assert be.puts.flush(10)
    got = asyncio.run(be.batched_get_non_blocking("req", keys))
    assert len(got) == 2
    for g in got:
        g.ref_count_down()
    assert be.link.client().usage()["pinned"] == 0


def test_a_copying_get_unpins_its_batch_with_one_unpin_it_does_not_wait_for(make_storage, monkeypatch):
    sm = make_storage()
    be = backend(sm)
    keys = cache_keys(4)
    data = put_random(sm, keys)
    assert be.puts.flush(10)
    client = be.link.client()
    calls: list[tuple[int, bool]] = []
    real = client.batch_release

    def counting(handles, wait=True):
        calls.append((len(handles), wait))
        return real(handles, wait=wait)

    monkeypatch.setattr(client, "batch_release", counting)
    got = be.batched_get_blocking(keys)
    assert calls == [(4, False)]  # one UNPIN for the batch, not one round trip per chunk
    assert client.usage()["pinned"] == 0  # applied before this client's next request
    for g, t in zip(got, data, strict=True):
        assert torch.equal(g.tensor, t)
        g.ref_count_down()


def test_remove_makes_a_chunk_absent(make_storage):
    sm = make_storage()
    keys = cache_keys(3)
    put_random(sm, keys)
    be = backend(sm)
    assert be.puts.flush(10)
    assert be.remove(keys[1]) is True
    assert be.remove(keys[1]) is False
    assert [be.contains(k) for k in keys] == [True, False, True]
    assert be.batched_remove([keys[0], keys[2]]) == 2
    assert be.batched_contains(keys) == 0


def test_put_does_not_wait_for_the_pool(make_storage):
    """The store path only queues: with the drain thread held, the put returns at once and the key
    is reported as in flight; once released, it lands."""
    sm = make_storage()
    be = backend(sm)
    gate = threading.Event()
    real_client = be.link.client

    def held_client():
        gate.wait(30)
        return real_client()

    be.link.client = held_client  # the drain thread asks for the link first
    keys = cache_keys(2)
    t0 = time.monotonic()
    put_random(sm, keys)
    elapsed = time.monotonic() - t0
    try:
        assert elapsed < 5, f"batched_put waited {elapsed:.1f} s for Maru"
        assert be.exists_in_put_tasks(keys[0])
    finally:
        gate.set()
    assert be.puts.flush(10)
    be.link.client = real_client
    assert not be.exists_in_put_tasks(keys[0])
    assert be.batched_contains(keys) == 2


def test_references_to_lmcache_objects_are_dropped_after_the_put(make_storage):
    sm = make_storage()
    from lmcache.v1.memory_management import MemoryFormat

    objs = sm.batched_allocate(torch.Size([2, 2, 16, 32]), torch.bfloat16, 2, fmt=MemoryFormat.KV_2LTD)
    for o in objs:
        o.ref_count_up()  # the test's own reference, so the object outlives the put
    sm.batched_put(cache_keys(2), objs)
    assert backend(sm).puts.flush(10)
    assert [o.get_ref_count() for o in objs] == [1, 1]
    for o in objs:
        o.ref_count_down()


def test_zero_copy_get_hands_lmcache_the_pool_pages_and_unpins_when_freed(make_storage, maru_server):
    sm = make_storage(maru_zero_copy_get=True)
    be = backend(sm)
    keys = cache_keys(2)
    data = put_random(sm, keys)
    assert be.puts.flush(10)
    got = be.batched_get_blocking(keys)
    client = be.link.client()
    lo, hi = client.pool_address, client.pool_address + client.pool_mapping.size
    for g, t in zip(got, data, strict=True):
        assert lo <= g.tensor.data_ptr() < hi, "the memory object is not in the pool mapping"
        assert torch.equal(g.tensor, t)
    assert client.usage()["pinned"] == 2
    for g in got:
        g.ref_count_down()
    assert client.usage()["pinned"] == 0
    assert not got[0].is_valid()


def test_a_corrupted_chunk_is_a_miss(make_storage):
    sm = make_storage()
    be = backend(sm)
    keys = cache_keys(1)
    put_random(sm, keys)
    assert be.puts.flush(10)
    client = be.link.client()
    h = client.retrieve(be.key(keys[0]), verify=False)
    import ctypes

    ctypes.memset(client.pool_address + h.offset + h.size - 1, 0x5A, 1)  # flip the last payload byte
    h.release()
    assert be.get_blocking(keys[0]) is None


def test_unchecked_gets_are_announced_and_reported_for_maru_doctor(make_storage, maru_server, caplog):
    from tests.helpers import reported_slow

    caplog.set_level(logging.WARNING, logger="maru.lmcache")
    checked = backend(make_storage())
    assert checked._weaker() == []
    unchecked = backend(make_storage(maru_verify_on_get=False))
    assert any("maru_verify_on_get is false" in r.getMessage() for r in caplog.records)
    me = unchecked.link.client().client_id
    slow = reported_slow(maru_server)
    assert any("maru_verify_on_get: true" in s for s in slow[me])
    assert slow[checked.link.client().client_id] == []
    # LMCache's contains are EXISTS: the backend says how they reach the pool (the key index here).
    from maru.protocol import Op
    from tests.helpers import RawClient

    with RawClient(maru_server.url) as c:
        infos = {e["client_id"]: e["info"] for e in c.call(Op.STATS)["clients"] if e.get("info")}
    assert infos[me]["paths"] == {"lmcache": "storage plugin", "exists": "key index"}


def test_server_down_lmcache_keeps_serving_and_maru_warns_once(make_storage, maru_server, caplog):
    sm = make_storage(local_cpu=True, maru_retry_s=60.0)
    be = backend(sm)
    keys = cache_keys(4)
    put_random(sm, keys[:2])
    assert be.puts.flush(10)
    maru_server.kill()
    caplog.set_level(logging.WARNING, logger="maru.lmcache")
    # LMCache's own tier still serves what it holds; Maru answers "absent", never raises.
    assert sm.contains(keys[0]) is not None
    assert be.contains(keys[0]) is False
    assert be.batched_contains(keys) == 0
    assert be.get_blocking(keys[0]) is None
    put_random(sm, keys[2:])
    assert be.puts.flush(30)
    assert be.contains(keys[2]) is False
    assert be.remove(keys[0]) is False
    got = sm.batched_get(keys[:2], location="LocalCPUBackend")
    assert all(g is not None for g in got)
    for g in got:
        g.ref_count_down()
    warnings = [r for r in caplog.records if r.name == "maru.lmcache" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "cannot reach maru server" in warnings[0].getMessage()
    assert be.stats()["puts"]["dropped_server_down"] >= 2


def test_backend_that_starts_without_a_server_connects_when_it_appears(make_storage, maru_server):
    url = maru_server.url
    maru_server.kill()
    sm = make_storage(url=url, maru_retry_s=0.2)
    be = backend(sm)
    assert be.batched_contains(cache_keys(1)) == 0
    maru_server.start()
    deadline = time.monotonic() + 20
    while be.link.client() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    keys = cache_keys(1)
    put_random(sm, keys)
    assert be.puts.flush(10)
    assert be.batched_contains(keys) == 1
