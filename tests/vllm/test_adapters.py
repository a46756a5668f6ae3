"""RequestScopes and AdapterDigests: a LoRA request is keyed by its adapter's files, never by its
name; requests Maru's keys cannot cover are left to vLLM with a note that says which and why."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from maru.vllm import adapters as A
from maru.vllm.adapters import AdapterDigests, RequestScope, RequestScopes, Skipped, lora_compute
from maru.vllm.key_cache import ChunkKeyCache
from maru.vllm.keys import ChunkKeyer, KeySpace
from tests.vllm.helpers import lora, write_adapter

SPACE = KeySpace("m", "r", "torch.bfloat16", 4, 2, 64, 64)


def request(lora_request: object = None, salt: str | None = None, **kw: object) -> SimpleNamespace:
    base = {
        "prompt_token_ids": [1, 2, 3],
        "mm_features": None,
        "cache_salt": salt,
        "lora_request": lora_request,
    }
    return SimpleNamespace(**{**base, **kw})


def test_the_same_files_share_under_any_name_or_path_and_other_files_never(tmp_path: Path) -> None:
    digests = AdapterDigests()
    a = write_adapter(tmp_path / "a", seed=1)
    a_copy = str(tmp_path / "elsewhere" / "a-renamed")
    shutil.copytree(a, a_copy)
    b = write_adapter(tmp_path / "b", seed=2)
    da = digests.digest(lora("a", a))
    assert isinstance(da, bytes) and len(da) == 32
    assert digests.digest(lora("another-name", a_copy)) == da
    assert digests.digest(lora("a", b)) != da  # the same name, other weights
    # A file's relative path is part of it: the same bytes under another name are another adapter.
    moved = write_adapter(tmp_path / "moved", seed=1)
    os.rename(Path(moved) / "adapter_model.safetensors", Path(moved) / "adapter_model.bin")
    assert digests.digest(lora("a", moved)) != da


def touch(path: Path) -> None:
    """Move a file's modification time on (a rewrite within the clock's step would not)."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_an_adapter_is_read_once_and_one_rewritten_in_place_is_never_keyed_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM keeps the weights it loaded per lora_int_id and reloads them on eviction or
    load_inplace: after the files change, either version may compute, so neither is vouched for."""
    digests = AdapterDigests()
    path = write_adapter(tmp_path / "a", seed=1)
    (Path(path) / "optimizer.pt").write_bytes(b"x" * 10_000)  # not what vLLM loads: not read
    first = digests.digest(lora("a", path))
    read = digests.hashed_bytes
    assert 3000 < read < 10_000
    assert digests.digest(lora("a", path)) == first and digests.hashed_bytes == read  # listed, not read
    assert digests.take_changed() == []
    write_adapter(tmp_path / "a", seed=9)  # the next training step's weights, same name and path
    touch(Path(path) / "adapter_model.safetensors")
    with caplog.at_level("WARNING", logger="maru.vllm"):
        assert digests.digest(lora("a", path)) is A.ADAPTER_CHANGED
        assert digests.digest(lora("a", path)) is A.ADAPTER_CHANGED  # for good
    assert digests.take_changed() == [first] and digests.take_changed() == []
    assert len([r for r in caplog.records if "files changed after Maru keyed them" in r.getMessage()]) == 1
    assert A.ADAPTER_CHANGED.announce and "new lora_name and lora_int_id" in A.ADAPTER_CHANGED.note
    # The new version under a new id is keyed (as an engine that never saw the old files keys it).
    fresh = digests.digest(lora("a-v2", path, lora_int_id=2))
    assert isinstance(fresh, bytes) and fresh != first and fresh == AdapterDigests().digest(lora("x", path))


def test_a_change_under_live_requests_is_found_by_the_recheck(tmp_path: Path) -> None:
    digests = AdapterDigests()
    path = write_adapter(tmp_path / "a", seed=1)
    d = digests.digest(lora("a", path))
    assert isinstance(d, bytes) and digests.pinned
    digests.recheck({d}, every_s=0.0)
    assert digests.take_changed() == []
    touch(Path(path) / "adapter_config.json")
    digests.recheck(set(), every_s=0.0)  # no live request of it: not looked at
    assert digests.take_changed() == []
    digests.recheck({d}, every_s=3600.0)  # looked at within the hour: not again
    assert digests.take_changed() == []
    digests.recheck({d}, every_s=0.0)
    assert digests.take_changed() == [d] and not digests.pinned


def test_a_lora_request_of_another_class_is_never_keyed_by_its_path(tmp_path: Path) -> None:
    """A subclass of vLLM's LoRARequest may carry its weights in memory (RL frameworks do), its
    path a placeholder: the files there say nothing of them."""

    class TensorLoRARequest(SimpleNamespace):
        pass

    path = write_adapter(tmp_path / "a", seed=1)
    req = TensorLoRARequest(lora_name="t", lora_int_id=1, lora_path=path)
    assert AdapterDigests().digest(req) is A.ADAPTER_UNREADABLE


def test_the_engines_lora_dtype_is_part_of_the_digest(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", seed=1)
    plain = AdapterDigests(lora_compute(SimpleNamespace(lora_config=SimpleNamespace(lora_dtype="auto"))))
    fp32 = AdapterDigests(
        lora_compute(SimpleNamespace(lora_config=SimpleNamespace(lora_dtype="torch.float32")))
    )
    assert lora_compute(SimpleNamespace(lora_config=None)) == ""
    assert plain.digest(lora("a", path)) == AdapterDigests().digest(lora("a", path))
    assert fp32.digest(lora("a", path)) != plain.digest(lora("a", path))


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: lora("none", ""),
        lambda tmp: lora("missing", str(tmp / "no-such-dir")),
        lambda tmp: lora("file", write_adapter(tmp / "d", 1) + "/adapter_config.json"),
        lambda tmp: lora(
            "tz", write_adapter(tmp / "t", 1), tensorizer_config_dict={"tensorizer_uri": "s3://x"}
        ),
    ],
    ids=["no-path", "no-such-dir", "a-file", "tensorizer"],
)
def test_an_adapter_that_cannot_be_read_as_a_directory_is_left_to_vllm_never_keyed_by_name(
    tmp_path: Path, make, caplog: pytest.LogCaptureFixture
) -> None:
    scopes = RequestScopes()
    req = request(make(tmp_path))
    with caplog.at_level("WARNING", logger="maru.vllm"):
        assert scopes.of(req) is A.ADAPTER_UNREADABLE
        assert scopes.of(req) is A.ADAPTER_UNREADABLE
    said = [r for r in caplog.records if "left to vLLM" in r.getMessage()]
    assert len(said) == 1  # once per adapter path


def test_an_adapter_changing_while_it_is_read_is_not_keyed(tmp_path: Path, monkeypatch) -> None:
    path = write_adapter(tmp_path / "a", seed=1)
    digests = AdapterDigests()
    real = A._listing
    calls = {"n": 0}

    def listing_then_write(p: str):  # the trainer writes between the listing and the read
        calls["n"] += 1
        out = real(p)
        if calls["n"] == 1:
            with open(Path(p) / "adapter_model.safetensors", "ab") as f:
                f.write(b"more")
        return out

    monkeypatch.setattr(A, "_listing", listing_then_write)
    assert digests.digest(lora("a", path)) is A.ADAPTER_CHANGING and not A.ADAPTER_CHANGING.announce
    monkeypatch.setattr(A, "_listing", real)
    assert isinstance(digests.digest(lora("a", path)), bytes)  # tried again at the next request


def test_scopes_of_plain_salted_lora_multimodal_and_embedding_requests(tmp_path: Path) -> None:
    scopes = RequestScopes()
    path = write_adapter(tmp_path / "a", seed=1)
    d = scopes.adapters.digest(lora("a", path))
    assert scopes.of(request()) == RequestScope()
    assert scopes.of(request(salt="t")) == RequestScope(salt="t")
    assert scopes.of(request(lora("a", path), salt="t")) == RequestScope(salt="t", adapter=d)  # type: ignore[arg-type]
    assert scopes.of(request(mm_features=[object()])) is A.MULTIMODAL
    assert scopes.of(request(prompt_token_ids=None)) is A.EMBEDDINGS
    for note in (A.MULTIMODAL, A.EMBEDDINGS, A.ADAPTER_UNREADABLE):
        assert isinstance(note, Skipped) and "computed by vLLM itself" in note.note and "Fix:" in note.note


def test_an_adapters_keys_meet_no_others_and_the_plain_keys_are_unchanged(tmp_path: Path) -> None:
    """The chain of an adapter starts at its own root; salted on top of it, again another. The
    plain chain and the salted one are those of before adapters existed (``root_for``)."""
    keyer = ChunkKeyer(SPACE)
    digests = AdapterDigests()
    da = digests.digest(lora("a", write_adapter(tmp_path / "a", seed=1)))
    db = digests.digest(lora("b", write_adapter(tmp_path / "b", seed=2)))
    assert isinstance(da, bytes) and isinstance(db, bytes)
    rng = random.Random(4)
    toks = [rng.randrange(50_000) for _ in range(3 * 64 + 10)]
    roots = {(salt, ad): keyer.root_for(salt, ad) for salt in (None, "t") for ad in (None, da, db)}
    assert len(set(roots.values())) == 6
    assert roots[(None, None)] == keyer.root and keyer.root_for("t") == roots[("t", None)]
    keys = {k: keyer.prompt_keys(toks, salt=k[0], adapter=k[1]).full for k in roots}
    assert keys[(None, None)] == keyer.prompt_keys(toks).full
    flat = [k for ks in keys.values() for k in ks]
    assert len(set(flat)) == len(flat) == 6 * 3
    # The digest cache keeps them apart where vLLM's block hashes are the same for all of them.
    cache = ChunkKeyCache(keyer, 16)
    same = [bytes([i]) * 8 for i in range(len(toks) // 16)]
    for _ in range(2):
        for (salt, ad), want in keys.items():
            assert cache.prompt_keys(toks, same, len(toks), salt=salt, adapter=ad).full == want
    assert cache.hits == cache.hashed == 6 * 3


def fake_hub_cache(root: Path, repo_id: str, files_from: str) -> str:
    """``repo_id`` in a Hugging Face cache at ``root`` as a download leaves it (refs/main naming a
    snapshot directory); returns the snapshot's path."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    shutil.copytree(files_from, snap)
    return str(snap)


