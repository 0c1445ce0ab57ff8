"""Our kernel and cuBLAS's on one problem under Nsight Compute, side by side: clock, SM throughput, memory traffic.

    python3 tools/ncu_compare.py --shape 4437_8192_8192:nk --params '{"block_m": 128, "block_n": 256, ...}'
    python3 tools/ncu_compare.py --family gemv --shape 1_28672_4096:nk:f16:silu_mul --params '{...}' --inductor

One ncu process a problem (clocks left alone, `--clock-control none`): the target (sandbox.profile_target) launches
our kernel three times and then cuBLAS three times on the same random inputs; the third launch of each
is what the table shows. With --inductor, also the Triton kernels of the problem's model form compiled by
torch.compile (tools/inductor_ref.py --ncu; its last launch of each). sm__cycles_elapsed per second is the SM clock
the launch ran at, so a gap that is the clock's (power) tells itself apart from one that is the pipes'. Run on the
GPU machine (. tools/gpu_env.sh first).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.shapes import ShapeError, parse_shape  # noqa: E402
from core.records import Problem  # noqa: E402
from sandbox.build import compile_cuda  # noqa: E402
from sandbox.profile import find_ncu  # noqa: E402
from templates import get_family  # noqa: E402

KERNELS = "regex:hgemm|nvjet|gemm|cutlass|xmma"  # ours and cuBLAS's, not torch's input fills
METRICS = (
    ("µs", "gpu__time_duration.sum", 1e-3),
    ("SM MHz", "sm__cycles_elapsed.avg.per_second", 1e-6),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("L2→SM MB", "lts__t_sectors_srcunit_tex_op_read.sum", 32e-6),
    ("L2 %", "lts__t_sectors.avg.pct_of_peak_sustained_elapsed", 1),
    ("DRAM rd MB", "dram__bytes_read.sum", 1e-6),
    ("DRAM wr MB", "dram__bytes_write.sum", 1e-6),
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("occ. limit %", "sm__maximum_warps_per_active_cycle_pct", 1),
    ("smem wavefronts M", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", 1e-6),
    ("grid", "launch__grid_size", 1),
    ("regs", "launch__registers_per_thread", 1),
)


def last_launches(ncu_csv: str) -> dict[str, dict[str, str]]:
    """Kernel name -> its last profiled launch's metrics, from ncu's `--csv --page raw` output (rows in launch order;
    ncu's own ==PROF== lines and the target's output are skipped)."""
    lines = [line for line in ncu_csv.splitlines() if line.startswith('"')]
    last: dict[str, dict[str, str]] = {}
    for row in csv.DictReader(lines):
        if row.get("ID", "").isdigit():  # the units row has no ID
            last[row.get("Kernel Name", "?")] = row
    return last


def table_row(problem: str, kernel: str, row: dict[str, str]) -> str:
    values = []
    for _, metric, scale in METRICS:
        try:
            values.append(f"{float(row.get(metric, '').replace(',', '')) * scale:12.1f}")
        except ValueError:  # absent or "n/a": a metric this ncu or chip does not have
            values.append(f"{'-':>12}")
    return f"{problem:<20} {kernel[:44]:<44} " + " ".join(values)


def profile(problem: Problem, params: dict, family: str, tmp: Path) -> dict[str, dict[str, str]]:
    build = compile_cuda(get_family(family).render(params, problem), "sm_90a", cache_dir=None)
    if not build.ok:
        raise SystemExit(f"{problem.key}: does not compile: {build.log[-500:]}")
    cubin, job = tmp / "k.cubin", tmp / "job.json"
    cubin.write_bytes(build.cubin)
    job.write_text(json.dumps({"cubin": str(cubin), "family": family, "params": params,
                               "problem": asdict(problem), "cublas": True}))
    return run_ncu([sys.executable, "-m", "sandbox.profile_target", str(job)], KERNELS)


def run_ncu(target: list[str], kernels: str, *ncu_options: str) -> dict[str, dict[str, str]]:
    """METRICS of the kernels matching `kernels` that the target command launches, by name (the last launch)."""
    cmd = [find_ncu() or "ncu", "--clock-control", "none", "--target-processes", "all", "--kernel-name", kernels,
           *ncu_options, "--csv", "--page", "raw", "--print-units", "base", "--metrics",
           ",".join(m for _, m, _ in METRICS), *target]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                  os.environ.get("PYTHONPATH")])))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    print(*out.stderr.strip().splitlines()[-1:], file=sys.stderr)  # the target's check, or ncu's last word
    return last_launches(out.stdout)


def profile_inductor(shape: str) -> dict[str, dict[str, str]]:
    """The Triton kernels torch.compile makes of the problem's model form (tools/inductor_ref.py), as ncu sees them."""
    target = [sys.executable, str(Path(__file__).with_name("inductor_ref.py")), "--shapes", shape, "--ncu"]
    return run_ncu(target, "regex:triton", "--profile-from-start", "off")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=[], help="M_N_K:layout (repeatable, one --params each)")
    ap.add_argument("--params", type=json.loads, action="append", default=[])
    ap.add_argument("--family", default="sm90_wgmma")
    ap.add_argument("--inductor", action="store_true", help="also torch.compile's kernels of each problem's model form")
    args = ap.parse_args(argv)
    if len(args.shape) != len(args.params) or not args.shape:
        print("error: give one --params per --shape", file=sys.stderr)
        return 2
    try:  # every setting checked before the first ncu run
        jobs = [(parse_shape(shape), params) for shape, params in zip(args.shape, args.params, strict=True)]
        for problem, params in jobs:
            get_family(args.family).launch(params, problem)
    except (ShapeError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"{'problem':<20} {'kernel':<44} " + " ".join(f"{n:>12}" for n, _, _ in METRICS))
    with tempfile.TemporaryDirectory() as tmp:
        for shape, (problem, params) in zip(args.shape, jobs, strict=True):
            rows = profile(problem, params, args.family, Path(tmp))
            if args.inductor:
                rows |= {f"inductor {k}": row for k, row in profile_inductor(shape).items()}
            for kernel, row in rows.items():
                print(table_row(f"{problem.m}_{problem.n}_{problem.k}:{problem.b_layout}", kernel, row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
