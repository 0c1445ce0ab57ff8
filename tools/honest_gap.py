"""The first screen against the honest figure, per candidate of a run: every candidate that was re-measured honestly
(successive halving's leaders), its warm first-screen time and its honest time, beside cuBLAS's same two figures in
the same evaluations. The gap (honest / warm) is mostly the shape's: another kernel before each launch and operands
the refill left in the L2 move every kernel of a shape alike (docs/decisions.md `honest-ranking`). So each gap is
also given against its shape's median ("vs shape"): a candidate that reuses work across launches stands out there,
above its shape-mates; cuBLAS's gap against its own shape median is the measurement's noise. Also the run's
rejections (a false rejection is a rejected candidate of a family that is correct).

Usage: python3 tools/honest_gap.py RUN_DIR_OR_SQLITE [--markdown] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
from pathlib import Path


def rows(db: sqlite3.Connection) -> list[dict]:
    """One dict per re-measured candidate: key, family, warm and honest µs (medians over its honest measurements),
    cuBLAS's warm and honest µs, and the two gaps."""
    honest: dict[str, list[tuple[float, float]]] = {}
    if "honest" not in {row[1] for row in db.execute("PRAGMA table_info(measurements)")}:
        return []  # a store from before honest re-measurements
    for cid, ours, theirs in db.execute("SELECT candidate_id, time_us, cublas_us FROM measurements WHERE honest = 1"):
        if ours and theirs:
            honest.setdefault(cid, []).append((ours, theirs))
    out = []
    for cid, key, family, record in db.execute(
            "SELECT c.id, c.problem_key, c.family, r.record FROM candidates c JOIN results r ON r.candidate_id = c.id"):
        rec = json.loads(record)
        if cid not in honest or rec.get("status") != "ok" or not rec.get("warm") or not rec.get("cublas_warm"):
            continue
        ours = statistics.median(o for o, _ in honest[cid])
        theirs = statistics.median(t for _, t in honest[cid])
        warm, cublas_warm = rec["warm"]["median_us"], rec["cublas_warm"]["median_us"]
        out.append({"candidate": cid, "key": key, "family": family, "warm_us": warm, "honest_us": ours,
                    "cublas_warm_us": cublas_warm, "cublas_honest_us": theirs, "gap": ours / warm,
                    "cublas_gap": theirs / cublas_warm, "excess": (ours / warm) / (theirs / cublas_warm)})
    for key in {r["key"] for r in out}:  # each gap against the median of its shape's
        mine = [r for r in out if r["key"] == key]
        gap, cublas_gap = (statistics.median(r[f] for r in mine) for f in ("gap", "cublas_gap"))
        for r in mine:
            r["vs_shape"], r["cublas_vs_shape"] = r["gap"] / gap, r["cublas_gap"] / cublas_gap
    return sorted(out, key=lambda r: (r["key"], r["candidate"]))


def rejections(db: sqlite3.Connection) -> list[tuple[str, str, str, str]]:
    return [(cid, key, status, json.loads(rec).get("reason", "")[:160]) for cid, key, status, rec in db.execute(
        "SELECT c.id, c.problem_key, r.status, r.record FROM candidates c JOIN results r ON r.candidate_id = c.id "
        "WHERE r.status IN ('wrong', 'fault', 'timeout')")]


def quantiles(values: list[float]) -> str:
    s = sorted(values)
    return " / ".join(f"{s[min(len(s) - 1, int(q * len(s)))]:.3f}" for q in (0.0, 0.1, 0.5, 0.9)) + f" / {s[-1]:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a run directory (its run.sqlite) or a run store")
    ap.add_argument("--markdown", action="store_true", help="every candidate as a markdown table")
    ap.add_argument("--limit", type=int, default=12,
                    help="the candidates farthest from their shape's median listed (default 12)")
    args = ap.parse_args(argv)
    path = args.run / "run.sqlite" if args.run.is_dir() else args.run
    if not path.is_file():
        print(f"error: no run store at {path}", file=sys.stderr)
        return 2
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    table, bad = rows(db), rejections(db)
    total = db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    print(f"{total} candidates evaluated, {len(bad)} rejected; {len(table)} re-measured honestly "
          f"({len({r['key'] for r in table})} shapes)")
    for cid, key, status, reason in bad:
        print(f"  REJECTED {key} {cid} {status}: {reason}")
    if not table:
        return 0
    print("honest / warm, min / p10 / median / p90 / max:")
    print(f"  candidates {quantiles([r['gap'] for r in table])}")
    print(f"  cuBLAS     {quantiles([r['cublas_gap'] for r in table])}")
    print(f"  candidate's over cuBLAS's {quantiles([r['excess'] for r in table])}")
    for name, field in (("candidates", "vs_shape"), ("cuBLAS (the noise)", "cublas_vs_shape")):
        far = sum(abs(r[field] - 1) > 0.05 for r in table)
        print(f"  {name} against their shape's median {quantiles([r[field] for r in table])}; "
              f"{far} of {len(table)} beyond 5%")
    listed = table if args.markdown else sorted(table, key=lambda r: -abs(r["vs_shape"] - 1))[:args.limit]
    print("\n| shape | candidate | family | warm µs | honest µs | gap | vs shape | cuBLAS warm µs | cuBLAS honest µs | "
          "cuBLAS gap | cuBLAS vs shape |\n" + "|---" * 11 + "|")
    for r in listed:
        print(f"| {r['key']} | {r['candidate']} | {r['family']} | {r['warm_us']:.2f} | {r['honest_us']:.2f} | "
              f"{r['gap']:.3f} | {r['vs_shape']:.3f} | {r['cublas_warm_us']:.2f} | {r['cublas_honest_us']:.2f} | "
              f"{r['cublas_gap']:.3f} | {r['cublas_vs_shape']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
