"""The scheduler side with request scopes (``maru.vllm.adapters``), against a real server: a LoRA
request is offered only what its adapter's files stored; a request Maru's keys cannot cover is
left to vLLM, announced once per kind and reported for ``maru doctor``."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from maru.client import MaruHandler
from maru.vllm.adapters import ADAPTER_UNREADABLE, MULTIMODAL
from tests.helpers import reported_slow
from tests.pool_fixtures import module_server
from tests.vllm.helpers import (
    blocks_obj,
    lora,
    make_sched,
    new_out,
    publish,
    req,
    stored_keys_of,
    tokens,
    write_adapter,
)

server = module_server("scopes-server")


def test_a_lora_request_is_offered_only_what_its_adapters_files_stored(
    server, keyer, client, tmp_path
) -> None:
    """Keyed by the adapter's files (``maru.vllm.adapters``): the same files under another name and
    path are offered the store; another adapter and the base model are not, nor the reverse."""
    a = write_adapter(tmp_path / "a", seed=1)
    copy = write_adapter(tmp_path / "copy-of-a", seed=1)
    b = write_adapter(tmp_path / "b", seed=2)
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=22)
    base_keys = stored_keys_of(s, toks)
    publish(server, base_keys[0] + [base_keys[1]])  # the base model's KV of the same tokens

    def with_adapter(rid: str, path: str | None) -> SimpleNamespace:
        r = req(rid, toks)
        r.lora_request = lora(f"name-{rid}", path) if path else None
        return r

    x = with_adapter("x", a)
    assert s.get_num_new_matched_tokens(x, 0) == (0, False)
    s.update_state_after_alloc(x, blocks_obj(list(range(10))), 0)
    meta = s.build_connector_meta(new_out("x", list(range(10)), 0, 300))
    keys = [c.key for rt in meta.stores for c in rt.chunks]
    assert len(keys) == 5 and not set(keys) & set(base_keys[0] + [base_keys[1]])
    publish(server, keys)
    assert s.get_num_new_matched_tokens(with_adapter("y", copy), 0) == (288, False)
    assert s.get_num_new_matched_tokens(with_adapter("z", b), 0) == (0, False)
    assert s.get_num_new_matched_tokens(with_adapter("p", None), 0) == (288, False)  # the base KV


def test_requests_left_to_vllm_are_announced_once_and_reported_for_maru_doctor(
    server, keyer, caplog: pytest.LogCaptureFixture
) -> None:
    with MaruHandler(server.url, timeout_s=2) as h:
        s = make_sched(server, keyer, h)
        toks = tokens(300, seed=23)
        publish(server, stored_keys_of(s, toks)[0])
        mm, hub = req("mm", toks), req("hub", toks)
        mm.mm_features = [object()]  # an image: the same placeholder tokens, other KV
        hub.lora_request = lora("x", "/no/such/adapter")
        with caplog.at_level("WARNING", logger="maru.vllm"):
            for r in (mm, hub, mm, hub):
                assert s.get_num_new_matched_tokens(r, 0) == (0, False)
                assert r.request_id not in s._reqs  # never stored either
        said = [r.getMessage() for r in caplog.records if "computed by vLLM itself" in r.getMessage()]
        assert len(said) == 2
        slow = reported_slow(server)[h.client_id]
        assert MULTIMODAL.note in slow and ADAPTER_UNREADABLE.note in slow
        assert s.get_num_new_matched_tokens(req("plain", toks), 0) == (256, False)  # others still load


def test_a_request_with_an_image_stores_no_tail_reaching_it_and_keys_its_chunks_by_it(
    server, keyer, client
) -> None:
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=24)

    def with_image(rid: str, offset: int, ident: str) -> SimpleNamespace:
        r = req(rid, toks)
        pos = SimpleNamespace(offset=offset, length=16)
        r.mm_features = [SimpleNamespace(identifier=ident, modality="image", mm_position=pos)]
        return r

    plain = s._state(req("plain", toks))
    in_tail = s._state(with_image("in-tail", 270, "a"))  # usable 288: chunks 0-255, tail 256-287
    early = s._state(with_image("early", 150, "a"))
    assert plain is not None and in_tail is not None and early is not None
    assert in_tail.keys.full == plain.keys.full and in_tail.own_tail is None and plain.own_tail is not None
    assert early.keys.full[:2] == plain.keys.full[:2] and not set(early.keys.full[2:]) & set(plain.keys.full)
    assert early.own_tail is not None and early.own_tail[1] != plain.own_tail[1]  # its parent holds the image


def test_live_requests_of_an_adapter_whose_files_change_stop_loading_and_storing(
    server, keyer, client, tmp_path, monkeypatch
) -> None:
    from maru.vllm import adapters

    monkeypatch.setattr(adapters, "RECHECK_S", 0.0)
    a, b = write_adapter(tmp_path / "a", seed=1), write_adapter(tmp_path / "b", seed=2)
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=25)
    ra, rb = req("ra", toks), req("rb", toks)
    ra.lora_request, rb.lora_request = lora("a", a), lora("b", b, lora_int_id=2)
    for r in (ra, rb):
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        s.update_state_after_alloc(r, blocks_obj(list(range(10))), 0)
    st = os.stat(os.path.join(a, "adapter_model.safetensors"))
    os.utime(os.path.join(a, "adapter_model.safetensors"), ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    out = new_out("ra", list(range(10)), 0, 300)
    other = new_out("rb", list(range(10, 20)), 0, 300)
    out.scheduled_new_reqs += other.scheduled_new_reqs
    out.num_scheduled_tokens.update(other.num_scheduled_tokens)
    meta = s.build_connector_meta(out)
    assert [rt.req_id for rt in meta.stores] == ["rb"]  # a's request: neither stored nor loaded now
    assert s._reqs["ra"].frozen and s.stats.adapters_changed == 1 and s.stats.requests_frozen == 1
    again = req("ra2", toks)
    again.lora_request = lora("a", a)
    assert s.get_num_new_matched_tokens(again, 0) == (0, False) and "ra2" not in s._reqs
