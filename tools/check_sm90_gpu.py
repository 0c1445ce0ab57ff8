"""Check the sm90_wgmma family on a real GPU: every space() setting correct on odd shapes, speed vs cuBLAS.

Run on the GPU machine from the repository root:  python3 tools/check_sm90_gpu.py [out_dir] [--time-top N]
The parent process never touches the GPU: it compiles every setting (NVRTC, in parallel), disassembles one cubin
(HGMMA present, no local memory), then feeds settings one at a time to a worker process that it kills and
replaces when a kernel hangs (a wrong mbarrier handshake deadlocks) or faults (a poisoned CUDA context).
Prints the correctness summary, then a timing table last; writes out_dir/sm90_check.json when given.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.records import Problem  # noqa: E402
from templates.sm90_wgmma.space import Sm90Wgmma  # noqa: E402

FAMILY = Sm90Wgmma()
CHECK_SHAPES = ["1_8_8", "17_24_40", "64_64_64", "257_136_520", "1000_3000_2000", "4096_4096_4096"]
SPACE_SHAPES = ["128_256_64", "1000_3000_2000", "4096_4096_4096", "8192_8192_8192", "64_1024_16384"]
TIMED = ["4096_4096_4096", "8192_8192_8192"]
FIRST_JOB_TIMEOUT_S, JOB_TIMEOUT_S = 60.0, 20.0


def problem(mnk: str, layout: str) -> Problem:
    m, n, k = map(int, mnk.split("_"))
    return Problem(m, n, k, layout)


def key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def short(params: dict) -> str:
    p = params
    return (f"{p['block_m']}x{p['block_n']} c{p['consumers']} s{p['stages']} g{p['raster_group']} "
            f"b{p['min_blocks']} {p['epilogue'][0]}")


def compile_one(job: tuple[str, str, str]) -> tuple[str, str, str | None, str]:
    from cupy_backends.cuda.libs import nvrtc

    params_json, layout, out_path = job
    src = FAMILY.render(json.loads(params_json), problem("256_256_256", layout))
    prog = nvrtc.createProgram(src, "k.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=sm_90a", "--ptxas-options=-v", "-std=c++17"])
    except Exception:
        return params_json, layout, None, nvrtc.getProgramLog(prog)
    Path(out_path).write_bytes(nvrtc.getCUBIN(prog))
    return params_json, layout, out_path, nvrtc.getProgramLog(prog)


# ----------------------------------------------------------------------------------------------- worker (GPU)

class Worker:
    """Runs in the child process: owns the CUDA context, keeps operands and references per (shape, layout)."""

    def __init__(self) -> None:
        import torch

        from sandbox.launch import Kernel

        self.torch, self.Kernel = torch, Kernel
        torch.manual_seed(0)
        self.cases: dict[tuple[str, str], tuple] = {}

    def case(self, mnk: str, layout: str):
        if (mnk, layout) not in self.cases:
            torch = self.torch
            prob = problem(mnk, layout)
            a = torch.randn(prob.m, prob.k, device="cuda", dtype=torch.float16)
            b = torch.randn(*((prob.k, prob.n) if layout == "kn" else (prob.n, prob.k)), device="cuda",
                            dtype=torch.float16)
            b_kn = b if layout == "kn" else b.t()
            ref = a.double() @ b_kn.double()
            torch_err = ((torch.matmul(a, b_kn).double() - ref).norm() / ref.norm()).item()
            self.cases[(mnk, layout)] = (prob, a, b, b_kn, ref, torch_err)
        return self.cases[(mnk, layout)]

    def kernel(self, cubin_path: str, params: dict, layout: str):
        rule = lambda m, n, k: FAMILY.launch(params, Problem(m, n, k, layout))  # noqa: E731
        return self.Kernel(Path(cubin_path).read_bytes(), rule)

    def check(self, job: dict) -> dict:
        torch = self.torch
        params, layout = job["params"], job["layout"]
        kern = self.kernel(job["cubin"], params, layout)
        results = []
        for mnk in CHECK_SHAPES:
            prob, a, b, _, ref, torch_err = self.case(mnk, layout)
            guard = 4096
            buf = torch.full((prob.m * prob.n + guard,), 0x7E00, device="cuda", dtype=torch.int16)
            c = buf[: prob.m * prob.n].view(torch.float16).view(prob.m, prob.n)
            kern(a, b, c, prob.m, prob.n, prob.k)
            torch.cuda.synchronize()
            err = ((c.double() - ref).norm() / ref.norm()).item()
            nan = bool(torch.isnan(c).any().item())
            guard_ok = bool((buf[prob.m * prob.n:] == 0x7E00).all().item())
            ok = not nan and guard_ok and err <= 2 * torch_err + 1e-7
            results.append({"mnk": mnk, "ok": ok, "err": err, "torch_err": torch_err, "nan": nan,
                            "guard_ok": guard_ok})
        return {"status": "ok" if all(r["ok"] for r in results) else "WRONG", "shapes": results}

    def time(self, job: dict) -> dict:
        from sandbox.timing import measure

        torch = self.torch
        params, layout, mnk = job["params"], job["layout"], job["mnk"]
        prob, a, b, b_kn, _, _ = self.case(mnk, layout)
        kern = self.kernel(job["cubin"], params, layout)
        c = torch.empty(prob.m, prob.n, device="cuda", dtype=torch.float16)
        c2 = torch.empty_like(c)
        t = measure({"k": lambda: kern(a, b, c, prob.m, prob.n, prob.k),
                     "cublas": lambda: torch.matmul(a, b_kn, out=c2)}, None, replays=7)
        return {"status": "ok", "us": t["k"].median_us, "spread": t["k"].spread,
                "cublas_us": t["cublas"].median_us, "cublas_spread": t["cublas"].spread}


def worker_main() -> None:
    w = None
    for line in sys.stdin:
        job = json.loads(line)
        try:
            if w is None:
                w = Worker()
            out = w.check(job) if job["kind"] == "check" else w.time(job)
        except Exception as e:  # a CUDA fault poisons the context: report it and let the parent restart us
            print(json.dumps({"status": "FAULT", "error": str(e)[:500]}), flush=True)
            sys.exit(3)
        print(json.dumps(out), flush=True)


# ----------------------------------------------------------------------------------------------- parent (CPU)

class WorkerProcess:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.fresh = True

    def run(self, job: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
            self.fresh = True
        timeout = FIRST_JOB_TIMEOUT_S if self.fresh else JOB_TIMEOUT_S
        self.fresh = False
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            return {"status": "HANG" if not ready else "CRASH"}
        out = json.loads(line)
        if out["status"] == "FAULT":
            self.kill()
        return out

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def disassemble(cubin: str) -> str:
    tool = shutil.which("cuobjdump")
    if not tool:
        return "cuobjdump not found"
    sass = subprocess.run([tool, "--dump-sass", cubin], capture_output=True, text=True).stdout
    ops = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS", "SYNCS")}
    return " ".join(f"{op}={n}" for op, n in ops.items())


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out_dir = Path(args[0]) if args else None
    time_top = 8
    if "--time-top" in sys.argv:
        time_top = int(sys.argv[sys.argv.index("--time-top") + 1])
    t0 = time.time()
    settings: dict[str, dict[str, dict]] = {"kn": {}, "nk": {}}
    for layout in settings:
        for mnk in SPACE_SHAPES:
            for p in FAMILY.space(problem(mnk, layout)):
                settings[layout].setdefault(key(p), p)
    tmp = tempfile.mkdtemp()
    jobs = [(pj, layout, f"{tmp}/{layout}{i}.cubin") for layout in settings for i, pj in enumerate(settings[layout])]
    cubins: dict[tuple[str, str], str] = {}
    build_fail = []
    with ProcessPoolExecutor(os.cpu_count()) as ex:
        for pj, layout, path, log in ex.map(compile_one, jobs):
            spill = max(map(int, re.findall(r"(\d+) bytes spill", log)), default=0)
            regs = re.search(r"Used (\d+) registers", log)
            if path is None or spill:
                build_fail.append((pj, layout, log[-1500:]))
            else:
                cubins[(pj, layout)] = path
            if path and regs and "serialized" in log:
                print("WGMMA SERIALIZED", layout, pj, log[-800:])
    print(f"compiled {len(cubins)} of {len(jobs)} (setting, layout) sources in {time.time() - t0:.0f} s; "
          f"{len(build_fail)} failed or spilled", flush=True)
    for pj, layout, log in build_fail[:3]:
        print("BUILD FAIL", layout, pj, log, sep="\n")
    for layout in ("kn", "nk"):
        first = next((p for (pj, lay), p in cubins.items() if lay == layout), None)
        if first:
            print(f"SASS {layout} {short(json.loads(next(pj for (pj, lay) in cubins if lay == layout)))}: "
                  f"{disassemble(first)}", flush=True)

    worker = WorkerProcess()
    status: dict[tuple[str, str], dict] = {}
    bad_in_a_row = 0
    for (pj, layout), path in cubins.items():
        res = worker.run({"kind": "check", "params": json.loads(pj), "layout": layout, "cubin": path})
        status[(pj, layout)] = res
        if res["status"] != "ok":
            worst = [s for s in res.get("shapes", []) if not s["ok"]][:3]
            print(f"{res['status']:5} {layout} {short(json.loads(pj))}: {res.get('error', '')} {worst}", flush=True)
        bad_in_a_row = bad_in_a_row + 1 if res["status"] in ("HANG", "FAULT", "CRASH") else 0
        if bad_in_a_row >= 3:
            print("three hangs/faults in a row: stopping the correctness pass", flush=True)
            break
    n_ok = sum(r["status"] == "ok" for r in status.values())
    print(f"correctness: {n_ok} of {len(status)} (setting, layout) pass all of {', '.join(CHECK_SHAPES)} "
          f"({time.time() - t0:.0f} s)", flush=True)
    for layout in ("kn", "nk"):
        errs = [s["err"] / s["torch_err"] for (pj, lay), r in status.items() if lay == layout and r["status"] == "ok"
                for s in r["shapes"]]
        if errs:
            print(f"  {layout}: worst rel err / torch's own: {max(errs):.2f}")

    rows = []
    for mnk in TIMED:
        for layout in ("kn", "nk"):
            prob = problem(mnk, layout)
            for p in FAMILY.space(prob)[:time_top]:
                pj = key(p)
                if status.get((pj, layout), {}).get("status") != "ok":
                    continue
                res = worker.run({"kind": "time", "params": p, "layout": layout, "cubin": cubins[(pj, layout)],
                                  "mnk": mnk})
                if res["status"] == "ok":
                    rows.append((mnk, layout, short(p), res))
                else:
                    print(f"timing {res['status']} {mnk} {layout} {short(p)}", flush=True)
    worker.kill()
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "sm90_check.json").write_text(json.dumps(
            {"status": {f"{lay} {pj}": r for (pj, lay), r in status.items()},
             "timing": [dict(mnk=m, layout=lay, setting=s, **r) for m, lay, s, r in rows]}, indent=1))
    print(f"\ntiming: CUDA-graph replays, warm L2, median of 7 interleaved with cuBLAS; ratio = t_cublas / t "
          f"({time.time() - t0:.0f} s)")
    print(f"{'shape':>15} {'B':>2} {'setting':<28} {'us':>9} {'cuBLAS us':>9} {'ratio':>6} {'TFLOP/s':>8}")
    for mnk, layout, s, r in rows:
        flops = problem(mnk, layout).flops
        print(f"{mnk:>15} {layout:>2} {s:<28} {r['us']:9.1f} {r['cublas_us']:9.1f} {r['cublas_us'] / r['us']:6.3f} "
              f"{flops / r['us'] / 1e6:8.1f}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker_main()
    else:
        main()
