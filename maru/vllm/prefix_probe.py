"""Which of a prompt's chunks and block-aligned tails the pool holds: the scheduler side's probe.

Only a tail right after the last hit chunk can extend a hit, so tails are asked about there
alone. Through server round trips (no key index), the first trip asks for every full chunk key
and the tails after chunk 0 (a cold prompt) and after the last full chunk (the same prompt again,
the common hit); a second one, only when the hit ends at a chunk in between, asks for the tails
there. Probing every chunk's tails in one trip cost ~2 ms a 2.4k-token request on vLLM's
scheduling thread (hashing ~160 tail keys, the server checking them), which a step of 16 new
requests paid 16 times before its forward.

When the key index answers (no round trip), the full chunks are asked first and the tails only
where the hit ends: 24 keys instead of 46 for a 2.4k-token prompt whose hit ends inside it, and
one set of tail candidates hashed instead of three (150 -> 115 us a request in process,
``bench/scheduler_probe.py``). The prompt's own tail, keyed anyway for its store, is asked with
the chunks: the same prompt stored before (another instance's turn this one now serves) is then
answered by that one call, with no candidate hashed (the probe of a warm instance's next turn
63-77 -> 35 us on the CI machine).

Full chunks that vLLM's own prefix cache already covers (``num_computed_tokens``) are not asked
about at all, nor tails ending inside it: neither a load nor a store needs them. In a
multi-round conversation a new turn is mostly such chunks (the system prompt, the earlier
rounds), so its probe checks a chunk or two and the tails after them instead of every chunk of
the history (8 keys instead of 24 for a 2.4k-token turn, ``bench/scheduler_probe.py --local-hit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from maru.vllm.keys import ChunkKeyer, PromptKeys, rank_keys


@dataclass
class ProbeResult:
    """``present``: per full chunk; ``tail_hits``: chunk index -> the longest present tail there
    (tokens, key), for the chunk indices asked about."""

    present: list[bool]
    tail_hits: dict[int, tuple[int, str]] = field(default_factory=dict)


class PrefixProbe:
    """Asks a client about one prompt's keys; stateless apart from the geometry."""

    def __init__(self, keyer: ChunkKeyer, chunk_tokens: int, block_size: int, tp_size: int = 1) -> None:
        self.keyer = keyer
        self.chunk = chunk_tokens
        self.block_size = block_size
        self.tp_size = tp_size

    def usable(self, prompt_len: int) -> int:
        """Prompt tokens vLLM may take from outside: all but the last, whole blocks only."""
        return max(0, (prompt_len - 1) // self.block_size * self.block_size)

    def tails_at(
        self, prompt: list[int], keys: PromptKeys, i: int, local: int = 0
    ) -> list[tuple[int, int, str]]:
        """The block-aligned tail candidates after full chunk ``i`` (chunk index, tokens, key) that
        end beyond ``local`` tokens (vLLM's own hit: a tail inside it is of no use)."""
        begin = i * self.chunk
        end = min(begin + self.chunk - 1, self.usable(len(prompt)))
        if (plain := keys.plain_tokens_from(begin)) is not None:
            end = min(end, begin + plain)  # a tail names tokens only: never one reaching an image
        if end - begin < self.block_size or end <= local:
            return []
        cands = self.keyer.tail_candidates(
            keys.parent(i), prompt[begin:end], self.block_size, longer_than=max(0, local - begin)
        )
        return [(i, n, key) for n, key in cands]

    def exists(self, client: Any, keys: list[str]) -> list[bool]:
        """One ``exists`` call; a key is present when every rank's shard is."""
        if not keys:
            return []
        flat = client.exists([rk for k in keys for rk in rank_keys(k, self.tp_size)])
        r = self.tp_size
        return [all(flat[j * r : (j + 1) * r]) for j in range(len(keys))]

    def ask(
        self,
        client: Any,
        prompt: list[int],
        keys: PromptKeys,
        local: int = 0,
        own_tail: tuple[int, str] | None = None,
    ) -> ProbeResult:
        """What the pool holds of ``prompt`` (raises what ``client.exists`` raises).

        ``local``: tokens vLLM's own prefix cache holds. The full chunks inside them are not asked
        about and count as present, nor are the tails that end inside them: neither a load nor a
        store needs them. The caller asks again if vLLM's hit shrinks (``MaruSchedulerConnector``).
        ``own_tail``: the prompt's own tail (tokens, key), the longest tail candidate after its last
        full chunk. Through the key index it is asked with the chunks: when every chunk and it are
        present (the same prompt stored before: a warm instance's next turn) that is the answer,
        and no other candidate is hashed or asked about (the same answer: it is the longest).
        """
        n_full = len(keys.full)
        start = min(local // self.chunk, n_full)
        asked = keys.full[start:]
        if answers_locally(client):
            own = own_tail if own_tail is not None and n_full * self.chunk + own_tail[0] > local else None
            got = self.exists(client, asked + [own[1]] if own is not None else asked)
            present = [True] * start + got[: len(asked)]
            first = _first_miss(present)
            if own is not None and first == n_full and got[-1]:
                return ProbeResult(present, {n_full: own})
            tails = self.tails_at(prompt, keys, first, local)
            tail_present = self.exists(client, [k for _, _, k in tails])
        else:
            tails = self.tails_at(prompt, keys, n_full, local)
            if start < n_full:  # a hit ending where the asked chunks start
                tails += self.tails_at(prompt, keys, start, local)
            flat = self.exists(client, asked + [k for _, _, k in tails])
            present = [True] * start + flat[: len(asked)]
            tail_present = flat[len(asked) :]
            hits = _first_miss(present)
            if start < hits < n_full:
                more = self.tails_at(prompt, keys, hits, local)
                tails += more
                tail_present += self.exists(client, [k for _, _, k in more])
        out = ProbeResult(present)
        for (i, n, key), hit in zip(tails, tail_present, strict=True):
            if hit and n > out.tail_hits.get(i, (0, ""))[0]:
                out.tail_hits[i] = (n, key)
        return out


def _first_miss(present: list[bool]) -> int:
    return next((j for j, p in enumerate(present) if not p), len(present))


def answers_locally(client: Any) -> bool:
    """Whether ``client.exists`` reads the server's key index now (no round trip per call)."""
    local = getattr(client, "local_exists", None)
    return local is not None and local.indexed
