"""What the scheduler side knows about each live request, and its counters (``MaruSchedulerConnector``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from maru.vllm.keys import PromptKeys


@dataclass
class RequestState:
    """What the scheduler side knows about one live request."""

    req_id: str
    # vLLM's own list, not a copy (a copy was ~2.4k more elements a request for every young
    # collection to walk while it lived): only its first ``prompt_len`` tokens are this state's.
    # vLLM appends to a streaming session's prompt in place (0.32 and later), never changes a token.
    prompt: list[int]
    prompt_len: int  # the prompt's length when this state was made: its keys' tokens
    keys: PromptKeys
    present: list[bool] | None = None  # per full chunk, from the probe; None: not probed (yet/again)
    probed_local: int = 0  # vLLM's own hit when probed: chunks and tails inside it were not asked
    tail_hits: dict[int, tuple[int, str]] = field(default_factory=dict)  # chunk index -> longest present tail
    own_tail: tuple[int, str] | None = None  # (tokens, key) of the tail this prompt would store
    own_tail_present: bool = False
    local_computed: int = 0
    async_blocks: set[int] = field(default_factory=set)  # blocks of the async load in flight
    async_load_failed: bool = False  # an async load of this request failed: compute it from now on
    match: tuple[int, tuple[int, str] | None] = (0, None)  # (full chunks, tail) behind the last offer
    pending_load: tuple[int, int] | None = None  # request tokens [begin, end) to load in the next step
    block_ids: list[int] = field(default_factory=list)
    planned: set[int] = field(default_factory=set)
    tail_planned: bool = False
    # maru_async_store: a store was planned since the request's last preemption, so its blocks stay
    # allocated after it finishes until the worker reports it in finished_sending.
    sending: bool = False
    # Alive when vLLM reset the connector's cache (``MaruSchedulerConnector.reset_cache``): its KV may
    # come partly from before (other weights), so it is never loaded for nor stored from again.
    frozen: bool = False
    adapter: bytes | None = None  # its LoRA adapter's digest (``maru.vllm.adapters``), if any

    def prompt_tokens(self) -> list[int]:
        """The prompt as it was when this state was made (its keys' tokens): the list itself, or
        its first ``prompt_len`` tokens where vLLM has appended to it since."""
        p = self.prompt
        return p if len(p) == self.prompt_len else p[: self.prompt_len]


@dataclass
class SchedulerStats:
    requests_probed: int = 0
    keys_remembered: int = 0  # chunk keys found by vLLM's block hash (``ChunkKeyCache``): not hashed
    keys_hashed: int = 0  # chunk keys hashed from the tokens
    adapters_changed: int = 0  # LoRA adapters whose files changed after they were keyed
    server_wakes: int = 0  # wake-ups posted before a probe whose pin may follow (``_wake_for_pins``)
    requests_hit: int = 0
    tokens_offered: int = 0
    chunks_planned: int = 0
    tails_planned: int = 0
    probe_failures: int = 0
    load_failures_reported: int = 0
    requests_preempted: int = 0
    async_loads_planned: int = 0
    async_loads_finished: int = 0
    async_loads_deferred: int = 0  # offers answered "ask again later": the admission window was full
    # ... or: another request's load in flight places the chunk it needs next (vLLM's prefix cache
    # holds it once that load is reported), so it is loaded once, not once per request
    async_loads_shared: int = 0
    async_share_timeouts: int = 0  # ... waits that ran out (``SharedWaits``): loaded its own copy
    async_hits_computed: int = 0  # hits under maru_async_min_load_tokens: computed, not loaded
    delayed_frees: int = 0  # maru_async_store: finished requests whose blocks wait for their stores
    delayed_frees_released: int = 0  # ... and were reported in finished_sending since
    # Where a failed load ends its request: hits computed because not every worker had reported
    # it can load (a rank disconnected or disabled; or, on a vLLM without the start handshake,
    # before the first step's report).
    offers_withheld: int = 0
    cache_resets: int = 0  # vLLM's resets of the connector's cache: each a new key epoch
    requests_frozen: int = 0  # requests alive at a reset: computed, never stored
    requests_rekeyed: int = 0  # ... asked about again with nothing computed: keyed afresh
