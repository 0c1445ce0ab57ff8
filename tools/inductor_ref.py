"""What torch.compile makes of a problem written as a model writes it, timed by CUDA graphs (on the GPU machine).

    python3 tools/inductor_ref.py --shapes 1_28672_4096:nk:f16:silu_mul,1_128256_4096:nk [--mode MODE]
    python3 tools/inductor_ref.py --shapes 1_28672_4096:nk:f16:silu_mul --ncu    # ncu --profile-from-start off

A problem's model form (`model_form`): x (M x K) times nn.Linear weights (N x K with :nk; a shape without a layout is
kn, as in every tool: the weight then a view of K x N storage), the bias added, then
the epilogue as the unfused model runs it: act(x W^T + b); a gated epilogue as two projections, act(x Wg^T + bg) *
(x Wu^T + bu) with N / 2 columns each (a stock Llama MLP's gate and up); a residual one + R. Each is compiled with
`torch.compile(mode=MODE)` (default max-autotune-no-cudagraphs, the bar the fused models are measured against),
checked against the project's fp64 definition of the epilogue (core.epilogue.reference), and timed as a CUDA graph of
--reps calls replayed between events (median of --rounds): the figure to set beside `tools/sweep.py`'s for our
kernels in the same call. With --ncu each problem's compiled form runs three times between cudaProfilerStart and
Stop (`tools/ncu_compare.py --inductor` profiles those). With $OUT set, writes $OUT/inductor_ref.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.shapes import ShapeError, parse_shape_list  # noqa: E402
from core.epilogue import Epilogue, activate, interleave_gate_up, reference  # noqa: E402
from core.records import Problem  # noqa: E402


def model_form(problem: Problem, device: str = "cpu", seed: int = 0):
    """(fn, args, expected): the problem as an unfused model computes it, random inputs (weights as nn.Linear holds
    them), and the fp64 result of the project's own definition (the merged, interleaved gate/up where gated)."""
    import torch
    import torch.nn.functional as F

    epi = Epilogue(problem.epilogue)
    dt = torch.bfloat16 if problem.dtype == "bf16" else torch.float16
    g = torch.Generator().manual_seed(seed)
    m, n, k = problem.m, problem.n, problem.k
    heads = 2 if epi.gated else 1
    x = torch.randn(m, k, generator=g).to(dt)
    ws = [(torch.randn(n // heads, k, generator=g) * k ** -0.5).to(dt) for _ in range(heads)]
    bs = [torch.randn(n // heads, generator=g).to(dt) if problem.bias else None for _ in range(heads)]
    r = torch.randn(m, n, generator=g).to(dt) if epi.residual else None
    w = interleave_gate_up(*ws, dim=0) if epi.gated else ws[0]
    b = (interleave_gate_up(*bs, dim=0) if epi.gated else bs[0]) if problem.bias else None
    y = x.double() @ w.double().t() + (b.double() if b is not None else 0.0)
    expected = reference(y, epi, r.double() if r is not None else None)

    def fn(x, *weights):
        if epi.gated:
            wg, wu, bg, bu = weights
            return activate(F.linear(x, wg, bg), epi.activation) * F.linear(x, wu, bu)
        w, b, res = weights
        out = activate(F.linear(x, w, b), epi.activation)
        return out + res if res is not None else out

    if problem.b_layout == "kn":  # B given K x N: the model's weight is its transpose, a view
        ws = [wi.t().contiguous().t() for wi in ws]
    args = (x, *ws, *bs) if epi.gated else (x, ws[0], bs[0], r)
    return fn, tuple(a.to(device) if a is not None else None for a in args), expected


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", required=True, help="M_N_K[:layout[:dtype][:bias][:epilogue]][,...]")
    ap.add_argument("--mode", default="max-autotune-no-cudagraphs", help="torch.compile mode")
    ap.add_argument("--reps", type=int, default=20, help="calls in the timed graph")
    ap.add_argument("--rounds", type=int, default=7, help="replays timed (the median is reported)")
    ap.add_argument("--ncu", action="store_true", help="run each compiled form three times for ncu, time nothing")
    args = ap.parse_args(argv)
    try:
        problems = parse_shape_list(args.shapes)
    except ShapeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from sandbox.timing import capture, replay_us

    rows = []
    for problem in problems:
        fn, inputs, expected = model_form(problem, "cuda")
        compiled = torch.compile(fn, mode=args.mode)
        out = compiled(*inputs)
        torch.cuda.synchronize()
        err = ((out.double().cpu() - expected).norm() / expected.norm()).item()
        print(f"{problem.key}: rel. err {err:.1e} against fp64", file=sys.stderr)  # ncu_compare shows the last line
        if args.ncu:
            torch.cuda.profiler.start()
            for _ in range(3):
                compiled(*inputs)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        graph = capture(lambda _i, f=compiled, a=inputs: f(*a), args.reps)
        us = statistics.median(replay_us(graph, args.reps) for _ in range(args.rounds))
        rows.append({"problem": problem.key, "mode": args.mode, "us": us, "rel_err": err})
        print(f"{problem.key:<40} {us:10.2f} µs", flush=True)
    if os.environ.get("OUT") and rows:
        Path(os.environ["OUT"], "inductor_ref.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
