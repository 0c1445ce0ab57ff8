"""Per-class figures of a suite run: for each class of shapes, the search's best first screen against cuBLAS
(geomean and lowest, from the tuning database's rows of the run) and bench's honest, warm and cold geomeans (from its
bench.json, where cuBLAS serves a shape ours did not beat, at 1.0).

Classes (by the shape alone, so that any suite splits the same way):
  large:   M, N, K >= 1024 and 2MNK >= 2e10 (compute-bound; the class issue 39 tracks)
  skinny:  M <= 64 (decode and other few-row problems)
  rest:    everything else

Usage: python3 tools/class_table.py BENCH_JSON TUNING_DB [--run RUN_ID] [--markdown]
"""
from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
from pathlib import Path

CLASSES = ("large", "skinny", "rest")


def shape_class(m: int, n: int, k: int) -> str:
    if min(m, n, k) >= 1024 and 2 * m * n * k >= 2e10:
        return "large"
    return "skinny" if m <= 64 else "rest"


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def search_best(db: Path, run: str | None) -> dict[tuple[str, str], float]:
    """(M_N_K, layout) -> the best warm first-screen ratio to cuBLAS of the run's accepted candidates."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    where, args = ("AND run_id = ?", (run,)) if run else ("", ())
    best: dict[tuple[str, str], float] = {}
    for m, n, k, lay, w, c in con.execute(
            "SELECT m, n, k, b_layout, warm_us, cublas_warm_us FROM measured WHERE status = 'ok' AND warm_us > 0 "
            f"AND cublas_warm_us > 0 AND epilogue = 'none' {where}", args):
        key = (f"{m}_{n}_{k}", lay)
        best[key] = max(best.get(key, 0.0), c / w)
    return best


def table(bench: dict, best: dict[tuple[str, str], float]) -> list[dict]:
    per: dict[str, dict[str, list]] = {c: {"honest": [], "warm": [], "cold": [], "best": [], "names": []}
                                       for c in CLASSES}
    for r in bench["rows"]:
        m, n, k = (int(x) for x in r["shape"].split("_")[:3])
        d = per[shape_class(m, n, k)]
        for col in ("honest", "warm", "cold"):
            v = r.get(f"ratio_{col}")
            if v:
                d[col].append(v)
        if (b := best.get((r["shape"], r["b_layout"]))) is not None:
            d["best"].append(b)
            d["names"].append((b, r["shape"]))
    out = []
    for c in CLASSES:
        d = per[c]
        if not d["honest"]:
            continue
        low = min(d["names"]) if d["names"] else (float("nan"), "")
        out.append({"class": c, "shapes": len(d["honest"]), "search_best": geomean(d["best"]),
                    "lowest_best": low[0], "lowest_at": low[1], "below_098": sum(b < 0.98 for b in d["best"]),
                    "honest": geomean(d["honest"]), "warm": geomean(d["warm"]), "cold": geomean(d["cold"])})
    return out


def render(rows: list[dict], markdown: bool) -> str:
    head = ["class", "shapes", "search's best (geomean)", "lowest (shape)", "under 0.98", "bench honest", "warm",
            "cold"]
    cells = [[r["class"], str(r["shapes"]), f"{r['search_best']:.3f}", f"{r['lowest_best']:.3f} ({r['lowest_at']})",
              str(r["below_098"]), f"{r['honest']:.3f}", f"{r['warm']:.3f}", f"{r['cold']:.3f}"] for r in rows]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
                         + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(x) for x in col) for col in zip(head, *cells, strict=True)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)) for row in [head, *cells])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench_json", type=Path)
    p.add_argument("tuning_db", type=Path)
    p.add_argument("--run", help="only this run's rows of the tuning database")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    for f in (args.bench_json, args.tuning_db):
        if not f.is_file():
            print(f"error: {f}: no such file", file=sys.stderr)
            return 2
    try:
        bench = json.loads(args.bench_json.read_text())
        rows = table(bench, search_best(args.tuning_db, args.run))
    except (ValueError, KeyError, sqlite3.Error) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(render(rows, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
