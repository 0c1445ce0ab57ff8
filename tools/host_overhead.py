"""Host time per call of an exported op against torch.matmul / F.linear, per exported kernel (on the GPU machine).

    python tools/host_overhead.py EXPORT_DIR [--calls 200] [--rounds 30] [--max-kernels N]

For each problem the export has a kernel for, four ways to run it: the compiled op's entry point (what
hgemm_ops.mm / .linear call), the registered op through the dispatcher (torch.ops.hgemm.*, what torch.compile
calls), the Python launch path (ctypes), and cuBLAS (torch.matmul / F.linear). Two clocks, interleaved round by
round, medians over rounds: `issue` = host time per call of `calls` back-to-back calls, no synchronize inside (what
a host-bound loop such as an eager decode step pays), and `sync` = host time of one call plus
torch.cuda.synchronize() (what a single call waits for, kernel included). Prints a table; with $OUT set, writes
$OUT/host_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandbox.serve_bench import gpu_ops  # noqa: E402


def ways(ops, key: str) -> dict[str, callable]:
    check = ops._sibling("hgemm_selfcheck")
    args = check.operands(ops, key)
    ext = ops.compiled()
    dispatcher = types.SimpleNamespace(mm=torch.ops.hgemm.mm.default, linear=torch.ops.hgemm.linear.default,
                                       fused_linear=torch.ops.hgemm.fused_linear.default)
    out = {"compiled": lambda: check.call(ops, ext, *args),
           "dispatcher": lambda: check.call(ops, dispatcher, *args),
           "python": lambda: check.call(ops, ops.PythonPath, *args),
           "torch": lambda: ops.fallback(*args)}  # the call as PyTorch runs it (F.linear / matmul / addmm, epilogue)
    return out if ext is not None else {name: f for name, f in out.items() if name in ("python", "torch")}


def issue_us(f, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t * 1e6 / calls


def sync_us(f, calls: int) -> float:
    total = 0.0
    for _ in range(calls):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        total += time.perf_counter() - t0
    return total * 1e6 / calls


def measure(fns: dict[str, callable], calls: int, rounds: int) -> dict[str, dict[str, float]]:
    for f in fns.values():  # loads, builds tensor maps, warms cuBLAS
        f()
    samples = {name: {"issue": [], "sync": []} for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            samples[name]["issue"].append(issue_us(f, calls))
            samples[name]["sync"].append(sync_us(f, max(1, calls // 10)))
    return {name: {clock: statistics.median(v) for clock, v in s.items()} for name, s in samples.items()}


def markdown(rows: dict[str, dict[str, dict[str, float]]]) -> str:
    """The table docs/notebook.md keeps: µs per call, issue clock for every way, call+sync for ours and torch."""
    ways_ = ["compiled", "dispatcher", "python", "torch"]
    lines = ["| problem | " + " | ".join(f"{w} issue" for w in ways_) + " | compiled call+sync | torch call+sync | "
             "compiled - torch (issue) |", "|---" * 8 + "|"]
    for key, r in rows.items():
        cells = [f"{r[w]['issue']:.2f}" if w in r else "-" for w in ways_]
        cells += [f"{r[w]['sync']:.2f}" if w in r else "-" for w in ("compiled", "torch")]
        cells.append(f"{r['compiled']['issue'] - r['torch']['issue']:+.2f}" if "compiled" in r else "-")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread(keys: list[str], most: int) -> list[str]:
    """At most `most` of keys (all where most <= 0), evenly spaced, first and last kept."""
    if most <= 0 or len(keys) <= most:
        return keys
    return [keys[round(i * (len(keys) - 1) / max(1, most - 1))] for i in range(most)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export", type=Path)
    p.add_argument("--calls", type=int, default=200, help="calls per round (issue clock); a tenth of them for sync")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--max-kernels", type=int, default=0, help="time at most this many of the export's kernels, "
                   "spread evenly over its manifest (default: all)")
    args = p.parse_args(argv)
    if (ops := gpu_ops(args.export)) is None:
        return 2
    rows = {}
    with torch.inference_mode():
        for key in spread(list(ops.MANIFEST["kernels"]), args.max_kernels):
            rows[key] = measure(ways(ops, key), args.calls, args.rounds)
            r = rows[key]
            print(f"{key:>28}  " + "  ".join(f"{name} {v['issue']:6.2f} / {v['sync']:7.2f}" for name, v in r.items())
                  + "   (µs per call: issue / call+sync)", flush=True)
    print(markdown(rows))
    report = {"path": ops.path(), "device": torch.cuda.get_device_name(), "calls": args.calls, "rounds": args.rounds,
              "rows": rows}
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "host_overhead.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
