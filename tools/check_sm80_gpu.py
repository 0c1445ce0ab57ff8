"""Check the sm80_mma family on a real GPU: every space() setting correct on odd shapes, rough speed vs cuBLAS.

Run on the GPU machine from the repository root:  python3 tools/check_sm80_gpu.py [out_dir]
Prints a summary table; writes per-setting results to out_dir/sm80_check.csv when given.
"""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.records import Problem  # noqa: E402
from templates.sm80_mma.space import Sm80Mma  # noqa: E402

FAMILY = Sm80Mma()
SMALL = ["1_8_8", "17_24_40", "64_64_64", "257_136_520", "129_264_72", "1000_3000_2000"]
BIG = ["64_1024_16384", "4096_4096_4096"]  # checked with their own space() settings only
SPACE_SHAPES = SMALL + BIG + ["128_4096_4096"]
TIMED = ["4096_4096_4096", "1000_3000_2000", "64_1024_16384", "128_4096_4096", "257_136_520"]
# Corners no space() picks today but a proposer may: BK=16, 2-chunk B rows, n16 warp tiles, 32-chunk B rows, 8 warps,
# K groups with either epilogue.
EXTRA = [
    {"block_m": 32, "block_n": 16, "block_k": 16, "warps_m": 2, "warps_n": 1, "stages": 2},
    {"block_m": 128, "block_n": 32, "block_k": 64, "warps_m": 4, "warps_n": 2, "stages": 3, "smem_epilogue": False},
    {"block_m": 64, "block_n": 256, "block_k": 16, "warps_m": 2, "warps_n": 4, "stages": 6, "raster_group": 3},
    {"block_m": 16, "block_n": 256, "block_k": 64, "warps_m": 1, "warps_n": 4, "stages": 3},
    {"block_m": 256, "block_n": 128, "block_k": 64, "warps_m": 8, "warps_n": 1, "stages": 3, "min_blocks": 1},
    {"block_m": 64, "block_n": 64, "block_k": 64, "warps_m": 2, "warps_n": 2, "warps_k": 4, "stages": 3,
     "smem_epilogue": False},
    {"block_m": 32, "block_n": 256, "block_k": 32, "warps_m": 1, "warps_n": 4, "warps_k": 2, "stages": 4},
]


def problem(mnk: str, layout: str) -> Problem:
    m, n, k = map(int, mnk.split("_"))
    return Problem(m, n, k, layout)


def key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def compile_one(job: tuple[str, str]) -> tuple[str, str, bytes | None, str]:
    from cupy_backends.cuda.libs import nvrtc

    params_json, layout = job
    src = FAMILY.render(json.loads(params_json), problem("256_256_256", layout))
    prog = nvrtc.createProgram(src, "k.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=sm_90a", "--ptxas-options=-v", "-std=c++17"])
    except Exception:
        return params_json, layout, None, nvrtc.getProgramLog(prog)
    return params_json, layout, nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)


