"""What the key index costs the server's event loop under steady eviction, and its longest stall.

    .venv/bin/python bench/key_index_churn.py [--keys 1000000] [--slots 4194304] [--ops 400000]
        [--compare-with REF]

A table filled with ``--keys`` keys, then ``--ops`` rounds of "one key evicted, one committed"
(the steady state of a full pool), each op timed on its own: mean and p99.99 per op, the longest
single op (a stall of the server's loop: nothing else is answered meanwhile), and how many reads a
reader process would have had to repeat (``shifts``: deletes that moved slots). ``--compare-with``
names a file holding an older ``maru/pool/key_index.py`` (e.g. ``git show REV:maru/pool/key_index.py
> /tmp/old.py``), measured the same way in the same process.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import sys
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def churn(mod: ModuleType, keys: int, slots: int, ops: int, seed: int, freeze_gc: bool) -> dict[str, float]:
    buf = memoryview(bytearray(mod.table_bytes(slots)))
    w = mod.KeyIndexWriter(buf, slots)
    rng = random.Random(seed)
    live = [f"ns/kv1/{rng.getrandbits(128):032x}" for _ in range(keys)]
    for k in live:
        w.add(k)
    if freeze_gc:
        gc.collect()
        gc.freeze()  # the setup's objects: a full collection no longer walks them (see --freeze-gc)
    times = []
    clock = time.perf_counter_ns
    for _ in range(ops):
        i = rng.randrange(len(live))
        new = f"ns/kv1/{rng.getrandbits(128):032x}"
        t0 = clock()
        w.discard(live[i])  # the least recently used goes ...
        t1 = clock()
        w.add(new)  # ... for the chunk that needed its room
        t2 = clock()
        live[i] = new
        times += (t1 - t0, t2 - t1)
    if freeze_gc:
        gc.unfreeze()
    # What a reader pays afterwards: slots it scans to learn that a key is absent (up to an empty
    # slot), over random homes; tombstones lengthen these runs, shifting deletes do not.
    scanned = 0
    for _ in range(20000):
        i = rng.getrandbits(64) & (slots - 1)
        n = 1
        while w._s[i] != 0 and n < mod.MAX_PROBE:
            i = (i + 1) & (slots - 1)
            n += 1
        scanned += n
    times.sort()
    return {
        "mean_us": sum(times) / len(times) / 1e3,
        "p9999_us": times[int(len(times) * 0.9999)] / 1e3,
        "max_ms": times[-1] / 1e6,
        "rebuilds": float(getattr(w, "rebuilds", 0)),
        "shifts": float(getattr(w, "shifts", 0)),
        "full": float(w.state != mod.STATE_OK),
        "miss_scan": scanned / 20000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--slots", type=int, default=1 << 22)
    ap.add_argument("--ops", type=int, default=400_000)
    ap.add_argument("--compare-with", type=Path, default=None)
    ap.add_argument(
        "--freeze-gc",
        action="store_true",
        help="keep Python's cyclic collector off the table's own objects, so that the longest op is the "
        "table's and not a full collection of a million strings",
    )
    a = ap.parse_args()
    tables = {"this tree": REPO / "maru" / "pool" / "key_index.py"}
    if a.compare_with is not None:
        tables[f"{a.compare_with}"] = a.compare_with
    print(f"{a.keys} keys in {a.slots} slots, {a.ops} evictions each followed by a commit")
    print(
        f"{'table':<28} {'mean us/op':>10} {'p99.99 us':>10} {'longest ms':>10} {'rebuilds':>8} {'shifts':>8} {'miss scan':>9}",
        flush=True,
    )
    for i, (label, path) in enumerate(tables.items()):
        r = churn(load(path, f"kix{i}"), a.keys, a.slots, a.ops, seed=1, freeze_gc=a.freeze_gc)
        print(
            f"{label:<28} {r['mean_us']:>10.2f} {r['p9999_us']:>10.1f} {r['max_ms']:>10.1f} "
            f"{r['rebuilds']:>8.0f} {r['shifts']:>8.0f} {r['miss_scan']:>9.2f}"
            + ("  (full)" if r["full"] else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
