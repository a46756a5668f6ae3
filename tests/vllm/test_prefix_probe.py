"""``maru.vllm.prefix_probe``: what the scheduler asks the pool about a prompt, against a real
server, through its key index and through round trips."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from maru.client import MaruHandler
from maru.vllm.keys import ChunkKeyer, KeySpace
from maru.vllm.prefix_probe import PrefixProbe, answers_locally
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server
from tests.vllm.helpers import BS, C, CountingClient, publish, tokens

server = module_server("prefix-probe", pool_size="16M")


class _Local:
    """A key-index client that counts the keys it is asked about."""

    def __init__(self, h: MaruHandler) -> None:
        self.h, self.keys = h, 0
        self.local_exists = h.local_exists

    def exists(self, keys: list[str]) -> list[bool]:
        self.keys += len(keys)
        return self.h.exists(keys)


@pytest.fixture
def handler(server: ServerProcess) -> Iterator[MaruHandler]:
    h = MaruHandler(server.url, timeout_s=2)
    h.exists(["warm-up"])  # connected: the key index is mapped
    try:
        yield h
    finally:
        h.close()


def test_the_key_index_path_asks_fewer_keys_for_the_same_answer(server, handler) -> None:
    keyer = ChunkKeyer(KeySpace("probe-model", "", "float32", 2, 2, 32, C))
    probe = PrefixProbe(keyer, C, BS)
    stored = tokens(6 * C + 40, seed=50)
    pk = keyer.prompt_keys(stored)
    publish(server, pk.full[:4] + [keyer.tail_key(pk.parent(4), stored[4 * C : 4 * C + 32])])
    # Four stored chunks and a 32-token tail after them, then a prompt of its own: the hit ends
    # inside the prompt, the case that asks about the most keys.
    prompt = stored[: 4 * C + 40] + tokens(3 * C, seed=51)
    keys = keyer.prompt_keys(prompt)
    local = _Local(handler)
    remote = CountingClient(server.url)
    try:
        assert answers_locally(local) and not answers_locally(remote)
        got = probe.ask(local, prompt, keys)
        want = probe.ask(remote, prompt, keys)
        assert got.present == want.present == [True] * 4 + [False] * (len(keys.full) - 4)
        assert got.tail_hits == {4: (32, want.tail_hits[4][1])} and want.tail_hits.keys() == {4}
        # Local: the full chunks, then the tails after the last hit chunk only.
        assert local.keys == len(keys.full) + len(probe.tails_at(prompt, keys, 4))
        assert remote.exists_calls == 2  # round trips: all chunks and two tail sets, then the tails at 4
        assert handler.local_exists.counts()["exists_remote"] == 0
    finally:
        remote.close()


@pytest.mark.parametrize("path", ["key index", "round trips"])
def test_chunks_before_start_count_as_present_and_are_not_asked(server, handler, path: str) -> None:
    keyer = ChunkKeyer(KeySpace("probe-start", "", "float32", 2, 2, 32, C))
    probe = PrefixProbe(keyer, C, BS)
    stored = tokens(6 * C + 40, seed=52)
    pk = keyer.prompt_keys(stored)
    publish(server, pk.full[2:4] + [keyer.tail_key(pk.parent(4), stored[4 * C : 4 * C + 32])])
    prompt = stored[: 4 * C + 40] + tokens(3 * C, seed=53)
    keys = keyer.prompt_keys(prompt)
    client = _Local(handler) if path == "key index" else CountingClient(server.url)
    try:
        whole = probe.ask(client, prompt, keys)
        asked_whole = client.keys if path == "key index" else client.keys_asked
        from2 = probe.ask(client, prompt, keys, local=2 * C)
        asked_from2 = (client.keys if path == "key index" else client.keys_asked) - asked_whole
    finally:
        if path != "key index":
            client.close()
    assert whole.present[:4] == [False, False, True, True] and whole.tail_hits == {}  # chunk 0 missing
    assert from2.present == [True, True] + whole.present[2:]  # 0-1: vLLM's own; then the same answer
    assert set(from2.tail_hits) == {4} and from2.tail_hits[4][0] == 32
    assert asked_from2 < asked_whole + len(probe.tails_at(prompt, keys, 4))


def _own_tail(probe: PrefixProbe, keyer: ChunkKeyer, prompt: list[int], keys) -> tuple[int, str] | None:
    """The prompt's own tail as the scheduler keys it (``MaruSchedulerConnector._state``)."""
    n_full = len(keys.full)
    own = probe.usable(len(prompt)) - n_full * C
    return (
        (own, keyer.tail_key(keys.parent(n_full), prompt[n_full * C : n_full * C + own])) if own > 0 else None
    )


def test_asking_the_own_tail_with_the_chunks_gives_the_reference_answer(server, handler) -> None:
    """Random prompts, random stored chunks and tails (the own one, a shorter one, neither), random
    own hits: the key index path given the prompt's own tail answers exactly as without it, and as
    the round-trip path where a tail can be used (after the first missing chunk); where every chunk
    and the own tail are stored it asks one call's keys, no other tail."""
    import random

    keyer = ChunkKeyer(KeySpace("probe-own-tail", "", "float32", 2, 2, 32, C))
    probe = PrefixProbe(keyer, C, BS)
    rng = random.Random(54)
    remote = CountingClient(server.url)
    shortcuts = 0
    try:
        for case in range(40):
            prompt = tokens(rng.randrange(2 * C, 5 * C), seed=1000 + case)
            keys = keyer.prompt_keys(prompt)
            n_full = len(keys.full)
            own = _own_tail(probe, keyer, prompt, keys)
            stored = keys.full[: rng.randrange(n_full + 1)]
            if own is not None and rng.random() < 0.6:
                stored.append(own[1])
            if own is not None and own[0] > BS and rng.random() < 0.4:
                stored.append(keyer.tail_key(keys.parent(n_full), prompt[n_full * C : n_full * C + BS]))
            if stored:
                publish(server, stored)
            local_hit = rng.choice([0, C, (n_full - 1) * C, n_full * C])
            counting = _Local(handler)
            got = probe.ask(counting, prompt, keys, local=local_hit, own_tail=own)
            want = probe.ask(_Local(handler), prompt, keys, local=local_hit)
            assert (got.present, got.tail_hits) == (want.present, want.tail_hits), case
            trips = probe.ask(remote, prompt, keys, local=local_hit)
            first = next((i for i, p in enumerate(got.present) if not p), n_full)
            assert trips.present == got.present and trips.tail_hits.get(first) == got.tail_hits.get(first), (
                case
            )
            if (
                own is not None
                and own[1] in stored
                and len(stored) > n_full
                and local_hit < n_full * C + own[0]
            ):
                asked_chunks = n_full - min(local_hit // C, n_full)
                assert counting.keys == asked_chunks + 1  # the chunks and the own tail, nothing else
                shortcuts += 1
    finally:
        remote.close()
    assert shortcuts >= 5  # the case this is for came up
