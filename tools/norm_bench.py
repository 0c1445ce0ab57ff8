"""GPU time of hgemm::norm_linear's one kernel against the norm kernel and the plain kernel (on the GPU machine).

    python tools/norm_bench.py EXPORT_DIR [--reps 20] [--rounds 7] [--kind 0]

For each problem the export has a norm variant for (gemv winners: `agent export` builds them unless
--no-norm-variants), at the problem's M: `plain` = fused_linear on an already normalised x, `two` = rms_norm then
fused_linear (the two kernels a patched layer runs without the variant), `variant` = norm_linear. Each is captured
in a CUDA graph of `reps` calls and a replay timed by events; medians over `rounds`, the order reversed every other
round, one process. Also the largest difference of the variant's output from the two kernels' (relative to the largest
element; 0 where they agree bit for bit). Prints a table; with $OUT set, writes $OUT/norm_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sandbox.serve_bench import gpu_ops  # noqa: E402
from sandbox.timing import capture, replay_us  # noqa: E402


def problems(manifest: dict) -> list[tuple[str, int, int, int, str, bool, str]]:
    """(key, M, N, K, dtype, bias, epilogue) of each kernel with a norm variant; a bucket's at its lowest M."""
    out = []
    for key, entry in manifest["kernels"].items():
        if "norm_cubin" not in entry:
            continue
        fields = key.split(":")
        m, n, k = fields[0].split("_")
        epilogue = next((f for f in fields[3:] if f != "bias"), "none")
        out.append((key, int(m.split("-")[0]), int(n), int(k), fields[2], "bias" in fields[3:], epilogue))
    return out


def graph_us(fn, reps: int) -> float:
    """Device time of one call: a CUDA graph of `reps` calls (sandbox/timing.py's), its third replay timed by events."""
    graph = capture(lambda i: fn(), reps)
    replay_us(graph, reps)  # the first replay uploads the graph
    replay_us(graph, reps)
    return replay_us(graph, reps)


def measure(ops, m: int, n: int, k: int, dtype: str, has_bias: bool, epilogue: str, kind: int, reps: int,
            rounds: int) -> dict:
    dt = torch.float16 if dtype == "f16" else torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dt)
    norm_w = (1 + 0.1 * torch.randn(k, device="cuda")).to(dt)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(dt)
    bias = torch.randn(n, device="cuda", dtype=dt) if has_bias else None
    residual = torch.randn(m, n, device="cuda", dtype=dt) if epilogue == "residual" else None
    normed = ops.rms_norm(x, norm_w, 1e-5, kind)
    ways = {"plain": lambda: ops.fused_linear(normed, w, bias, epilogue, residual),
            "two": lambda: ops.fused_linear(ops.rms_norm(x, norm_w, 1e-5, kind), w, bias, epilogue, residual),
            "variant": lambda: ops.norm_linear(x, norm_w, 1e-5, kind, w, bias, epilogue, residual)}
    two, var = ways["two"]().float(), ways["variant"]().float()
    samples = {name: [] for name in ways}
    for r in range(rounds):
        for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
            samples[name].append(graph_us(ways[name], reps))
    row = {name: statistics.median(s) for name, s in samples.items()}
    row["max_diff"] = ((var - two).abs().max() / two.abs().max()).item()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export", type=Path)
    p.add_argument("--reps", type=int, default=20, help="calls a CUDA graph")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--kind", type=int, choices=(0, 1, 2), default=0, help="the norm's kind (hgemm_norm.cu's)")
    args = p.parse_args(argv)
    if (ops := gpu_ops(args.export)) is None:
        return 2
    rows = {}
    print(f"{'problem':>34} {'plain':>8} {'two':>8} {'variant':>8} {'var/two':>8} {'max diff':>9}   (µs a call)")
    with torch.inference_mode():
        for key, *shape in problems(ops.MANIFEST):
            r = rows[key] = measure(ops, *shape, args.kind, args.reps, args.rounds)
            print(f"{key:>34} {r['plain']:8.2f} {r['two']:8.2f} {r['variant']:8.2f} {r['variant'] / r['two']:8.3f} "
                  f"{r['max_diff']:9.1e}", flush=True)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "norm_bench.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "kind": args.kind, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
