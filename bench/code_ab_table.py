"""The table of ``bench/gpu_code_ab.sh``: the held layer load by size, per round and side, from the
``code_ab_<side>_<round>.json`` files ``bench/gpu_connector.py`` wrote.

    python3 bench/code_ab_table.py OUT_DIR

Per size: the held load's share of pinned bandwidth, the direct issue in us a layer, and the whole
layer load before the forward (pin + prepare + issue, us a load: what the engine's thread spends).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.fused_ab_table import cli  # noqa: E402


def rows(out: Path) -> list[tuple[str, int, dict]]:
    """(side, round, sizes) of every result file in ``out``, before then after within a round."""
    found = []
    for path in sorted(out.glob("code_ab_*_*.json")):
        _, _, side, rnd = path.stem.split("_", 3)
        found.append((side, int(rnd), json.loads(path.read_text()).get("sizes", {})))
    return sorted(found, key=lambda r: (r[1], r[0] != "before"))


def cell(row: dict) -> str:
    share = 100 * row["held_load_GBps"] / row["pinned_h2d_GBps"]
    whole = sum(row.get("held_load_phases_us", {}).values())
    return f"{share:.1f}% / {row['held_layer_issue_us']:.1f} / {whole:.0f}"


def table(found: list[tuple[str, int, dict]]) -> str:
    sizes = sorted({s for *_, sz in found for s in sz}, key=lambda s: int(s) if s.isdigit() else 1 << 40)
    head = "| round | side | " + " | ".join(
        f"{s}: % pinned / issue us a layer / before forward us" for s in sizes
    )
    lines = [head + " |", "|---|---|" + "---|" * len(sizes)]
    for side, rnd, sz in found:
        cells = [cell(sz[s]) if s in sz else "-" for s in sizes]
        lines.append(f"| {rnd} | {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return cli(argv, __doc__ or "", "code_ab_*_*.json", rows, table)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
