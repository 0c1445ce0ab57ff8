"""tools/class_table.py: a suite run's figures per class of shapes, from bench.json and the tuning database."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("class_table", Path(__file__).parents[1] / "tools" / "class_table.py")
class_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(class_table)

SCHEMA = ("CREATE TABLE measured (run_id TEXT, candidate_id TEXT, m INT, n INT, k INT, b_layout TEXT, status TEXT, "
          "warm_us REAL, cublas_warm_us REAL, epilogue TEXT DEFAULT 'none')")


def write(tmp_path: Path, measured: list[tuple], bench_rows: list[dict]) -> tuple[Path, Path]:
    db = tmp_path / "tuning.sqlite"
    con = sqlite3.connect(db)
    con.execute(SCHEMA)
    con.executemany("INSERT INTO measured VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", measured)
    con.commit()
    con.close()
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"rows": bench_rows}))
    return bench, db


def row(shape, honest, warm=None, cold=None, layout="nk"):
    return {"shape": shape, "b_layout": layout, "ratio_honest": honest, "ratio_warm": warm or honest,
            "ratio_cold": cold or honest}


@pytest.mark.parametrize("mnk,cls", [((8192, 8192, 8192), "large"), ((1024, 2048, 8192), "large"),
                                     ((1024, 1024, 8192), "rest"), ((1024, 1024, 4096), "rest"),
                                     ((1023, 8192, 8192), "rest"),
                                     ((64, 8192, 8192), "skinny"), ((65, 512, 512), "rest")])
def test_classes_follow_the_shape(mnk, cls):
    assert class_table.shape_class(*mnk) == cls


def test_best_of_the_run_per_shape_and_bench_geomeans_per_class(tmp_path, capsys):
    measured = [
        ("r1", "a", 4096, 4096, 4096, "nk", "ok", 100.0, 102.0, "none"),   # 1.02
        ("r1", "b", 4096, 4096, 4096, "nk", "ok", 100.0, 104.0, "none"),   # 1.04: the shape's best
        ("r1", "c", 4096, 4096, 4096, "nk", "wrong", 50.0, 104.0, "none"),  # rejected: not counted
        ("r1", "d", 5000, 4096, 4096, "nk", "ok", 100.0, 97.0, "none"),    # 0.97: under 0.98
        ("r0", "e", 5000, 4096, 4096, "nk", "ok", 50.0, 97.0, "none"),     # another run's: not counted
        ("r1", "f", 5000, 4096, 4096, "nk", "ok", 50.0, 97.0, "silu"),     # an epilogue's: not counted
        ("r1", "g", 16, 4096, 4096, "nk", "ok", 10.0, 12.0, "none"),
    ]
    bench, db = write(tmp_path, measured, [row("4096_4096_4096", 1.05), row("5000_4096_4096", 1.0),
                                           row("16_4096_4096", 1.2, 1.1, 1.05)])
    assert class_table.main([str(bench), str(db), "--run", "r1"]) == 0
    out = capsys.readouterr().out
    rows = class_table.table(json.loads(bench.read_text()), class_table.search_best(db, "r1"))
    large = next(r for r in rows if r["class"] == "large")
    assert large["shapes"] == 2 and large["below_098"] == 1
    assert abs(large["search_best"] - (1.04 * 0.97) ** 0.5) < 1e-9
    assert abs(large["lowest_best"] - 0.97) < 1e-9 and large["lowest_at"] == "5000_4096_4096"
    assert abs(large["honest"] - 1.05 ** 0.5) < 1e-9
    skinny = next(r for r in rows if r["class"] == "skinny")
    assert (skinny["honest"], skinny["warm"], skinny["cold"]) == (1.2, 1.1, 1.05)
    assert [r["class"] for r in rows] == ["large", "skinny"] and "5000_4096_4096" in out


def test_a_missing_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert class_table.main([str(tmp_path / "none.json"), str(tmp_path / "none.sqlite")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
