"""Chunk keys (maru.vllm.keys) and the connector's config parsing (maru.vllm.config). No vLLM needed."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import subprocess
import sys

import pytest

from maru.errors import ConfigError
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.keys import ChunkKeyer, KeySpace

SPACE = KeySpace(
    model="m",
    revision="r1",
    kv_dtype="torch.float32",
    num_layers=2,
    num_kv_heads=2,
    head_size=32,
    chunk_tokens=64,
)


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50000) for _ in range(n)]


def test_keys_are_identical_across_processes_and_hash_seeds() -> None:
    toks = _tokens(300)
    mine = ChunkKeyer(SPACE).prompt_keys(toks).full
    code = (
        "import json,sys; from maru.vllm.keys import ChunkKeyer, KeySpace; "
        "s=KeySpace(**json.loads(sys.argv[1])); print(json.dumps(ChunkKeyer(s).prompt_keys(json.loads(sys.argv[2])).full))"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(dataclasses.asdict(SPACE)), json.dumps(toks)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(out.stdout) == mine


def test_keys_follow_the_documented_chain_for_every_kind_of_token_sequence() -> None:
    import hashlib

    import numpy as np
    import torch

    rng = random.Random(5)
    toks = [rng.randrange(0, 1 << 40) for _ in range(64 * 3 + 40)]  # ids past 32 bits too
    # The formula of the module docstring, byte by byte: stored caches depend on it not changing.
    prev, want = SPACE.digest(), []
    for i in range(3):
        data = b"".join(t.to_bytes(8, "little") for t in toks[i * 64 : (i + 1) * 64])
        prev = hashlib.blake2b(b"C" + prev + data, digest_size=16).digest()
        want.append(SPACE.prefix() + prev.hex())
    tail = b"".join(t.to_bytes(8, "little") for t in toks[192:224])
    want_tail = SPACE.prefix() + hashlib.blake2b(b"T" + prev + tail, digest_size=16).hexdigest() + ".t32"
    k = ChunkKeyer(SPACE)
    for seq in (toks, tuple(toks), np.array(toks, dtype=np.int64), torch.tensor(toks)):
        pk = k.prompt_keys(seq)
        assert pk.full == want, type(seq)
        assert k.tail_key(pk.parent(3), seq[192:224]) == want_tail, type(seq)
        assert [key for n, key in k.tail_candidates(pk.parent(3), seq[192:232], 32)] == [want_tail]


def test_prompts_share_keys_exactly_up_to_the_chunk_where_they_diverge() -> None:
    a = _tokens(320)
    b = list(a)
    b[150] += 1  # inside chunk 2 (tokens 128..191)
    ka, kb = ChunkKeyer(SPACE).prompt_keys(a).full, ChunkKeyer(SPACE).prompt_keys(b).full
    assert len(ka) == len(kb) == 5
    assert ka[:2] == kb[:2]
    assert all(x != y for x, y in zip(ka[2:], kb[2:], strict=True))


def test_only_full_chunks_get_chunk_keys() -> None:
    assert len(ChunkKeyer(SPACE).prompt_keys(_tokens(63)).full) == 0
    assert len(ChunkKeyer(SPACE).prompt_keys(_tokens(64)).full) == 1
    assert len(ChunkKeyer(SPACE).prompt_keys(_tokens(127)).full) == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "other"),
        ("revision", "r2"),
        ("kv_dtype", "torch.bfloat16"),
        ("num_layers", 3),
        ("num_kv_heads", 4),
        ("head_size", 64),
        ("tp_rank", 1),
        ("tp_size", 2),
        ("tenant", "team-a"),
        ("format_version", "maru-kv-L2TD-v2"),
        ("epoch", "3f2a"),
        ("compute", '{"quantization":"fp8"}'),
    ],
)
def test_every_namespace_field_changes_every_key(field: str, value: object) -> None:
    toks = _tokens(200)
    other = dataclasses.replace(SPACE, **{field: value})
    ka, kb = ChunkKeyer(SPACE).prompt_keys(toks).full, ChunkKeyer(other).prompt_keys(toks).full
    assert not set(ka) & set(kb)


def test_empty_optional_fields_keep_the_digest_of_the_fields_before_they_existed() -> None:
    # The keys of an engine that never reset its cache and computes as its checkpoint does must
    # stay those stored before ``epoch`` and ``compute`` were added: the digest of the other
    # fields, computed here independently.
    import hashlib

    fields = {k: v for k, v in dataclasses.asdict(SPACE).items() if k not in ("epoch", "compute")}
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    assert SPACE.epoch == SPACE.compute == ""
    assert SPACE.digest() == hashlib.sha256(blob).digest()
    # ... and the digest and a key as Maru computed them before (86c651f), whatever serialises them.
    assert SPACE.digest().hex() == "23176ed7fe0679a935ef5abcda985315ec86121bf4e22ad9b9924ca40682795d"
    assert ChunkKeyer(SPACE).prompt_keys(list(range(3, 200))).full[0] == (
        "kv1/23176ed7fe0679a9/1a1004bf86651f38c9a602412ab3415d"
    )
    assert dataclasses.replace(SPACE, epoch="e1").digest() != SPACE.digest()
    assert dataclasses.replace(SPACE, compute='{"quantization":"fp8"}').digest() != SPACE.digest()


def test_a_cache_salt_starts_its_own_chain_as_documented() -> None:
    import hashlib

    toks = _tokens(200)
    keyer = ChunkKeyer(SPACE)
    assert keyer.prompt_keys(toks, salt=None).full == keyer.prompt_keys(toks, salt="").full
    assert keyer.prompt_keys(toks).full == keyer.prompt_keys(toks, salt=None).full
    a, b = keyer.prompt_keys(toks, salt="a"), keyer.prompt_keys(toks, salt="b")
    assert not set(a.full) & set(b.full) and not set(a.full) & set(keyer.prompt_keys(toks).full)
    # blake2b(b"S" + namespace digest + salt, 16 bytes), then the chain as without a salt.
    root = hashlib.blake2b(b"S" + SPACE.digest() + b"a", digest_size=16).digest()
    assert a.root == keyer.root_for("a") == root
    assert a.chain == keyer.chain_digests(toks, 0, len(a.full), root)
    # A tail after a salted chunk depends on the salt too (its parent is the salted chain).
    assert keyer.tail_key(a.parent(1), toks[64:90]) != keyer.tail_key(b.parent(1), toks[64:90])


def test_chunk_size_changes_every_key() -> None:
    toks = _tokens(256)
    k64 = ChunkKeyer(SPACE).prompt_keys(toks).full
    k128 = ChunkKeyer(dataclasses.replace(SPACE, chunk_tokens=128)).prompt_keys(toks).full
    assert not set(k64) & set(k128)


def test_tail_keys_depend_on_the_prefix_and_never_equal_a_chunk_key() -> None:
    k = ChunkKeyer(SPACE)
    toks = _tokens(200)
    pk = k.prompt_keys(toks)
    tail = k.tail_key(pk.parent(3), toks[192:200])
    assert tail.endswith(".t8")
    other = list(toks)
    other[0] += 1
    assert k.tail_key(k.prompt_keys(other).parent(3), other[192:200]) != tail
    # A 63-token tail of chunk 0 and the chunk-0 key hash the same bytes but different domains.
    assert k.tail_key(pk.root, toks[:63]) not in pk.full


@pytest.mark.parametrize("chunk_tokens", [64, 256, 1024])
def test_no_hashing_call_gets_enough_bytes_to_give_the_gil_up(monkeypatch, chunk_tokens: int) -> None:
    """CPython's hashlib releases the GIL for one input of 2048 bytes or more, and taking it back
    beside a busy thread costs a switch interval (5 ms): keys are hashed in smaller pieces, with
    the documented digests unchanged."""
    import hashlib
    import types

    import maru.vllm.keys as keys_mod

    sizes: list[int] = []

    class Recording:
        def __init__(self, data: bytes = b"", **kw: object) -> None:
            sizes.append(len(data))
            self.h = hashlib.blake2b(data, **kw)  # type: ignore[arg-type]

        def update(self, data: bytes) -> None:
            sizes.append(memoryview(data).nbytes)
            self.h.update(data)

        def copy(self) -> Recording:
            c = Recording.__new__(Recording)
            c.h = self.h.copy()
            return c

        def digest(self) -> bytes:
            return self.h.digest()

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    space = dataclasses.replace(SPACE, chunk_tokens=chunk_tokens)
    toks = _tokens(chunk_tokens * 3 + chunk_tokens // 2, seed=chunk_tokens)
    plain = ChunkKeyer(space)
    want_full = plain.prompt_keys(toks)
    want_tail = plain.tail_key(
        want_full.parent(3), toks[3 * chunk_tokens : 3 * chunk_tokens + chunk_tokens - 1]
    )
    want_cands = plain.tail_candidates(want_full.parent(1), toks[chunk_tokens:], chunk_tokens // 2)
    # The reference: the documented chain with one blake2b call per digest.
    prev, ref = space.digest(), []
    for i in range(3):
        data = b"".join(t.to_bytes(8, "little") for t in toks[i * chunk_tokens : (i + 1) * chunk_tokens])
        prev = hashlib.blake2b(b"C" + prev + data, digest_size=16).digest()
        ref.append(space.prefix() + prev.hex())
    assert want_full.full == ref

    monkeypatch.setattr(keys_mod, "hashlib", types.SimpleNamespace(blake2b=Recording, sha256=hashlib.sha256))
    k = ChunkKeyer(space)
    got = k.prompt_keys(toks)
    assert got.full == want_full.full and got.chain == want_full.chain
    assert k.tail_key(got.parent(3), toks[3 * chunk_tokens : 4 * chunk_tokens - 1]) == want_tail
    assert k.tail_candidates(got.parent(1), toks[chunk_tokens:], chunk_tokens // 2) == want_cands
    assert sizes and max(sizes) < 2048, max(sizes)
    if chunk_tokens >= 256:
        assert sum(sizes) > 3 * chunk_tokens * 8  # the whole chunks went through the recorder


def test_incremental_tail_candidates_equal_directly_computed_tail_keys() -> None:
    k = ChunkKeyer(SPACE)
    toks = _tokens(128)
    pk = k.prompt_keys(toks)
    cands = k.tail_candidates(pk.parent(1), toks[64:127], 16)
    assert [n for n, _ in cands] == [16, 32, 48]
    for n, key in cands:
        assert key == k.tail_key(pk.parent(1), toks[64 : 64 + n])


# ---------------------------------------------------------------------------- config


def test_unknown_maru_key_is_an_error_naming_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as e:
        MaruConnectorConfig.from_extra_config({"maru_kv_chunk_token": 128})
    msg = str(e.value)
    assert "maru_kv_chunk_token" in msg and "maru_kv_chunk_tokens" in msg and "maru_server_url" in msg


def test_a_removed_key_is_refused_with_why_it_went() -> None:
    from maru.vllm.config import REMOVED_KEYS

    with pytest.raises(ConfigError) as e:
        MaruConnectorConfig.from_extra_config({"maru_store_after_next_forward": True, "maru_nope": 1})
    msg = str(e.value)
    assert "maru_store_after_next_forward was removed" in msg and "drop it" in msg
    assert "maru_nope" in msg and "maru_server_url" in msg  # the other unknown key, the valid ones
    assert not set(REMOVED_KEYS) & set(MaruConnectorConfig.valid_keys())  # removed, not both


def test_keys_without_the_maru_prefix_are_ignored() -> None:
    cfg = MaruConnectorConfig.from_extra_config({"shared_storage_path": "/x", "maru_kv_chunk_tokens": "512"})
    assert cfg.kv_chunk_tokens == 512


@pytest.mark.parametrize(
    "extra",
    [
        {"maru_kv_chunk_tokens": 0},
        {"maru_timeout_s": -1},
        {"maru_log_timing": "maybe"},
        {"maru_server_url": ""},
        {"maru_scheduler_reply_spin_us": -1},
        {"maru_scheduler_reply_spin_us": 20_000},
        {"maru_scheduler_reply_spin_us": True},
        {"maru_gil_probe_ms": -1},
        {"maru_gil_probe_ms": 5000},
        {"maru_gil_probe_ms": "often"},
    ],
)
def test_bad_values_are_errors(extra: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        MaruConnectorConfig.from_extra_config(extra)


def test_the_scheduler_reply_spin_is_a_bounded_number_of_microseconds_zero_turns_it_off() -> None:
    # Unset: polling where the process has cores to spare, none on a small machine (the polling
    # thread would take the core the server needs).
    assert MaruConnectorConfig().scheduler_reply_spin_us is None
    assert MaruConnectorConfig().reply_spin_us(cpus=16) == 500
    assert MaruConnectorConfig().reply_spin_us(cpus=8) == 500
    assert MaruConnectorConfig().reply_spin_us(cpus=7) == 0
    assert MaruConnectorConfig().reply_spin_us(cpus=2) == 0
    assert MaruConnectorConfig().reply_spin_us() in (0, 500)  # this machine's affinity decides
    zero = MaruConnectorConfig.from_extra_config({"maru_scheduler_reply_spin_us": "0"})
    assert zero.reply_spin_us(cpus=16) == 0  # set: as set, whatever the cores
    most = MaruConnectorConfig.from_extra_config({"maru_scheduler_reply_spin_us": 10_000})
    assert most.reply_spin_us(cpus=2) == 10_000


def test_chunk_tokens_are_aligned_down_to_the_block_size_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = MaruConnectorConfig.from_extra_config({"maru_kv_chunk_tokens": 100})
    with caplog.at_level(logging.WARNING, logger="maru.vllm"):
        assert cfg.aligned_to_block_size(32).kv_chunk_tokens == 96
        assert cfg.aligned_to_block_size(128).kv_chunk_tokens == 128  # at least one block
    assert sum("not a multiple" in r.getMessage() for r in caplog.records) == 2
    assert MaruConnectorConfig().aligned_to_block_size(32).kv_chunk_tokens == 256


def test_tail_candidates_longer_than_a_length_are_the_rest_of_the_same_list() -> None:
    keyer = ChunkKeyer(KeySpace("m", "", "float16", 2, 2, 8, 256))
    toks = list(range(1000, 1250))
    parent = keyer.prompt_keys(list(range(256))).chain[0]
    every = keyer.tail_candidates(parent, toks, 16)
    assert keyer.tail_candidates(parent, toks, 16, longer_than=40) == [c for c in every if c[0] > 40]
    assert keyer.tail_candidates(parent, toks, 16, longer_than=48) == [c for c in every if c[0] > 48]
    assert keyer.tail_candidates(parent, toks, 16, longer_than=255) == []


def test_the_configs_spin_bound_is_the_channels() -> None:
    """A value the config accepts never fails the channel's own check (one bound, two units)."""
    from maru.client.rpc import MAX_REPLY_SPIN_S
    from maru.vllm.config import MAX_REPLY_SPIN_US

    assert MAX_REPLY_SPIN_US == round(MAX_REPLY_SPIN_S * 1e6)