def test_a_hugging_face_id_is_keyed_by_its_cached_files_once_vllm_downloaded_it(
    tmp_path: Path, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's worker downloads a hub adapter at its first request, after the scheduler keyed it:
    until it is in this host's cache its requests are left to vLLM quietly (INFO, never reported),
    then keyed by the cached files (equal to the same files on a local path). Never downloaded by
    Maru, never keyed by the id; still missing after ``PENDING_S``: announced."""
    import huggingface_hub.constants as hf

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(cache))
    local = write_adapter(tmp_path / "local", seed=1)
    digests = AdapterDigests()
    with caplog.at_level("INFO", logger="maru.vllm"):
        assert digests.digest(lora("hub", "org/adapter")) is A.ADAPTER_PENDING
        assert digests.digest(lora("hub", "org/adapter")) is A.ADAPTER_PENDING
    assert not A.ADAPTER_PENDING.announce
    assert [r.levelname for r in caplog.records if "org/adapter" in r.getMessage()] == ["INFO"]
    snap = fake_hub_cache(cache, "org/adapter", local)  # vLLM's worker downloaded it
    assert A.resolve("org/adapter") == snap
    # A miss is remembered for RESOLVE_S (a waiting request is asked about at every step) ...
    assert digests.digest(lora("hub", "org/adapter")) is A.ADAPTER_PENDING
    monkeypatch.setattr(A, "RESOLVE_S", 0.0)  # ... then looked up again
    assert digests.digest(lora("hub", "org/adapter")) == digests.digest(lora("local", local))
    monkeypatch.setattr(A, "PENDING_S", 0.0)
    with caplog.at_level("WARNING", logger="maru.vllm"):
        assert digests.digest(lora("other", "org/never-downloaded")) is A.ADAPTER_UNREADABLE
    assert any("org/never-downloaded" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_relative_and_home_paths_resolve_as_vllm_resolves_them(tmp_path: Path, monkeypatch) -> None:
    write_adapter(tmp_path / "rel" / "a", seed=1)
    monkeypatch.chdir(tmp_path)
    assert A.resolve("rel/a") == str(tmp_path / "rel" / "a")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert A.resolve("~/rel/a") == str(tmp_path / "rel" / "a")
    with pytest.raises(NotADirectoryError):
        A.resolve(str(tmp_path / "rel" / "a" / "adapter_config.json"))
