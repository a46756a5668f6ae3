"""CUDA-graph placement for a fixed set of GPU caches: low issue cost for the hot path.

A plain Triton launch from Python costs ~30 us of host time, more than the copy itself at 256 tokens
and far over the 10 us a layer the layer-overlap load can afford. A replayed CUDA graph costs ~5 us.
Graphs bake their arguments in, so a ``GraphedPlacer`` owns static buffers:

* ``slots(T)``: int64 slot mapping of T tokens (``set_slots`` copies a mapping in; -1 skips);
* ``staging(T)``: the object ``[L, KV, T, NH*HS]`` the graphs read (scatter) or write (gather).

Callers fill ``staging(T)`` (typically one copy-engine copy from a pool page), call ``set_slots`` and
then ``scatter(T)`` (all layers, one kernel) or ``scatter_layer(layer, T)`` per layer. One graph is
captured per (operation, T[, layer]) on first use; T is the token count of a call (a multiple of the
chunk size in practice, so few distinct values). Invariant: the caches never move (vLLM allocates
them once per process); build a new placer if they do.
"""

from __future__ import annotations

import gc
import logging
import math
from typing import Any

import torch

from maru.announce import announce_once
from maru.kv_ops import checksum as ck
from maru.kv_ops import direct_kernel, triton_kernels
from maru.kv_ops.cuda_sync import D2D, current_stream_handle
from maru.kv_ops.layout import KVLayout
from maru.kv_ops.ops import _first_tensor, layer_refs
from maru.kv_ops.selection import resolve

log = logging.getLogger("maru.kv_ops")


