"""Pool keys of LMCache chunks, and the backend's configuration."""

from __future__ import annotations

import pytest
import torch

from maru.errors import ConfigError
from maru.lmcache.config import LMCacheMaruConfig
from maru.lmcache.keys import is_lmcache_key, pool_key
from maru.protocol import MAX_KEY_BYTES
from maru.vllm.keys import ChunkKeyer, KeySpace, rank_keys
from tests.lmcache.conftest import NEEDS, WHY, backend, cache_keys, put_random


class _Key:
    def __init__(self, s: str) -> None:
        self.s = s

    def to_string(self) -> str:
        return self.s


def test_keys_carry_namespace_and_lmcache_key():
    k = pool_key(_Key("m@1@0@abc@bfloat16"), "teamA")
    assert k == "lmcache/teamA/m@1@0@abc@bfloat16/lmc1"
    assert is_lmcache_key(k)
    assert pool_key(_Key("m@1@0@abc@bfloat16")) != k


def test_an_overlong_key_is_shortened_deterministically():
    long = _Key("m" * 2000 + "@1@0@abc@bfloat16")
    k = pool_key(long)
    assert len(k.encode()) <= MAX_KEY_BYTES and is_lmcache_key(k)
    assert k == pool_key(_Key(long.s))


@pytest.mark.parametrize("namespace", ["", "lmcache", "lmcache/x", "teamA"])
def test_no_key_of_the_vllm_connector_is_an_lmcache_key(namespace):
    space = KeySpace("m", "r", "bfloat16", 2, 2, 16, 16, tenant=namespace)
    keyer = ChunkKeyer(space)
    pk = keyer.prompt_keys(list(range(64)))
    direct = list(pk.full) + [keyer.tail_key(pk.chain[-1], [1, 2, 3])]
    direct += [k for key in direct for k in rank_keys(key, 2)]
    assert not any(is_lmcache_key(k) for k in direct)


def test_lmcache_chunks_and_direct_connector_chunks_do_not_see_each_other(make_storage):
    pytest.importorskip(NEEDS, reason=WHY)
    sm = make_storage()
    be = backend(sm)
    keys = cache_keys(2)
    put_random(sm, keys)
    assert be.puts.flush(10)
    client = be.link.client()
    direct = (
        ChunkKeyer(KeySpace("maru-test/tiny", "", "bfloat16", 2, 2, 16, 16)).prompt_keys(list(range(32))).full
    )
    a = client.alloc(64)
    a.buf[:] = bytes(64)
    client.store(direct[0], a)
    assert client.exists([be.key(k) for k in keys]) == [True, True]
    assert client.exists(direct[:1]) == [True]
    assert not any(is_lmcache_key(k) for k in direct)
    assert be.get_blocking(keys[0]) is not None


def test_namespaces_separate_lmcache_instances(make_storage):
    pytest.importorskip(NEEDS, reason=WHY)
    a = make_storage(maru_namespace="teamA")
    b = make_storage(maru_namespace="teamB")
    keys = cache_keys(1)
    put_random(a, keys)
    assert backend(a).puts.flush(10)
    assert backend(a).batched_contains(keys) == 1
    assert backend(b).batched_contains(keys) == 0


def test_config_reads_maru_keys_and_refuses_misspelt_ones():
    cfg = LMCacheMaruConfig.from_extra_config(
        {
            "maru_server_url": "tcp://h:1",
            "maru_verify_on_get": "false",
            "maru_max_pending_puts": "8",
            "other": 1,
        }
    )
    assert (cfg.server_url, cfg.verify_on_get, cfg.max_pending_puts) == ("tcp://h:1", False, 8)
    with pytest.raises(ConfigError, match="maru_server_url"):
        LMCacheMaruConfig.from_extra_config({"maru_server_ulr": "tcp://h:1"})
    with pytest.raises(ConfigError, match="maru_timeout_s"):
        LMCacheMaruConfig.from_extra_config({"maru_timeout_s": 0})
    with pytest.raises(ConfigError, match="maru_namespace"):
        LMCacheMaruConfig.from_extra_config({"maru_namespace": "a/b"})


def test_object_header_round_trips_shapes_and_dtypes():
    pytest.importorskip(NEEDS, reason=WHY)
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    from maru.lmcache.objects import decode_header, encode_header

    raw = torch.zeros(4096, dtype=torch.uint8)
    meta = MemoryObjMetadata(
        shape=torch.Size([2, 4, 16, 8]),
        dtype=torch.float16,
        address=0,
        phy_size=4096,
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    obj = TensorMemoryObj(raw, meta, parent_allocator=None)
    hdr = encode_header(obj)
    doc = decode_header(hdr + bytes(obj.get_size()))
    assert doc["shape"] == [2, 4, 16, 8] and doc["dtype"] == "float16" and doc["size"] == 2 * 4 * 16 * 8 * 2
    with pytest.raises(ValueError, match="magic"):
        decode_header(bytes(300))