def main() -> None:
    import cupy
    import torch

    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    torch.manual_seed(0)
    settings: dict[str, dict[str, list[str]]] = {"kn": {}, "nk": {}}  # layout -> params json -> shapes it came from
    for layout in settings:
        for mnk in SPACE_SHAPES:
            for p in FAMILY.space(problem(mnk, layout)):
                settings[layout].setdefault(key(p), []).append(mnk)
        for p in EXTRA:
            settings[layout].setdefault(key(FAMILY.parse(p, problem(SMALL[0], layout)).model_dump()), ["extra"])
    jobs = [(pj, layout) for layout in settings for pj in settings[layout]]
    print(f"{len(jobs)} distinct (setting, layout) sources to compile", flush=True)

    kernels: dict[tuple[str, str], object] = {}
    build_fail = []
    tmp = tempfile.mkdtemp()
    with ProcessPoolExecutor(os.cpu_count()) as ex:
        for pj, layout, cubin, log in ex.map(compile_one, jobs):
            spill = max(map(int, re.findall(r"(\d+) bytes spill", log)), default=0)
            if cubin is None or spill:
                build_fail.append((pj, layout, log[-2000:]))
                continue
            path = Path(tmp) / f"k{len(kernels)}.cubin"
            path.write_bytes(cubin)
            kernels[(pj, layout)] = cupy.RawModule(path=str(path)).get_function("hgemm")
    print(f"compiled {len(kernels)}, failed or spilled {len(build_fail)}", flush=True)
    for pj, layout, log in build_fail[:3]:
        print("BUILD FAIL", layout, pj, log, sep="\n")

    def launcher(fn, params: dict, prob: Problem, a, b, c):
        """A no-argument launch with everything host-side (validation, attributes) done once, up front."""
        spec = FAMILY.launch(params, prob)
        fn.max_dynamic_shared_size_bytes = spec.smem_bytes
        args = (a, b, c, cupy.int32(prob.m), cupy.int32(prob.n), cupy.int32(prob.k))
        return lambda: fn(spec.grid, spec.block, args, shared_mem=spec.smem_bytes)

    def operands(prob: Problem):
        a = torch.randn(prob.m, prob.k, device="cuda", dtype=torch.float16)
        b_shape = (prob.k, prob.n) if prob.b_layout == "kn" else (prob.n, prob.k)
        b = torch.randn(*b_shape, device="cuda", dtype=torch.float16)
        b_kn = b if prob.b_layout == "kn" else b.t()
        ref = a.double() @ b_kn.double()
        mine = torch.matmul(a, b_kn).double()
        torch_err = ((mine - ref).norm() / ref.norm()).item()
        return a, b, b_kn, ref, torch_err

    rows = []
    failures = 0
    for layout in ("kn", "nk"):
        for mnk in SMALL + BIG:
            prob = problem(mnk, layout)
            a, b, _, ref, torch_err = operands(prob)
            guard = 4096
            # Every setting runs on every small shape (one cubin must serve any M, N, K); the big shape runs its own
            # space() settings only.
            todo = [pj for pj, shapes in settings[layout].items() if mnk not in BIG or mnk in shapes]
            for pj in todo:
                fn = kernels.get((pj, layout))
                if fn is None:
                    continue
                params = json.loads(pj)
                buf = torch.full((prob.m * prob.n + guard,), 0x7E00, device="cuda", dtype=torch.int16)
                c = buf[: prob.m * prob.n].view(torch.float16).view(prob.m, prob.n)
                status = "ok"
                try:
                    launcher(fn, params, prob, cupy.from_dlpack(a), cupy.from_dlpack(b), cupy.from_dlpack(c))()
                    torch.cuda.synchronize()
                except Exception as e:  # a fault poisons the context: report and stop
                    print(f"FAULT {layout} {mnk} {pj}: {e}", flush=True)
                    raise
                err = ((c.double() - ref).norm() / ref.norm()).item()
                nan = bool(torch.isnan(c).any().item())
                guard_ok = bool((buf[prob.m * prob.n:] == 0x7E00).all().item())
                if nan or not guard_ok or not err <= 2 * torch_err + 1e-7:
                    status = "WRONG" + (" nan" if nan else "") + ("" if guard_ok else " oob-write")
                    failures += 1
                rows.append([layout, mnk, pj, status, f"{err:.3e}", f"{torch_err:.3e}"])
                if status != "ok":
                    print(f"{status} {layout} {mnk} err={err:.3e} torch={torch_err:.3e} {pj}", flush=True)
            n_checked = sum(1 for r in rows if r[0] == layout and r[1] == mnk)
            worst = max((float(r[4]) for r in rows if r[0] == layout and r[1] == mnk), default=float("nan"))
            print(f"check {layout} {mnk:>16}: {n_checked:3d} settings, worst rel err {worst:.3e}, "
                  f"torch {torch_err:.3e}", flush=True)
    print(f"correctness: {len(rows)} runs, {failures} failures", flush=True)

    def time_us(run, *args, reps: int = 20, batch: int = 10, **kwargs) -> float:
        """Median over `reps` event pairs, each around `batch` back-to-back launches (hides host launch cost)."""
        for _ in range(3):
            run(*args, **kwargs)
        times = []
        for _ in range(reps):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            for _ in range(batch):
                run(*args, **kwargs)
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1000 / batch)
        return statistics.median(times)

    print("\ntiming (median of 20 batches of 10 back-to-back launches, warm L2; ratio = t_cublas / t_kernel)")
    print(f"{'shape':>16} {'B':>2} {'bm,bn,bk,wm,wn,wk,st,grp,minb,epi':<36} {'#rank':<6} {'us':>8} {'TF/s':>7} "
          f"{'cublas us':>9} {'ratio':>6}")
    for mnk in TIMED:
        for layout in ("kn", "nk"):
            prob = problem(mnk, layout)
            a, b, b_kn, _, _ = operands(prob)
            c = torch.empty(prob.m, prob.n, device="cuda", dtype=torch.float16)
            ca, cb, cc = cupy.from_dlpack(a), cupy.from_dlpack(b), cupy.from_dlpack(c)
            t_cublas = time_us(torch.matmul, a, b_kn, out=c)
            results = []
            for params in FAMILY.space(prob)[:12]:
                fn = kernels.get((key(params), layout))
                if fn is not None:
                    results.append((time_us(launcher(fn, params, prob, ca, cb, cc)), params))
            results.sort(key=lambda r: r[0])
            order = {key(p): i for i, p in enumerate(FAMILY.space(prob))}
            for t, params in results[:3]:
                short = ",".join(str(int(v)) for v in params.values())
                print(f"{mnk:>16} {layout:>2} {short:<36} #{order[key(params)]:<6} {t:8.1f} "
                      f"{prob.flops / t / 1e6:7.1f} {t_cublas:9.1f} {t_cublas / t:6.2f}", flush=True)
            rows.extend([layout, mnk, key(p), "time", f"{t:.2f}", f"{t_cublas:.2f}"] for t, p in results)

    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "sm80_check.csv", "w", newline="") as f:
            csv.writer(f).writerows([["layout", "mnk", "params", "status", "err_or_us", "torch_err_or_us"], *rows])


if __name__ == "__main__":
    main()
