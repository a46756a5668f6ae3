"""Triton kernels against the PyTorch reference, byte for byte, on every layout: ``python -m maru.kv_ops.selfcheck``.

Runs on CUDA tensors (``--device cuda``), or on CPU tensors under Triton's interpreter (set
``TRITON_INTERPRET=1`` before anything imports triton; the CPU test suite runs this module in a
subprocess for that reason). Every output is poisoned with random bits first, so an element the
kernel failed to write cannot match. Prints one line per failure and a summary; exit status 0 when
everything matched.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from collections.abc import Iterator

import torch

from maru.checksum import checksum
from maru.kv_ops import (
    detect_layouts,
    direct_kernel,
    gather,
    gather_blocks,
    gather_layer,
    scatter,
    scatter_blocks,
    scatter_layer,
    triton_kernels,
)
from maru.kv_ops.checksum import finalize
from maru.kv_ops.layout import KVLayout
from maru.kv_ops.ops import layer_refs
from maru.kv_ops.testing import FORMATS, CacheCase, bits, make_cache, random_bits_, random_slots


def _dtypes() -> list[torch.dtype]:
    out = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
    if hasattr(torch, "float8_e4m3fn"):
        out.append(torch.float8_e4m3fn)
    return out


@dataclasses.dataclass
class Params:
    fmt: str
    physical: str
    dtype: torch.dtype
    block_pad: int
    num_blocks: int = 6
    block_size: int = 4
    num_kv_heads: int = 3
    head_size: int = 8
    num_layers: int = 3

    def __str__(self) -> str:
        return (
            f"{self.fmt}/{self.physical}/{str(self.dtype).removeprefix('torch.')}/pad{self.block_pad}"
            f"/BS{self.block_size}xNH{self.num_kv_heads}xHS{self.head_size}"
        )


def cases(quick: bool) -> Iterator[Params]:
    for fmt in FORMATS:
        for physical in ("NHD", "HND"):
            if fmt in ("mla", "cpu_attn") and physical == "HND":
                continue  # one physical order only
            dts = _dtypes() if not quick else [torch.bfloat16, torch.uint8]
            for i, dtype in enumerate(dts):
                pad = (0, 7, 16)[i % 3]
                yield Params(fmt, physical, dtype, pad)
    # Larger rows (several column tiles, 16-byte vectors) and block size > heads the other way round.
    yield Params(
        "kv_first", "HND", torch.bfloat16, 0, num_blocks=5, block_size=16, num_kv_heads=2, head_size=64
    )
    yield Params("packed", "NHD", torch.float16, 32, num_blocks=5, block_size=2, num_kv_heads=4, head_size=16)


class Checker:
    """Runs one comparison after another and records failures as text."""

    def __init__(self, device: str, seed: int) -> None:
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)
        self.failures: list[str] = []
        self.count = 0
        self.unbuilt: list[str] = []  # kernels this compiler refused to build (no result to compare)

    def _make(self, p: Params, seed: int) -> CacheCase:
        gen = torch.Generator().manual_seed(seed)
        case = make_cache(
            p.fmt, p.physical, num_blocks=p.num_blocks, block_size=p.block_size, num_kv_heads=p.num_kv_heads,
            head_size=p.head_size, num_layers=p.num_layers, dtype=p.dtype, block_pad=p.block_pad, generator=gen,
        )  # fmt: skip
        if self.device != "cpu":
            moved = [c.to(self.device) for c in case.storages()]
            src = [case.caches] if isinstance(case.caches, torch.Tensor) else case.caches
            views = [
                torch.as_strided(m, c.shape, c.stride(), c.storage_offset())
                for m, c in zip(moved, src, strict=True)
            ]
            case.caches = views[0] if isinstance(case.caches, torch.Tensor) else views
        return case

    def expect(self, ok: bool, what: str) -> None:
        self.count += 1
        if not ok:
            self.failures.append(what)
            print(f"FAIL {what}", flush=True)

    def poison(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return random_bits_(torch.empty(shape, dtype=dtype), self.gen).to(self.device)

    def same(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(bits(a).cpu(), bits(b).cpu())

    def check(self, p: Params) -> None:
        seed = int(torch.randint(0, 1 << 30, (1,), generator=self.gen))
        case = self._make(p, seed)
        layout = detect_layouts(case.caches, **case.detect_kwargs())
        dev = self.device
        n = 2 * p.block_size + 3
        slots = torch.tensor(random_slots(layout.num_slots, n, negatives=3, generator=self.gen), device=dev)
        shape = (p.num_layers, layout.num_kv, n, layout.row_size)
        # gather, into poisoned outputs (rows of negative slots must keep the poison)
        poison = self.poison(shape, p.dtype)
        ref = gather(case.caches, layout, slots, backend="reference", out=poison.clone())
        tri = gather(case.caches, layout, slots, backend="triton", out=poison.clone())
        self.expect(self.same(ref, tri), f"gather {p}")
        # scatter with skip into two identical poisoned caches; whole storages must agree
        obj = self.poison(shape, p.dtype)
        a, b = self._make(p, seed + 1), self._make(p, seed + 1)
        scatter(obj, a.caches, layout, slots, backend="reference", skip_tokens=2)
        scatter(obj, b.caches, layout, slots, backend="triton", skip_tokens=2)
        self.expect(
            all(self.same(x, y) for x, y in zip(a.storages(), b.storages(), strict=True)), f"scatter {p}"
        )
        # gather -> scatter round trip into a fresh poisoned cache reproduces the touched slots
        c = self._make(p, seed + 2)
        back = gather(case.caches, layout, slots, backend="triton")
        scatter(back, c.caches, layout, slots, backend="triton")
        again = gather(c.caches, layout, slots, backend="reference")
        self.expect(self.same(again, back), f"roundtrip {p}")
        # single layer
        layer = p.num_layers - 1
        cache_l = case.caches if layout.is_cross_layer else case.caches[layer]
        lk = {"layer": layer} if layout.is_cross_layer else {}
        pl = self.poison(shape[1:], p.dtype)
        r1 = gather_layer(cache_l, layout, slots, backend="reference", out=pl.clone(), **lk)
        t1 = gather_layer(cache_l, layout, slots, backend="triton", out=pl.clone(), **lk)
        self.expect(self.same(r1, t1), f"gather_layer {p}")
        d, e = self._make(p, seed + 3), self._make(p, seed + 3)
        dl = d.caches if layout.is_cross_layer else d.caches[layer]
        el = e.caches if layout.is_cross_layer else e.caches[layer]
        scatter_layer(obj[layer], dl, layout, slots, backend="reference", skip_tokens=1, **lk)
        scatter_layer(obj[layer], el, layout, slots, backend="triton", skip_tokens=1, **lk)
        self.expect(
            all(self.same(x, y) for x, y in zip(d.storages(), e.storages(), strict=True)),
            f"scatter_layer {p}",
        )
        # block-granular
        blocks = torch.tensor([p.num_blocks - 1, 0, -1, 2], device=dev)
        bshape = (p.num_layers, layout.num_kv, 4 * p.block_size, layout.row_size)
        pb = self.poison(bshape, p.dtype)
        rb = gather_blocks(case.caches, layout, blocks, backend="reference", out=pb.clone())
        tb = gather_blocks(case.caches, layout, blocks, backend="triton", out=pb.clone())
        self.expect(self.same(rb, tb), f"gather_blocks {p}")
        f, g = self._make(p, seed + 4), self._make(p, seed + 4)
        objb = self.poison(bshape, p.dtype)
        scatter_blocks(objb, f.caches, layout, blocks, backend="reference", skip_blocks=1)
        scatter_blocks(objb, g.caches, layout, blocks, backend="triton", skip_blocks=1)
        self.expect(
            all(self.same(x, y) for x, y in zip(f.storages(), g.storages(), strict=True)),
            f"scatter_blocks {p}",
        )
        self.check_fused_checksum(p, layout, obj, slots, seed)
        self.check_direct(p, layout, obj, slots, seed)
        self.check_segments(p, layout, case, seed)

    def check_fused_checksum(
        self, p: Params, layout: KVLayout, obj: torch.Tensor, slots: torch.Tensor, seed: int
    ) -> None:
        """``place(checksum_into=...)``, the staged load's scatter that checksums what it places:
        the caches as the reference's scatter leaves them, and the object's ``maru.checksum``,
        skipped rows included (a changed byte in a row of slot -1 changes the sum)."""
        if not triton_kernels.fused_checksum_ok(layout, obj.element_size()):
            return
        want = checksum(obj.cpu().reshape(-1).view(torch.uint8).numpy())
        skipped = int((slots < 0).nonzero()[0, 0])
        poked = obj.clone()
        poked.view(torch.uint8)[0, -1, skipped, -1] ^= 0x21  # a byte the scatter does not write
        a = self._make(p, seed + 6)
        scatter(obj, a.caches, layout, slots, backend="reference")
        sums = []
        for o in (obj, poked):
            b = self._make(p, seed + 6)
            acc = torch.zeros(1, dtype=torch.int64, device=self.device)
            triton_kernels.place(
                layer_refs(b.caches, layout), layout, slots, triton_kernels.as_bits(o), gather=False,
                checksum_into=acc,
            )  # fmt: skip
            sums.append(finalize(int(acc.cpu()[0]), o.numel() * o.element_size()))
            self.expect(
                all(self.same(x, y) for x, y in zip(a.storages(), b.storages(), strict=True)),
                f"place(checksum_into=...) places what the reference does {p}",
            )
        self.expect(sums[0] == want, f"place(checksum_into=...) checksum {p}")
        self.expect(sums[1] != want, f"place(checksum_into=...) misses a skipped row's byte {p}")

    def check_direct(
        self, p: Params, layout: KVLayout, obj: torch.Tensor, slots: torch.Tensor, seed: int
    ) -> None:
        """The zero-copy layer load: two host objects of different lengths, read where they lie."""
        n = obj.shape[2]
        k = (n + 2) // 3
        # [BS+1, n-BS-1]: the second chunk is longer, so the table is per token; [k, k, <=k]: whole
        # chunks and a shorter tail, so the table is per chunk.
        for cuts in ((p.block_size + 1,), (k, 2 * k)):
            self._check_direct_split(p, layout, obj, slots, seed, [0, *cuts, n])

    def _check_direct_split(
        self, p: Params, layout: KVLayout, obj: torch.Tensor, slots: torch.Tensor, seed: int, cuts: list[int]
    ) -> None:
        n = obj.shape[2]
        host = [obj[:, :, a:b].contiguous().cpu() for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        if self.device != "cpu":
            host = [h.pin_memory() for h in host]  # what the GPU can read over the bus
        s = slots.cpu().clone()
        s[0] = -1  # a skipped token is never written
        width = n + 5  # padded columns (slot -1), as a graph bucket pads them
        chunks = [(h.data_ptr(), h.shape[2]) for h in host]
        tab = direct_kernel.direct_table_host(chunks, s, layout.row_size, obj.element_size(), width)
        tab = tab.to(self.device)
        d, e = self._make(p, seed + 5), self._make(p, seed + 5)
        refs = layer_refs(e.caches, layout)
        for layer in range(p.num_layers):
            lk = {"layer": layer} if layout.is_cross_layer else {}
            dl = d.caches if layout.is_cross_layer else d.caches[layer]
            scatter_layer(obj[layer], dl, layout, s.to(self.device), backend="reference", **lk)
            direct_kernel.direct_scatter_layer(tab, refs[layer], layout, layer, width)
        self.expect(
            all(self.same(x, y) for x, y in zip(d.storages(), e.storages(), strict=True)),
            f"direct_scatter_layer {p} chunks {[h.shape[2] for h in host]}",
        )
        if triton_kernels.fused_checksum_ok(layout, obj.element_size()):
            # The fused checksum: the same placement, and each object's maru.checksum (skipped
            # token included) in row 5, whatever the table's indexing.
            f = self._make(p, seed + 5)
            frefs = layer_refs(f.caches, layout)
            for layer in range(p.num_layers):  # 4 programs (2 a plane): each loops over several tiles
                direct_kernel.direct_scatter_layer(
                    tab, frefs[layer], layout, layer, width, checksum=True, programs=4
                )
            raw = tab[5, : len(host)].cpu().tolist()
            got = [finalize(r, h.numel() * h.element_size()) for r, h in zip(raw, host, strict=True)]
            want = [checksum(h.reshape(-1).view(torch.uint8).numpy()) for h in host]
            self.expect(
                got == want and all(self.same(x, y) for x, y in zip(d.storages(), f.storages(), strict=True)),
                f"direct_scatter_layer(checksum=True, programs=4) {p} chunks {[h.shape[2] for h in host]}",
            )
            self._check_direct_staged(p, layout, host, s, width, d, want, seed)

    def _check_direct_staged(
        self, p: Params, layout: KVLayout, host: list[torch.Tensor], s: torch.Tensor, width: int,
        d: CacheCase, want: list[int], seed: int,
    ) -> None:  # fmt: skip
        """The copied layer way's reads (``kv_ops.layer_copies``): layer i of every object staged in
        slot i % 2 of a device buffer, each object's region in its own layer layout, read with
        the slot's offset (``stage_off``): the same placement and the same checksums."""
        regions = [h[0].numel() for h in host]  # elements of one layer of each object
        offsets = [sum(regions[:k]) for k in range(len(host))]
        slot = sum(regions)
        staging = torch.zeros(2 * slot, dtype=host[0].dtype, device=self.device)
        chunks = [
            (staging.data_ptr() + o * staging.element_size(), h.shape[2])
            for o, h in zip(offsets, host, strict=True)
        ]
        tab = direct_kernel.direct_table_host(chunks, s, layout.row_size, host[0].element_size(), width)
        tab = tab.to(self.device)
        g = self._make(p, seed + 5)
        grefs = layer_refs(g.caches, layout)
        for layer in range(p.num_layers):
            at = (layer % 2) * slot
            for h, o, r in zip(host, offsets, regions, strict=True):
                staging[at + o : at + o + r].copy_(h[layer].reshape(-1))
            try:
                direct_kernel.direct_scatter_layer(
                    tab,
                    grefs[layer],
                    layout,
                    layer,
                    width,
                    checksum=True,
                    stage_off=at * staging.element_size(),
                )
            except RuntimeError as e:  # the compiler refused it: that layout keeps the direct way
                if "PassManager" not in str(e):
                    raise
                self.unbuilt.append(f"staged direct_scatter_layer {p}")
                print(f"NOT BUILT staged direct_scatter_layer {p}: {e} (the copied layer way stays off "
                      "for this layout: kv_ops.layer_copies.warm_copied)", flush=True)  # fmt: skip
                return
        raw = tab[5, : len(host)].cpu().tolist()
        got = [finalize(r, h.numel() * h.element_size()) for r, h in zip(raw, host, strict=True)]
        self.expect(
            got == want and all(self.same(x, y) for x, y in zip(d.storages(), g.storages(), strict=True)),
            f"direct_scatter_layer from a staged layer {p} chunks {[h.shape[2] for h in host]}",
        )

    def check_segments(self, p: Params, layout: KVLayout, case: CacheCase, seed: int) -> None:
        """Segment sums (``maru.segments``): the store kernel's sums from the caches equal the host
        sums of the gathered objects; a direct layer load that skips a whole segment leaves its
        rows unread (a changed byte there goes unnoticed: it was not read) yet vouches for what it
        placed (a changed byte in a placed row fails), with the whole object's checksum."""
        from maru.kv_ops import segment_kernels as sk

        esize = torch.empty((), dtype=p.dtype).element_size()
        if not sk.supported(layout, esize):
            return
        n, seg = 2 * p.block_size + 3, 3  # a segment size that divides neither the block nor the objects
        # Whole chunks and a shorter tail (a per-chunk table), then a longer second object (per token).
        for lengths in ([n - 2, 2], [5, n - 5]):
            self._check_segments(p, layout, case, seed, lengths, seg, esize)

    def _check_segments(
        self,
        p: Params,
        layout: KVLayout,
        case: CacheCase,
        seed: int,
        lengths: list[int],
        seg: int,
        esize: int,
    ) -> None:
        from maru import segments as sg
        from maru.kv_ops import segment_kernels as sk

        n = sum(lengths)
        slots = torch.tensor(random_slots(layout.num_slots, n, generator=self.gen))
        acc, most = sk.queue_cache_segments(
            case.caches, layout, lengths, slots.numpy(), seg, torch.device(self.device)
        )
        raw = acc.cpu().tolist()
        whole = gather(case.caches, layout, slots.to(self.device), backend="reference").cpu()
        objs = [whole[:, :, a : a + t].contiguous() for a, t in zip((0, lengths[0]), lengths, strict=True)]  # fmt: skip
        host = [sg.host_segment_sums(o.view(torch.uint8).numpy(), o.shape, esize, seg) for o in objs]
        got = [
            sg.SegmentSums(seg, tuple(r & ((1 << 64) - 1) for r in raw[k * most : k * most + len(h.raws)]))
            for k, h in enumerate(host)
        ]
        self.expect(got == host, f"segment sums from the caches {p}")
        self.expect(
            all(
                h.checksum(o.numel() * esize) == checksum(o.view(torch.uint8).numpy())
                for h, o in zip(host, objs, strict=True)
            ),
            f"segment sums add up to the checksum {p}",
        )
        # The direct load of those objects, the first seg + 1 tokens of the first one skipped: its
        # segment 0 is read by nobody, segment 1 is read (token seg+1 is placed) but not all placed.
        put = [o.pin_memory() if self.device != "cpu" else o.clone() for o in objs]
        marked = slots.clone()
        marked[: seg + 1] = -1
        prefill, unread = sg.mark_unread(marked.numpy(), lengths, host)
        self.expect(unread == seg and prefill is not None, f"mark_unread leaves segment 0 unread {p}")
        for poke, should_pass in ((0, True), (seg + 1, False)):
            for o, src in zip(put, objs, strict=True):
                o.copy_(src)
            put[0].view(torch.uint8)[-1, -1, poke, 0] ^= 0x5A  # one byte of token ``poke``
            tab = direct_kernel.direct_table_host(
                [(o.data_ptr(), o.shape[2]) for o in put], marked, layout.row_size, esize, n, prefill=prefill
            ).to(self.device)
            f = self._make(p, seed + 9)
            frefs = layer_refs(f.caches, layout)
            for layer in range(p.num_layers):
                direct_kernel.direct_scatter_layer(tab, frefs[layer], layout, layer, n, checksum=True)
            sums = [
                finalize(r, o.numel() * esize) for r, o in zip(tab[5, :2].cpu().tolist(), objs, strict=True)
            ]
            want = [h.checksum(o.numel() * esize) for h, o in zip(host, objs, strict=True)]
            self.expect(
                (sums == want) == should_pass, f"direct load with segments, byte of token {poke} changed {p}"
            )
            if should_pass:  # and it placed exactly what the reference places
                d = self._make(p, seed + 9)
                for layer in range(p.num_layers):
                    lk = {"layer": layer} if layout.is_cross_layer else {}
                    dl = d.caches if layout.is_cross_layer else d.caches[layer]
                    src = whole[layer].to(self.device)
                    scatter_layer(src, dl, layout, marked.to(self.device), backend="reference", **lk)
                self.expect(
                    all(self.same(x, y) for x, y in zip(d.storages(), f.storages(), strict=True)),
                    f"direct load with segments places what the reference does {p}",
                )

    def check_axis_swap_is_caught(self) -> None:
        """The seed's bug, on the kernel: fed the token-major (logical) strides of an HND cache, the
        kernel must produce different bytes than the reference, or the comparisons above prove nothing."""
        p = Params("blocks_first", "HND", torch.float16, 0)
        case = self._make(p, 7)
        layout = detect_layouts(case.caches, **case.detect_kwargs())
        logical = dataclasses.replace(
            layout,
            physical="NHD",
            k_token_stride=layout.row_size,
            v_token_stride=layout.row_size,
            head_stride=layout.head_size,
        )
        slots = torch.tensor(random_slots(layout.num_slots, 8, generator=self.gen), device=self.device)
        ref = gather(case.caches, layout, slots, backend="reference")
        wrong = gather(case.caches, logical, slots, backend="triton")
        right = gather(case.caches, layout, slots, backend="triton")
        self.expect(
            not self.same(ref, wrong), "axis swap NOT caught: logical strides on an HND cache matched"
        )
        self.expect(self.same(ref, right), "physical strides on an HND cache did not match")


def run(device: str = "cpu", quick: bool = False, seed: int = 0) -> list[str]:
    """Run every check; return the failures (empty when all matched)."""
    checker = Checker(device, seed)
    for p in cases(quick):
        try:
            checker.check(p)
        except Exception as exc:  # report and keep going: one broken layout must not hide the others
            where = [f.name for f in traceback.extract_tb(exc.__traceback__) if f.filename == __file__]
            checker.expect(False, f"error {p} in {' < '.join(reversed(where))}: {type(exc).__name__}: {exc}")
    checker.check_axis_swap_is_caught()
    print(
        f"selfcheck: {checker.count - len(checker.failures)}/{checker.count} comparisons matched on {device}"
        + (f"; {len(checker.unbuilt)} kernel(s) the compiler did not build" if checker.unbuilt else ""),
        flush=True,
    )
    return checker.failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="two dtypes instead of all")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return 1 if run(args.device, args.quick, args.seed) else 0


if __name__ == "__main__":
    sys.exit(main())