class GraphedPlacer:
    """Gather/scatter between static staging buffers and fixed CUDA caches, replayed from CUDA graphs."""

    def __init__(
        self, caches: Any, layout: KVLayout, *, max_token_counts: int = 8, launcher: Any = None
    ) -> None:
        """``launcher``: a ``cuda_sync.RawSync`` to replay graphs through ``cudaGraphLaunch`` while
        keeping the GIL (see ``cuda_sync``); None replays through torch, which releases it."""
        self.layout = layout
        self._launcher = launcher
        self._execs: dict[tuple, int] = {}  # key -> raw cudaGraphExec_t (0: replay through torch)
        self._refs = layer_refs(caches, layout)
        self.device = self._refs[0][0].device
        if self.device.type != "cuda":
            raise ValueError("GraphedPlacer needs CUDA caches; use maru.kv_ops.gather/scatter elsewhere")
        resolve("triton", "cuda")  # raises BackendUnavailable with the reason when triton cannot run
        # The refs are integer views (bit-exact copies); staging keeps the caches' own dtype so that a
        # caller's ``staging(T).copy_(obj)`` moves bits, never converts values.
        self.dtype = _first_tensor(caches).dtype
        self.num_layers = len(self._refs)
        # Whether the scatter can checksum what it reads (rows of whole 64-bit words): read per load.
        self.fused_checksum = triton_kernels.fused_checksum_ok(layout, self._refs[0][0].element_size())
        self.fused_refused: str | None = None  # why the fused kernel was turned off, if it was
        self.max_token_counts = max_token_counts
        self._slots: dict[int, torch.Tensor] = {}
        self._staging: dict[int, torch.Tensor] = {}
        self._own_sizes = 0  # sizes with a staging buffer of their own (``max_token_counts`` of them)
        self._shared: torch.Tensor | None = None  # ``share_staging``'s one buffer
        self._shared_tokens = 0
        self._sums: dict[int, torch.Tensor] = {}  # T -> one int64: the "checksum" graph's raw sum
        self._direct: dict[int, torch.Tensor] = {}  # T -> static [3, T] direct table
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None  # one memory pool shared by all graphs of this placer
        # The one-launch layer load: per (T, checksum), ALL_LAYER_GRAPHS graphs of every layer's
        # direct kernel, each followed by an event-record node of that graph's own events.
        self._all_events: dict[tuple, list[int]] = {}
        self._all_next: dict[tuple[int, bool], int] = {}
        # The paced lane's placer: the store state its "paced-chunk" graphs read (``PacedBatch``).
        self.batch: Any = None

    # -- static buffers ---------------------------------------------------------------------------
    def _ensure(self, num_tokens: int) -> None:
        if num_tokens in self._slots:
            return
        shared = self._shared is not None and num_tokens <= self._shared_tokens
        if not shared and self._own_sizes >= self.max_token_counts:
            raise ValueError(
                f"GraphedPlacer already holds buffers for {sorted(self._slots)} tokens (max_token_counts="
                f"{self.max_token_counts}); pad calls to a few token counts (chunk multiples)"
            )
        self._slots[num_tokens] = torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device)
        shape = (self.num_layers, self.layout.num_kv, num_tokens, self.layout.row_size)
        if shared:
            assert self._shared is not None
            self._staging[num_tokens] = self._shared[: math.prod(shape)].view(shape)
        else:
            self._staging[num_tokens] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._own_sizes += 1
        self._sums[num_tokens] = torch.zeros(1, dtype=torch.int64, device=self.device)

    def share_staging(self, max_tokens: int) -> None:
        """From now on, ``staging(T)`` for every T <= ``max_tokens`` is the start of one buffer of
        ``max_tokens`` tokens (contiguous, ``[L, KV, T, ROW]``), so that graphs for many sizes (a
        store's partial tails: every block multiple below the chunk) cost graphs, not memory.

        Safe because a placer's staging holds one chunk at a time: its owner (a staging slot)
        orders every use after the previous one's last reader (``StagingSlot.free``). Only before
        any staging buffer exists (a graph captured since would read the old one)."""
        if self._shared is not None and self._shared_tokens >= max_tokens:
            return  # shared already (a second warm-up)
        if self._staging:
            raise RuntimeError("GraphedPlacer.share_staging must come before any staging buffer is made")
        numel = self.num_layers * self.layout.num_kv * int(max_tokens) * self.layout.row_size
        self._shared = torch.zeros(numel, dtype=self.dtype, device=self.device)
        self._shared_tokens = int(max_tokens)

    def staging(self, num_tokens: int) -> torch.Tensor:
        """The static object buffer ``[L, KV, T, NH*HS]`` that graphs for T tokens read and write."""
        self._ensure(num_tokens)
        return self._staging[num_tokens]

    def slots(self, num_tokens: int) -> torch.Tensor:
        self._ensure(num_tokens)
        return self._slots[num_tokens]

    def set_slots(self, slot_mapping: torch.Tensor, *, skip_tokens: int = 0) -> int:
        """Copy a slot mapping into the static buffer of its length (stream-ordered, no sync); the
        first ``skip_tokens`` become -1 (not written). Returns T."""
        num_tokens = int(slot_mapping.numel())
        buf = self.slots(num_tokens)
        buf.copy_(slot_mapping, non_blocking=True)
        if skip_tokens:
            buf[:skip_tokens].fill_(-1)
        return num_tokens

    def slots_from(self, address: int, num_tokens: int, stream: int) -> None:
        """``set_slots`` from a device address (``num_tokens`` contiguous int64), queued on the raw
        ``stream`` through the launcher (the GIL kept): the raw store's per-chunk copy."""
        self._launcher.copy(self.slots(num_tokens).data_ptr(), address, num_tokens * 8, stream, D2D)

    def direct_table(self, num_tokens: int) -> torch.Tensor:
        """The static ``[DIRECT_ROWS, T + 1]`` table the direct (zero-copy) layer graphs for T tokens read.

        Rows as ``direct_kernel.direct_table_host`` builds them; slots start at -1 (nothing placed).
        No staging buffer: the direct kernel reads the chunk objects where they lie.
        """
        tab = self._direct.get(num_tokens)
        if tab is None:
            if len(self._direct) >= 2 * self.max_token_counts + 8:
                raise ValueError(
                    f"GraphedPlacer already holds direct tables for {sorted(self._direct)} tokens; pad calls "
                    f"to a few token counts"
                )
            # W + 1 columns: the last says how the addresses are indexed (see direct_table_host).
            tab = torch.zeros(
                (direct_kernel.DIRECT_ROWS, num_tokens + 1), dtype=torch.int64, device=self.device
            )
            tab[2].fill_(-1)
            self._direct[num_tokens] = tab
        return tab

    # -- graphs -----------------------------------------------------------------------------------
    def _launch(self, key: tuple) -> None:
        op, num_tokens, layer = key
        if op in ("direct-all", "direct-all+checksum"):
            tab = self.direct_table(num_tokens)
            events = self._all_events[key]
            stream = torch.cuda.current_stream(self.device)
            # An event-record node inside the capture; the warm-up launch before it records plainly
            # (CUDA refuses the external flag outside a capture).
            capturing = torch.cuda.is_current_stream_capturing()
            for i in range(self.num_layers):
                direct_kernel.direct_scatter_layer(
                    tab, self._refs[i], self.layout, i, num_tokens, checksum=op.endswith("+checksum")
                )
                if capturing:
                    self._launcher.record_external(events[i], stream.cuda_stream)
                else:
                    self._launcher.record(events[i], stream)
            return
        if op in ("direct", "direct+checksum"):
            tab = self.direct_table(num_tokens)
            direct_kernel.direct_scatter_layer(
                tab, self._refs[layer], self.layout, layer, num_tokens, checksum=op == "direct+checksum"
            )
            return
        if op == "pause":  # the paced lane's pause between two pieces of a chunk's copy (PacedBatch)
            assert self.batch is not None, "a pause graph needs the paced lane's PacedBatch"
            self.batch.tick()
            return
        if op == "paced-chunk":  # a paced store's chunk: its slots, the gather, its sum (PacedBatch)
            assert self.batch is not None, "a paced-chunk graph needs the paced lane's PacedBatch"
            self.batch.fetch(self._slots[num_tokens])
            self._launch(("gather", num_tokens, None))
            self._launch(("checksum", num_tokens, None))
            self.batch.append(self._sums[num_tokens], num_tokens)
            return
        if op == "checksum":  # the raw checksum sum of staging(T), alone in its one-entry sum
            self._sums[num_tokens].zero_()
            ck.accumulate(self._staging[num_tokens], self._sums[num_tokens], 0)
            return
        obj = triton_kernels.as_bits(self._staging[num_tokens])
        idx = self._slots[num_tokens]
        if op == "scatter+checksum":  # the scatter, summing staging(T) as it reads it: one kernel
            self._sums[num_tokens].zero_()
            triton_kernels.place(
                self._refs, self.layout, idx, obj, gather=False, checksum_into=self._sums[num_tokens]
            )
            return
        gather = op == "gather"
        if layer is None:
            triton_kernels.place(self._refs, self.layout, idx, obj, gather=gather)
        else:
            triton_kernels.place(
                [self._refs[layer]],
                self.layout,
                idx,
                obj[layer : layer + 1],
                gather=gather,
                single_layer=True,
            )

    def _graph(self, key: tuple) -> torch.cuda.CUDAGraph:
        graph = self._graphs.get(key)
        if graph is None:
            if key[0].startswith("direct"):
                self.direct_table(key[1])
            elif key[0] != "pause":  # the pause reads no staging buffer
                self._ensure(key[1])
            # The warm-up launch below really runs: a checksum kernel adds into the table's sums row,
            # which the caller zeroed for the replay that follows. Keep the row as it was.
            sums = None
            if key[0].startswith("direct") and key[0].endswith("+checksum"):
                sums = self.direct_table(key[1])[direct_kernel.DIRECT_SUMS_ROW].clone()
            # Compile and build the layer table outside the capture (neither may run inside it).
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._launch(key)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            if sums is not None:
                self.direct_table(key[1])[direct_kernel.DIRECT_SUMS_ROW].copy_(sums)
            graph = torch.cuda.CUDAGraph()
            # No Python garbage collection during the capture: torch no longer collects before a
            # capture, and a collection inside it that frees another placer's graphs (a dead reference
            # cycle) calls cudaGraphExecDestroy, which invalidates this capture ("operation failed
            # due to a previous error during capture").
            gc_was_enabled = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    self._launch(key)
            finally:
                if gc_was_enabled:
                    gc.enable()
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[key] = graph
        return graph

    def _replay(self, key: tuple, stream: int | None = None) -> None:
        """Replay the graph of ``key`` on the current stream, or on the raw ``stream`` handle when
        given (captured on first use).

        Through the launcher when there is one and torch exposes the graph's executable: our graphs
        use no random numbers, so a launch on the stream is all that torch's ``replay`` does for
        them."""
        graph = self._graph(key)
        if self._launcher is not None:
            exe = self._execs.get(key)
            if exe is None:
                exe = self._execs[key] = _raw_exec(graph)
            if exe:
                if stream is None:
                    stream = current_stream_handle(self.device)
                self._launcher.launch_graph(exe, stream)
                return
        if stream is None:
            graph.replay()
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
            graph.replay()

    def raw_exec(self, key: tuple, *, capture: bool) -> int:
        """The raw ``cudaGraphExec_t`` of ``key`` (captured now if ``capture``), or 0 where there is
        none: no launcher, not captured, or a torch that does not expose it."""
        if self._launcher is None or (key not in self._graphs and not capture):
            return 0
        exe = self._execs.get(key)
        if exe is None:
            exe = self._execs[key] = _raw_exec(self._graph(key))
        return exe

    def sum_address(self, num_tokens: int) -> int:
        """Where the ``("checksum", T, None)`` graph leaves its raw sum (one int64 on the device)."""
        self._ensure(num_tokens)
        return self._sums[num_tokens].data_ptr()

    def scatter(self, num_tokens: int) -> None:
        """All layers: ``staging(T)`` -> caches at ``slots(T)``, one kernel."""
        self._replay(("scatter", num_tokens, None))

    def scatter_checksum(self, num_tokens: int) -> bool:
        """``scatter(T)`` that also leaves the raw ``maru.checksum`` sum of all of ``staging(T)``
        (every row, placed or skipped) at ``sum_address(T)``: one kernel, one read of the staged
        bytes, where ``scatter`` and the ``checksum`` graph read them twice in two launches.

        False, with nothing queued, where this placer cannot: rows that are not whole words, or
        the fused kernel refused (``fused_refused`` says why: Triton's compiler has refused other
        fused variants on some layouts); the caller then scatters and sums the two-kernel way."""
        if not self.fused_checksum:
            return False
        key = ("scatter+checksum", num_tokens, None)
        if key not in self._graphs and not self._capture_fused(key):
            return False
        self._replay(key)
        return True

    def _capture_fused(self, key: tuple) -> bool:
        """Capture the fused graph of ``key``; on a refusal, turn the fused way off for this placer."""
        try:
            self._graph(key)
            return True
        except RuntimeError as e:  # the compiler's error (before any launch) or a refused capture
            self.fused_checksum = False
            self.fused_refused = f"{type(e).__name__}: {str(e)[:300]}"
            if self._launcher is not None:
                self._launcher.clear_error()
            announce_once(
                log,
                "kv_ops.fused-refused",
                logging.WARNING,
                "maru.kv_ops: the fused load checksum could not be built or captured (%s): loads check "
                "their chunks with the separate checksum kernel (the same check, one launch more). "
                "Fix: set MARU_FUSED_LOAD_CHECKSUM=0 to stop trying, and report the Triton version (maru doctor)",
                self.fused_refused,
            )
            return False

    def has_scatter_checksum(self, num_tokens: int) -> bool:
        """Whether the fused scatter-and-checksum graph for T tokens is captured."""
        return ("scatter+checksum", num_tokens, None) in self._graphs

    def gather(self, num_tokens: int) -> torch.Tensor:
        """All layers: caches at ``slots(T)`` -> ``staging(T)`` (returned; valid once the stream reaches it)."""
        self._replay(("gather", num_tokens, None))
        return self._staging[num_tokens]

    def scatter_layer(self, layer: int, num_tokens: int) -> None:
        """One layer: ``staging(T)[layer]`` -> that layer's cache (the layer-overlap load)."""
        self._replay(("scatter", num_tokens, layer))

    def gather_layer(self, layer: int, num_tokens: int) -> torch.Tensor:
        self._replay(("gather", num_tokens, layer))
        return self._staging[num_tokens][layer]

    def has_chunk_graphs(self, num_tokens: int) -> bool:
        """Whether the all-layer scatter and gather graphs for T tokens are captured."""
        return ("scatter", num_tokens, None) in self._graphs and ("gather", num_tokens, None) in self._graphs

    def has_direct(self, num_tokens: int, *, checksum: bool = False) -> bool:
        """Whether every layer's direct graph for T tokens is captured (a replay, never a capture)."""
        op = "direct+checksum" if checksum else "direct"
        return all((op, num_tokens, layer) in self._graphs for layer in range(self.num_layers))

    def scatter_layer_direct(self, layer: int, num_tokens: int, *, checksum: bool = False) -> None:
        """One layer, zero-copy: the chunk objects ``direct_table(T)`` names -> that layer's cache;
        with ``checksum`` the kernel also sums the objects into the table's row 5."""
        self._replay(("direct+checksum" if checksum else "direct", num_tokens, layer))

    def warm_direct(self, num_tokens: int, *, checksum: bool = False) -> None:
        """Capture the direct layer graphs for T tokens now (one per layer)."""
        for layer in range(self.num_layers):
            self._graph(("direct+checksum" if checksum else "direct", num_tokens, layer))

    # -- the one-launch layer load -----------------------------------------------------------------
    ALL_LAYER_GRAPHS = 4  # graphs (event sets) per size, used in turn: a load's events live 3 loads on

    def can_launch_all(self) -> bool:
        """Whether this placer can capture one-launch layer loads (needs the raw launcher)."""
        return self._launcher is not None and hasattr(self._launcher, "record_external")

    def _all_key(self, num_tokens: int, checksum: bool, k: int) -> tuple:
        return ("direct-all+checksum" if checksum else "direct-all", num_tokens, k)

    def has_direct_all(self, num_tokens: int, *, checksum: bool = False) -> bool:
        return all(
            self._all_key(num_tokens, checksum, k) in self._graphs for k in range(self.ALL_LAYER_GRAPHS)
        )

    def warm_direct_all(self, num_tokens: int, *, checksum: bool = False) -> None:
        """Capture the one-launch layer loads for T tokens now: ``ALL_LAYER_GRAPHS`` graphs, each
        every layer's direct kernel (in layer order) with an event-record node after each layer."""
        if not self.can_launch_all():
            raise RuntimeError("one-launch layer loads need the raw CUDA launcher (cuda_sync.RawSync)")
        for k in range(self.ALL_LAYER_GRAPHS):
            key = self._all_key(num_tokens, checksum, k)
            if key not in self._all_events:
                self._all_events[key] = [self._launcher.event() for _ in range(self.num_layers)]
            self._graph(key)

    def scatter_direct_all(
        self, num_tokens: int, *, checksum: bool = False, stream: int | None = None
    ) -> list[int]:
        """Every layer of ``direct_table(T)``, one graph launch on the current stream (or the raw
        ``stream``); returns the per-layer events (layer i's is recorded once layer i is placed).
        Only warmed sizes: a capture never happens here. The events are reused by the load
        ``ALL_LAYER_GRAPHS`` later."""
        k = self._all_next.get((num_tokens, checksum), 0)
        self._all_next[(num_tokens, checksum)] = (k + 1) % self.ALL_LAYER_GRAPHS
        key = self._all_key(num_tokens, checksum, k)
        self._replay(key, stream)
        return self._all_events[key]

    def warm_gather(self, num_tokens: int) -> None:
        """Capture a paced store's chunk graph for T tokens (``("paced-chunk", T, None)``: its slots
        from the store's, the all-layer gather, the staged bytes' sum into the store's sums;
        ``kv_ops.paced_batch``), and once the lane's pause between the pieces of a chunk's copy
        (``("pause", 0, None)``, its raw executable left in ``batch.pause``; 0 where there is none:
        the copies then go whole). Only on the paced lane's placer (``batch`` set)."""
        self._graph(("paced-chunk", num_tokens, None))
        self.warm_pause()

    def warm_pause(self) -> None:
        """Capture the paced lane's pause graph once (``batch.pause``; a no-op where captured, or
        off the paced lane). A capture that fails raises; ``batch.pause`` then stays 0."""
        if self.batch is not None and not self.batch.pause:
            self.batch.pause = self.raw_exec(("pause", 0, None), capture=True)

    def warm(
        self, num_tokens: int, *, per_layer: bool = False, checksum: bool = False, fused: bool = False
    ) -> None:
        """Capture the graphs for T tokens now (about a millisecond each) instead of on first use;
        ``checksum``: also the staging buffer's checksum graph (the raw store's); ``fused``: also
        the scatter that checksums (``scatter_checksum``; where the layout allows it)."""
        for op in ("scatter", "gather"):
            self._graph((op, num_tokens, None))
            if per_layer:
                for layer in range(self.num_layers):
                    self._graph((op, num_tokens, layer))
        if checksum:
            self._graph(("checksum", num_tokens, None))
        if fused and self.fused_checksum:
            self._capture_fused(("scatter+checksum", num_tokens, None))


def _raw_exec(graph: torch.cuda.CUDAGraph) -> int:
    """The graph's ``cudaGraphExec_t``, or 0 where this torch does not expose it (replay through torch)."""
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if raw is None:
        return 0
    try:
        return int(raw())
    except Exception:  # an older torch or a graph kept for re-instantiation: torch replays it
        return 0
