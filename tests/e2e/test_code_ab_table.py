"""``bench/code_ab_table.py``: the code A/B's table (``bench/gpu_code_ab.sh``) from the JSON that
``bench/gpu_connector.py --json`` writes: rounds in order, the before side first, each size's held
load as a share of pinned bandwidth, its issue a layer and the whole layer load before the forward
(pin + prepare + issue), a missing size shown as such."""

from __future__ import annotations

import json
from pathlib import Path

from bench.code_ab_table import main, rows, table


def _result(path: Path, sizes: dict[str, tuple[float, float, float, dict[str, float]]]) -> None:
    path.write_text(
        json.dumps(
            {
                "sizes": {
                    s: {
                        "held_load_GBps": held,
                        "pinned_h2d_GBps": pinned,
                        "held_layer_issue_us": issue,
                        "held_load_phases_us": phases,
                    }
                    for s, (held, pinned, issue, phases) in sizes.items()
                },
            }
        )
    )


def test_the_table_reads_every_round_in_order(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    phases = {"pin": 100.0, "prepare": 10.0, "issue": 300.0}
    _result(tmp_path / "code_ab_after_1.json", {"256": (46.0, 54.0, 8.1, phases)})
    _result(
        tmp_path / "code_ab_before_1.json",
        {"256": (44.0, 55.0, 8.4, {"pin": 120.0}), "16384": (50.0, 54.0, 17.0, {})},
    )
    _result(tmp_path / "code_ab_before_2.json", {"256": (45.1, 53.9, 7.7, phases)})
    found = rows(tmp_path)
    assert [(s, r) for s, r, _ in found] == [("before", 1), ("after", 1), ("before", 2)]
    text = table(found)
    lines = text.splitlines()
    assert lines[0].startswith("| round | side") and "256: " in lines[0] and "16384: " in lines[0]
    assert lines[2] == "| 1 | before | 80.0% / 8.4 / 120 | 92.6% / 17.0 / 0 |"
    assert lines[3] == "| 1 | after | 85.2% / 8.1 / 410 | - |"
    assert lines[4] == "| 2 | before | 83.7% / 7.7 / 410 | - |"
    assert main(["x", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == text


def test_no_results_is_said(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["x", str(tmp_path)]) == 1
    assert "no code_ab_" in capsys.readouterr().err
