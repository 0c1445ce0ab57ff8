"""Compare a family's search order at another revision with the working tree's, on the GPU: each problem's first
--top settings in both, swept once together (one process, one file), then which list held each problem's best.

    python3 tools/compare_orders.py prepare --rev HEAD~1 --shapes-file SHAPES --top 8 --out orders.json
    python3 tools/sweep.py --top 0 --settings orders.json --json $OUT/orders_sweep.json       # on the GPU
    python3 tools/compare_orders.py table orders.json $OUT/orders_sweep.json

`prepare` writes orders.json (each problem's union of both lists, for `sweep.py --settings`) and beside it
orders.lists.json (the two lists). Shapes as sweep.py takes them (M_N_K[:kn|nk|both], `#` comments).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.sweep import parse_shapes  # noqa: E402

# Run inside a checkout of the other revision: its family's first N settings of each problem, as JSON on stdout.
DUMP = """
import json, sys
from core.records import Problem
from templates import get_family
family, top, problems = get_family(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps({key: family.space(Problem(*mnk, layout))[:top] for key, (mnk, layout) in problems.items()}))
"""


def key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def orders(root: Path, family: str, top: int, problems: list) -> dict[str, list[dict]]:
    spec = {f"{p.mnk}:{p.b_layout}": ((p.m, p.n, p.k), p.b_layout) for p in problems}
    out = subprocess.run([sys.executable, "-c", DUMP, family, str(top), json.dumps(spec)], cwd=root,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"listing the settings in {root} failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def prepare(args: argparse.Namespace) -> None:
    problems = parse_shapes(args.shapes + "\n" + (args.shapes_file.read_text() if args.shapes_file else ""), "kn")
    archive = subprocess.run(["git", "archive", args.rev], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode:
        raise ValueError(f"git archive {args.rev}: {archive.stderr.decode().strip()}")
    with tempfile.TemporaryDirectory() as tmp:
        tarfile.open(fileobj=BytesIO(archive.stdout)).extractall(tmp, filter="data")
        old = orders(Path(tmp), args.family, args.top, problems)
    new = orders(ROOT, args.family, args.top, problems)
    union = {k: list({key(p): p for p in old[k] + new[k]}.values()) for k in new}
    args.out.write_text(json.dumps(union, indent=1))
    lists = args.out.with_suffix(".lists.json")
    lists.write_text(json.dumps({"rev": args.rev, "old": old, "new": new}, indent=1))
    print(f"{sum(map(len, union.values()))} settings over {len(union)} problems: {args.out}, {lists}")


def table(args: argparse.Namespace) -> None:
    lists = json.loads(args.orders.with_suffix(".lists.json").read_text())
    speed: dict[tuple[str, str], float] = {}
    for row in json.loads(args.sweep.read_text())["rows"]:
        r = row["result"]
        if row["params"] is not None and r and r.get("status") == "ok" and r.get("cublas_warm") and r.get("warm"):
            mnk, layout = row["problem"].split(":")[:2]
            speed[f"{mnk}:{layout}", key(row["params"])] = r["cublas_warm"]["median_us"] / r["warm"]["median_us"]
    print(f"| problem | best of {lists['rev']}'s list (place) | best of the working tree's (place) |")
    print("|---|---|---|")
    logs = {"old": [], "new": []}
    for problem in lists["new"]:
        cells = []
        for side in ("old", "new"):
            found = [(speed[problem, key(p)], i + 1) for i, p in enumerate(lists[side][problem])
                     if (problem, key(p)) in speed]
            best = max(found, default=None)
            cells.append(f"{best[0]:.3f} ({best[1]})" if best else "-")
            if best:
                logs[side].append(math.log(best[0]))
        print(f"| {problem} | {cells[0]} | {cells[1]} |")
    for side in ("old", "new"):
        if logs[side]:
            print(f"{side}: geomean of the bests {math.exp(sum(logs[side]) / len(logs[side])):.3f} "
                  f"over {len(logs[side])} problems")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="both lists of each problem, for sweep.py --settings")
    p.add_argument("--rev", required=True, help="the other revision (git)")
    p.add_argument("--family", default="sm90_wgmma")
    p.add_argument("--shapes", default="")
    p.add_argument("--shapes-file", type=Path)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("table", help="which list held each problem's best")
    t.add_argument("orders", type=Path)
    t.add_argument("sweep", type=Path)
    args = ap.parse_args(argv)
    try:
        prepare(args) if args.verb == "prepare" else table(args)
    except (ValueError, OSError) as e:
        ap.exit(2, f"compare_orders: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
