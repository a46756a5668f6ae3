"""``bench/fused_ab_table.py``: the device A/B's table (``bench/gpu_fused_ab.sh``) from the JSON that
``bench/gpu_connector.py --json`` writes: rounds in order, the separate way before the fused one,
each size's held load as a share of pinned bandwidth, a missing size shown as such."""

from __future__ import annotations

import json
from pathlib import Path

from bench.fused_ab_table import main, rows, table


def _result(path: Path, way: str, sizes: dict[str, tuple[float, float, float]]) -> None:
    path.write_text(
        json.dumps(
            {
                "load_checksum": way,
                "sizes": {
                    s: {"held_load_GBps": held, "pinned_h2d_GBps": pinned, "held_layer_issue_us": issue}
                    for s, (held, pinned, issue) in sizes.items()
                },
            }
        )
    )


def test_the_table_reads_every_round_in_order(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    _result(tmp_path / "fused_ab_fused_2.json", "fused (60 objects)", {"256": (46.0, 54.0, 8.1)})
    _result(
        tmp_path / "fused_ab_separate_2.json",
        "separate kernel",
        {"256": (44.0, 55.0, 8.4), "2048": (50.0, 54.0, 9.0)},
    )
    _result(tmp_path / "fused_ab_separate_1.json", "separate kernel", {"256": (45.1, 53.9, 7.7)})
    found = rows(tmp_path)
    assert [(m, r) for m, r, *_ in found] == [("separate", 1), ("separate", 2), ("fused", 2)]
    text = table(found)
    lines = text.splitlines()
    assert lines[0].startswith("| round | mode") and "held 256" in lines[0] and "held 2048" in lines[0]
    assert lines[2] == "| 1 | separate (separate kernel) | 83.7% (7.7) | - |"
    assert lines[3] == "| 2 | separate (separate kernel) | 80.0% (8.4) | 92.6% (9.0) |"
    assert lines[4] == "| 2 | fused (fused (60 objects)) | 85.2% (8.1) | - |"
    assert main(["x", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == text


def test_no_results_is_said(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["x", str(tmp_path)]) == 1
    assert "no fused_ab_" in capsys.readouterr().err
