"""The guesses of vLLM's own hit at a request's arrival: ``RecentKeys`` (whole chunks this engine
placed or stored) and ``RecentBlocks`` (vLLM's block hashes of the requests that finished lately).
In real use: tests/vllm/test_pins_on_arrival.py."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from maru.vllm.recent_keys import RecentBlocks, RecentKeys

BS = 16


def chain(tokens: list[int], block: int = BS) -> list[bytes]:
    """vLLM's block hashes in miniature: a chain, each block's hash over its parent's and its tokens."""
    out, parent = [], b""
    for b in range(len(tokens) // block):
        parent = hashlib.sha256(parent + repr(tokens[b * block : (b + 1) * block]).encode()).digest()
        out.append(parent)
    return out


def request(tokens: list[int], hashes: list[bytes] | None = None) -> SimpleNamespace:
    return SimpleNamespace(num_tokens=len(tokens), block_hashes=chain(tokens) if hashes is None else hashes)


def test_a_next_turn_is_guessed_to_the_last_full_block_of_the_turn_before() -> None:
    rb = RecentBlocks(BS)
    turn1 = list(range(1000, 1000 + 5 * BS + 7))  # 5 full blocks and 7 tokens
    assert rb.leading_tokens(request(turn1)) == 0  # nothing finished yet
    rb.note(request(turn1))
    turn2 = turn1 + list(range(9, 9 + 3 * BS))  # the turn before, then 3 blocks' worth more
    assert rb.leading_tokens(request(turn2)) == 5 * BS  # block 6 holds the old tail and new tokens
    other = [t + 1 for t in turn2]  # same length, other tokens: no block of it was seen
    assert rb.leading_tokens(request(other)) == 0
    # A prompt that shares the first two blocks only (then differs): two blocks, by the chain.
    fork = turn1[: 2 * BS] + [7] * (4 * BS)
    assert rb.leading_tokens(request(fork)) == 2 * BS


def test_hashes_that_do_not_line_up_with_the_tokens_give_no_guess_and_are_not_noted() -> None:
    rb = RecentBlocks(BS)
    toks = list(range(4 * BS))
    wrong = request(toks, chain(toks, block=2 * BS))  # another hash block size: 2 hashes for 4 blocks
    rb.note(wrong)
    assert len(rb) == 0
    rb.note(request(toks))
    assert rb.leading_tokens(wrong) == 0
    assert rb.leading_tokens(SimpleNamespace(num_tokens=len(toks), block_hashes=None)) == 0
    assert rb.leading_tokens(SimpleNamespace(request_id="no hashes at all")) == 0
    assert rb.leading_tokens(request(toks)) == 4 * BS


def test_only_the_blocks_a_request_computed_are_noted() -> None:
    """An aborted request's hashes cover its whole prompt; vLLM's cache holds only what it computed."""
    rb = RecentBlocks(BS)
    toks = list(range(6 * BS))
    aborted = request(toks)
    aborted.num_computed_tokens = 2 * BS + 5  # two full blocks computed before the abort
    rb.note(aborted)
    assert len(rb) == 2 and rb.leading_tokens(request(toks)) == 2 * BS
    done = request(toks)
    done.num_computed_tokens = 6 * BS - 1  # finished: all but the last sampled token computed
    rb.note(done)
    assert rb.leading_tokens(request(toks + [1] * BS)) == 5 * BS


def test_with_a_stride_a_turns_end_and_its_chunks_ends_are_noted_and_guessed() -> None:
    """``stride`` blocks a chunk: only each chunk's last block's hash and the turn's last are kept;
    a next turn is still guessed to the block, another conversation sharing a prefix to the chunk."""
    rb = RecentBlocks(BS, stride=4)
    turn1 = list(range(2000, 2000 + 10 * BS + 3))  # 10 full blocks: chunks end at blocks 4 and 8
    rb.note(request(turn1))
    assert len(rb) == 3  # blocks 4, 8 and 10 (the turn's last)
    assert rb.leading_tokens(request(turn1 + [5] * (2 * BS))) == 10 * BS  # the next turn: to the block
    other_user = turn1[: 6 * BS] + [9] * (3 * BS)  # shares 6 blocks: guessed to the chunk before
    assert rb.leading_tokens(request(other_user)) == 4 * BS
    with pytest.raises(ValueError, match="stride"):
        RecentBlocks(BS, stride=0)


def test_the_least_recently_finished_go_first_past_the_capacity() -> None:
    rb = RecentBlocks(BS, capacity=6)
    a, b = list(range(4 * BS)), list(range(500, 500 + 4 * BS))
    rb.note(request(a))
    rb.note(request(b))  # 8 hashes noted, 6 kept: a's first two went
    assert len(rb) == 6
    assert rb.leading_tokens(request(b)) == 4 * BS
    assert rb.leading_tokens(request(a)) == 4 * BS  # a's last two blocks stand for their prefix
    rb.note(request(a))  # a noted again: now b's oldest go
    assert rb.leading_tokens(request(b[: 2 * BS])) == 0


def test_recent_keys_take_the_leading_run_of_chunks_noted() -> None:
    rk = RecentKeys(capacity=3)
    rk.note(["k1", "k2", "k3"])
    assert rk.leading(["k1", "k2", "x", "k3"]) == 2
    rk.note(["k4"])  # k1 goes
    assert rk.leading(["k1", "k2"]) == 0 and "k4" in rk and len(rk) == 3
