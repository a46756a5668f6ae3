"""The table of ``bench/gpu_fused_ab.sh``: the held load's share of pinned bandwidth, by size, per
round and mode, from the ``fused_ab_<mode>_<round>.json`` files ``bench/gpu_connector.py`` wrote.

    python3 bench/fused_ab_table.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def rows(out: Path) -> list[tuple[str, int, str, dict]]:
    """(mode, round, load checksum way, sizes) of every result file in ``out``, in order."""
    found = []
    for path in sorted(out.glob("fused_ab_*_*.json")):
        _, _, mode, rnd = path.stem.split("_", 3)
        data = json.loads(path.read_text())
        found.append((mode, int(rnd), str(data.get("load_checksum", "?")), data.get("sizes", {})))
    return sorted(found, key=lambda r: (r[1], r[0] != "separate"))


def table(found: list[tuple[str, int, str, dict]]) -> str:
    sizes = sorted({s for *_, sz in found for s in sz}, key=lambda s: int(s) if s.isdigit() else 1 << 40)
    head = (
        "| round | mode (load_checksum) | "
        + " | ".join(f"held {s}: % of pinned (issue us/layer)" for s in sizes)
        + " |"
    )
    lines = [head, "|---|---|" + "---|" * len(sizes)]
    for mode, rnd, way, sz in found:
        cells = []
        for s in sizes:
            row = sz.get(s)
            if row is None:
                cells.append("-")
                continue
            share = 100 * row["held_load_GBps"] / row["pinned_h2d_GBps"]
            cells.append(f"{share:.1f}% ({row['held_layer_issue_us']:.1f})")
        lines.append(f"| {rnd} | {mode} ({way}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cli(
    argv: list[str], doc: str, pattern: str, read: Callable[[Path], list], show: Callable[[list], str]
) -> int:
    """The command line of an A/B table script: ``argv`` = [script, OUT_DIR]; ``read`` the result
    files (``pattern``, named when none is found), ``show`` their table, printed."""
    if len(argv) != 2:
        print(doc.strip(), file=sys.stderr)
        return 2
    found = read(Path(argv[1]))
    if not found:
        print(f"no {pattern} in {argv[1]}", file=sys.stderr)
        return 1
    print(show(found))
    return 0


def main(argv: list[str]) -> int:
    return cli(argv, __doc__ or "", "fused_ab_*.json", rows, table)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
