"""Check the sm90_wgmma family on a real GPU: every space() setting correct on odd shapes, speed vs cuBLAS.

Run on the GPU machine from the repository root:  python3 tools/check_sm90_gpu.py [out_dir]
Split-K only (short):  python3 tools/check_sm90_gpu.py --split [out_dir]: every split_k > 1 setting space() proposes
for the long-K shapes, plus each shape's best unsplit setting, checked on small odd shapes (empty K ranges, K not a
multiple of 64 split_k) and the long-K shapes themselves, then timed on the long-K shapes.
Loaders (short):  python3 tools/check_sm90_gpu.py --tma [out_dir]: the first space() settings of TMA_SHAPES, each
with the cp.async and the TMA producer, checked on the odd shapes and timed side by side.
Epilogues (short):  python3 tools/check_sm90_gpu.py --epilogue [out_dir]: the same for the smem, tma, persistent
direct and persistent tma epilogues of EPILOGUE_SHAPES' first settings.
Split-K on mid-size shapes (short):  python3 tools/check_sm90_gpu.py --split-mid [out_dir]: for SPLIT_MID_SHAPES,
space()'s first three settings and split-K 2 and 4 variants of a few tile shapes (which space() does not propose
there).
K groups (short):  python3 tools/check_sm90_gpu.py --groups [out_dir]: for GROUPS_SHAPES (few C tiles), space()'s
first two settings and k_groups variants (fp32 partial tiles summed through a workspace by the last CTA to arrive)
of a few tile shapes, with and without cluster split-K, each filling about one wave of CTAs.
Multicast (short):  python3 tools/check_sm90_gpu.py --multicast [out_dir]: for MULTICAST_SHAPES, space()'s first
non-persistent TMA settings with and without clusters of 2 CTAs sharing each B tile by TMA multicast.
Swapped roles (short):  python3 tools/check_sm90_gpu.py --swap [out_dir]: for SWAP_SHAPES (M <= 48), every
swap_ab setting space() proposes beside its first unswapped ones.
SWEEP_SHAPES=M_N_K,... limits any of the short modes' timings to those of its shapes. SM90_TEMPLATE=PATH renders every
setting from that template file instead of the family's (the same run on two template versions: a before/after).
For ncu: ncu -k regex:"hgemm|nvjet" -s 2 -c 2 python3 tools/check_sm90_gpu.py --profile PARAMS_JSON LAYOUT M_N_K
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

from core.records import Problem  # noqa: E402
from templates.sm90_wgmma.space import Sm90Wgmma  # noqa: E402

FAMILY = Sm90Wgmma()
CHECK_SHAPES = ["1_8_8", "17_24_40", "64_64_64", "257_136_520", "1000_3000_2000", "3000_2008_136", "4096_4096_4096"]
SPACE_SHAPES = ["128_256_64", "1000_3000_2000", "4096_4096_4096", "8192_8192_8192", "64_1024_16384"]
# Timed shapes and how many of their space() settings (best guesses first) to time, both B layouts each.
TIMED = {"4096_4096_4096": 12, "8192_8192_8192": 12, "1024_1024_1024": 4, "2048_2048_2048": 4, "1000_3000_2000": 4,
         "512_8192_1024": 4, "16384_4096_4096": 4, "4096_6144_4096": 4, "2048_14336_4096": 4, "16384_1024_1024": 4}
VARIANT_SHAPES = ["4096_4096_4096", "8192_8192_8192"]
FIRST_JOB_TIMEOUT_S, JOB_TIMEOUT_S = 60.0, 20.0
# --split: the split-K settings' shapes; how many split settings per (shape, layout) to time.
SPLIT_CHECK_SHAPES = ["1_8_8", "17_24_40", "257_136_520", "100_264_1000", "64_1024_16384", "256_128_16384"]
SPLIT_SHAPES = {"64_1024_16384": 12, "256_128_16384": 12}
SPLIT_ONLY = "--split" in sys.argv
TMA_ONLY = "--tma" in sys.argv
TMA_SHAPES = {"4096_4096_4096": 4, "8192_8192_8192": 3, "1024_1024_1024": 3, "1000_3000_2000": 2,
              "256_4096_4096": 2, "64_1024_16384": 2, "16384_512_128": 2}
EPILOGUE_ONLY = "--epilogue" in sys.argv
EPILOGUE_SHAPES = {"16384_512_128": 2, "12288_1024_64": 2, "16384_16384_64": 1, "4096_4096_4096": 2,
                   "8192_8192_8192": 1, "2048_2048_2048": 1, "1000_3000_2000": 1, "16384_1024_1024": 1}
EPILOGUES = ({}, {"epilogue": "tma"}, {"persistent": True, "epilogue": "direct"},
             {"persistent": True, "epilogue": "tma"})
SPLIT_MID = "--split-mid" in sys.argv
SPLIT_MID_SHAPES = {"64_4096_16384": 1, "128_8192_8192": 1, "2048_1024_12288": 1, "16_4096_4096": 1,
                    "1024_1024_1024": 1, "2048_2048_2048": 1, "64_12288_4096": 1}
GROUPS = "--groups" in sys.argv
GROUPS_SHAPES = {"256_128_16384": 8, "64_1024_16384": 8, "64_4096_16384": 6, "16_4096_4096": 6,
                 "1024_1024_1024": 2}
MULTICAST = "--multicast" in sys.argv
MULTICAST_SHAPES = {"2048_2048_2048": 3, "512_8192_1024": 3, "2048_1024_12288": 3, "1024_1024_1024": 3,
                    "256_4096_4096": 3, "128_8192_8192": 2, "1000_3000_2000": 2, "4096_4096_4096": 2,
                    "2048_14336_4096": 2}
SWAP = "--swap" in sys.argv
SWAP_SHAPES = {"16_4096_4096": 4, "16_14336_4096": 4}
# The short modes other than --split: each times its own shapes after checking the same small odd ones.
SHORT_MODES = {"--tma": TMA_SHAPES, "--epilogue": EPILOGUE_SHAPES, "--split-mid": SPLIT_MID_SHAPES,
               "--groups": GROUPS_SHAPES, "--multicast": MULTICAST_SHAPES, "--swap": SWAP_SHAPES}
MODE = next((flag for flag in SHORT_MODES if flag in sys.argv), None)
# SM90_TEMPLATE: the template text every setting renders from instead of the family's (None: the family's)
TEMPLATE = Path(os.environ["SM90_TEMPLATE"]).read_text() if os.environ.get("SM90_TEMPLATE") else None
SPLIT_TIMING_DEADLINE_S = 150.0  # --split skips the remaining timings after this long, so the table still prints
# Source edits tried on the best-guess settings of the timed shapes: (name, old, new).
VARIANTS = [("no-proxy-fence", r'asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");', "")]


def problem(mnk: str, layout: str) -> Problem:
    m, n, k = map(int, mnk.split("_"))
    return Problem(m, n, k, layout)


def operands(prob: Problem):
    """Random fp16 A (M x K) and B in the problem's layout on the GPU, and B as K x N (a view for nk)."""
    import torch

    a = torch.randn(prob.m, prob.k, device="cuda", dtype=torch.float16)
    shape = (prob.k, prob.n) if prob.b_layout == "kn" else (prob.n, prob.k)
    b = torch.randn(*shape, device="cuda", dtype=torch.float16)
    return a, b, b if prob.b_layout == "kn" else b.t()


def settings(prob: Problem, top: int | None = None) -> list[dict]:
    """space()'s first `top` settings; with --split, its split-K settings' first `top` and its best unsplit one."""
    space = FAMILY.space(prob)
    if TMA_ONLY:
        return [dict(p, loader=loader) for p in space[:top] for loader in ("cp_async", "tma")]
    if SPLIT_MID:
        from templates.sm90_wgmma.space import Sm90WgmmaParams, deepest

        base = space[:3]
        for bm, bn, c in ((64, 128, 1), (128, 128, 2), (128, 256, 2), (64, 256, 1), (64, 192, 1)):
            if bm > max(64, prob.m):
                continue
            for split in (2, 4):
                tile = Sm90WgmmaParams(block_m=bm, block_n=bn, consumers=c, stages=4)
                v = deepest({**tile.model_dump(), "split_k": split}, top=6)
                if v is not None:
                    base.append(v.model_dump())
        return base
    if GROUPS:
        return space[:2] + group_variants(prob)[:top]
    if MULTICAST:
        from templates.sm90_wgmma.space import Sm90WgmmaParams, with_update

        plain = [p for p in space if not p["persistent"] and p["loader"] == "tma" and p["split_k"] == 1
                 and p["k_groups"] == 1][:top]
        for bm, bn, c, stages in ((64, 128, 1, 8), (128, 128, 2, 6)):  # tiles wide enough to share B in halves
            extra = Sm90WgmmaParams(block_m=bm, block_n=bn, consumers=c, stages=stages).model_dump()
            if extra not in plain:
                plain.append(extra)
        pairs = [with_update(Sm90WgmmaParams(**p), {"cluster_m": 2}) for p in plain]
        return plain + [v.model_dump() for v in pairs if v is not None]
    if SWAP:
        unswapped = [p for p in space if not p["swap_ab"]]
        return [p for p in space if p["swap_ab"]] + unswapped[:top]
    if EPILOGUE_ONLY:
        from templates.sm90_wgmma.space import Sm90WgmmaParams, with_update

        made = [with_update(Sm90WgmmaParams(**p), u) for p in space[:top] for u in EPILOGUES]
        return list({key(v.model_dump()): v.model_dump() for v in made if v is not None}.values())
    if not SPLIT_ONLY:
        return space[:top]
    return [p for p in space if p["split_k"] > 1][:top] + [p for p in space if p["split_k"] == 1][:1]


def group_variants(prob: Problem) -> list[dict]:
    """k_groups settings that fill about one wave of CTAs (K groups x split_k x tiles <= 132), most CTAs first."""
    from templates.sm90_wgmma.space import deepest

    k_tiles = -(-prob.k // 64)
    found = []
    for bm, bn, c in ((64, 64, 1), (64, 128, 1), (128, 64, 2), (128, 128, 2), (64, 256, 1), (128, 256, 2)):
        if bm > -(-prob.m // 64) * 64 or bn > -(-prob.n // 64) * 64:
            continue
        tiles = -(-prob.m // bm) * -(-prob.n // bn)
        for split in (1, 2, 4, 8):
            groups = min(16, 132 // (tiles * split))
            if groups < 2 or k_tiles // (split * groups) < 4:
                continue
            v = deepest({"block_m": bm, "block_n": bn, "consumers": c, "split_k": split, "k_groups": groups})
            if v is not None:
                found.append((tiles * split * groups, -split, v.model_dump()))
    found.sort(key=lambda f: (-f[0], f[1]))
    return [p for _, _, p in found]


def key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def short(params: dict, variant: str = "") -> str:
    p = params
    return (f"{p['block_m']}x{p['block_n']} c{p['consumers']} s{p['stages']} g{p['raster_group']} "
            f"b{p['min_blocks']} {p['epilogue']}{' P' if p.get('persistent') else ''}"
            + (f" k{p['split_k']}" if p.get("split_k", 1) > 1 else "")
            + (f" G{p['k_groups']}" if p.get("k_groups", 1) > 1 else "")
            + (f" MC{p['cluster_m']}" if p.get("cluster_m", 1) > 1 else "")
            + (" TMA" if p.get("loader") == "tma" else "")
            + (" SWAP" if p.get("swap_ab") else "")
            + (f" [{variant}]" if variant else ""))


def compile_one(job: tuple[tuple[str, str, str], str]) -> tuple[tuple[str, str, str], str | None, str]:
    from cupy_backends.cuda.libs import nvrtc

    (params_json, layout, variant), out_path = job
    src = FAMILY.render(json.loads(params_json), problem("256_256_256", layout), template=TEMPLATE)
    for name, old, new in VARIANTS:
        if name == variant:
            assert old in src, f"variant {name}: text not in the source"
            src = src.replace(old, new)
    prog = nvrtc.createProgram(src, "k.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=sm_90a", "--ptxas-options=-v", "-std=c++17"])
    except Exception:
        return job[0], None, nvrtc.getProgramLog(prog)
    Path(out_path).write_bytes(nvrtc.getCUBIN(prog))
    return job[0], out_path, nvrtc.getProgramLog(prog)


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
            a, b, b_kn = operands(prob)
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
        for mnk in job.get("shapes", CHECK_SHAPES):
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
    """Counts of the instructions that tell the story: HGMMA (wgmma ran), LDL/STL (local memory), LDGSTS (cp.async)."""
    note = "no disassembler found"
    for tool, args in (("cuobjdump", ["--dump-sass"]), ("nvdisasm", [])):
        path = shutil.which(tool)
        if not path:
            continue
        run = subprocess.run([path, *args, cubin], capture_output=True, text=True)
        if "HGMMA" in run.stdout or "LDGSTS" in run.stdout:
            ops = ("HGMMA", "HMMA", "LDL", "STL", "LDGSTS", "SYNCS", "STS", "STG")
            counts = {op: len(re.findall(r"\b" + op + r"\b", run.stdout)) for op in ops}
            return f"{tool}: " + " ".join(f"{op}={n}" for op, n in counts.items())
        note = f"{tool} rc={run.returncode}: {(run.stderr or run.stdout)[:300]!r}"
    return note


def profile_one(params_json: str, layout: str, mnk: str) -> None:
    """Launch one setting and cuBLAS twice each, interleaved, for ncu (-s 2 -c 2 profiles the second of each)."""
    import torch

    from sandbox.launch import Kernel

    params = FAMILY.parse(json.loads(params_json), problem(mnk, layout)).model_dump()
    out = tempfile.mkdtemp() + "/k.cubin"
    _, path, log = compile_one(((key(params), layout, ""), out))
    assert path, log
    prob = problem(mnk, layout)
    kern = Kernel(Path(path).read_bytes(), lambda m, n, k: FAMILY.launch(params, Problem(m, n, k, layout)))
    a, b, b_kn = operands(prob)
    c = torch.empty(prob.m, prob.n, device="cuda", dtype=torch.float16)
    for _ in range(2):
        kern(a, b, c, prob.m, prob.n, prob.k)
        torch.matmul(a, b_kn, out=c)
    torch.cuda.synchronize()
    print(f"profiled {short(params)} {layout} {mnk}: {disassemble(path)}")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out_dir = Path(args[0]) if args else None
    t0 = time.time()
    global CHECK_SHAPES, SPACE_SHAPES, TIMED, VARIANT_SHAPES
    if SPLIT_ONLY:
        CHECK_SHAPES, SPACE_SHAPES, TIMED, VARIANT_SHAPES = SPLIT_CHECK_SHAPES, list(SPLIT_SHAPES), SPLIT_SHAPES, []
    if MODE:
        CHECK_SHAPES = ["1_8_8", "17_24_40", "257_136_520", "1000_3000_2000", "100_264_1000"]
        SPACE_SHAPES, VARIANT_SHAPES, TIMED = [], [], SHORT_MODES[MODE]
        if GROUPS:  # the long-K shapes themselves too: many K groups, and counters reused across shapes
            CHECK_SHAPES += ["64_1024_16384", "256_128_16384", "1_8_8"]
        if SWAP:  # the timed shapes' own K splits, and an A box of 16 rows for 9
            CHECK_SHAPES += ["16_4096_4096", "9_136_72", "16_14336_4096"]
    if os.environ.get("SWEEP_SHAPES"):  # time only these (comma-separated M_N_K) of the mode's shapes
        TIMED = {s: n for s, n in TIMED.items() if s in os.environ["SWEEP_SHAPES"].split(",")}
    # (params json, layout, variant) -> params: every space() setting of every SPACE_SHAPE, the timed settings, and
    # the variants of the first setting of each VARIANT_SHAPE.
    keys: dict[tuple[str, str, str], dict] = {}
    for layout in ("kn", "nk"):
        for mnk in SPACE_SHAPES:
            for p in settings(problem(mnk, layout)):
                keys.setdefault((key(p), layout, ""), p)
        for mnk, top in TIMED.items():
            for p in settings(problem(mnk, layout), top):
                keys.setdefault((key(p), layout, ""), p)
        for mnk in VARIANT_SHAPES:
            p = FAMILY.space(problem(mnk, layout))[0]
            for name, _, _ in VARIANTS:
                keys.setdefault((key(p), layout, name), p)
    tmp = tempfile.mkdtemp()
    jobs = [(k, f"{tmp}/{i}.cubin") for i, k in enumerate(keys)]
    cubins: dict[tuple[str, str, str], str] = {}
    build_fail = []
    with ProcessPoolExecutor(os.cpu_count()) as ex:
        for k, path, log in ex.map(compile_one, jobs):
            spill = max(map(int, re.findall(r"(\d+) bytes spill", log)), default=0)
            if path is None or spill:
                build_fail.append((k, log[-1500:]))
            else:
                cubins[k] = path
            if path and "serialized" in log:
                print("WGMMA SERIALIZED", k, log[-800:])
    print(f"compiled {len(cubins)} of {len(jobs)} (setting, layout, variant) sources in {time.time() - t0:.0f} s; "
          f"{len(build_fail)} failed or spilled", flush=True)
    for k, log in build_fail[:3]:
        print("BUILD FAIL", k, log, sep="\n")
    for layout in ("kn", "nk"):
        k = next((k for k in cubins if k[1] == layout and not k[2]), None)
        if k:
            print(f"SASS {layout} {short(keys[k])}: {disassemble(cubins[k])}", flush=True)

    worker = WorkerProcess()
    status: dict[tuple[str, str, str], dict] = {}
    bad_in_a_row = 0
    for k, path in cubins.items():
        res = worker.run({"kind": "check", "params": keys[k], "layout": k[1], "cubin": path, "shapes": CHECK_SHAPES})
        status[k] = res
        if res["status"] != "ok":
            worst = [s for s in res.get("shapes", []) if not s["ok"]][:3]
            print(f"{res['status']:5} {k[1]} {short(keys[k], k[2])}: {res.get('error', '')} {worst}", flush=True)
        bad_in_a_row = bad_in_a_row + 1 if res["status"] in ("HANG", "FAULT", "CRASH") else 0
        if bad_in_a_row >= 3:
            print("three hangs/faults in a row: stopping the correctness pass", flush=True)
            break
    n_ok = sum(r["status"] == "ok" for r in status.values())
    print(f"correctness: {n_ok} of {len(status)} (setting, layout, variant) pass all of {', '.join(CHECK_SHAPES)} "
          f"({time.time() - t0:.0f} s)", flush=True)
    for layout in ("kn", "nk"):
        errs = [s["err"] / s["torch_err"] for k, r in status.items() if k[1] == layout and r["status"] == "ok"
                for s in r["shapes"]]
        if errs:
            print(f"  {layout}: worst rel err / torch's own: {max(errs):.2f}")

    rows = []
    short_mode = SPLIT_ONLY or MODE is not None
    for mnk, top in TIMED.items():
        for layout in ("kn", "nk"):
            prob = problem(mnk, layout)
            todo = [(key(p), layout, "") for p in settings(prob, top)]
            if mnk in VARIANT_SHAPES:
                todo += [k for k in keys if k[1] == layout and k[2] and (k[0], layout, "") == todo[0]]
            for k in todo:
                if status.get(k, {}).get("status") != "ok":
                    continue
                if short_mode and time.time() - t0 > SPLIT_TIMING_DEADLINE_S + 150 * (not SPLIT_ONLY):
                    print(f"timing skipped (past {SPLIT_TIMING_DEADLINE_S:.0f} s): {mnk} {layout} {short(keys[k])}")
                    continue
                res = worker.run({"kind": "time", "params": keys[k], "layout": layout, "cubin": cubins[k], "mnk": mnk})
                if res["status"] == "ok":
                    rows.append((mnk, layout, short(keys[k], k[2]), res))
                else:
                    print(f"timing {res['status']} {mnk} {layout} {short(keys[k], k[2])}", flush=True)
    worker.kill()
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "sm90_check.json").write_text(json.dumps(
            {"status": {" ".join(k): r for k, r in status.items()},
             "timing": [dict(mnk=m, layout=lay, setting=s, **r) for m, lay, s, r in rows]}, indent=1))
    print(f"\ntiming: CUDA-graph replays, warm L2, median of 7 interleaved with cuBLAS; ratio = t_cublas / t "
          f"({time.time() - t0:.0f} s)")
    print(f"{'shape':>15} {'B':>2} {'setting':<44} {'us':>8} {'cuBLAS us':>9} {'ratio':>6} {'TFLOP/s':>8}")
    best: dict[tuple[str, str], tuple] = {}
    for mnk, layout, s, r in rows:
        flops = problem(mnk, layout).flops
        print(f"{mnk:>15} {layout:>2} {s:<44} {r['us']:8.1f} {r['cublas_us']:9.1f} {r['cublas_us'] / r['us']:6.3f} "
              f"{flops / r['us'] / 1e6:8.1f}")
        if "[" not in s and ((mnk, layout) not in best or r["us"] < best[(mnk, layout)][1]["us"]):
            best[(mnk, layout)] = (s, r)
    print("\nbest setting per shape (same measurements)")
    print(f"{'shape':>15} {'B':>2} {'setting':<44} {'us':>8} {'cuBLAS us':>9} {'ratio':>6} {'TFLOP/s':>8}")
    for (mnk, layout), (s, r) in best.items():
        flops = problem(mnk, layout).flops
        print(f"{mnk:>15} {layout:>2} {s:<44} {r['us']:8.1f} {r['cublas_us']:9.1f} {r['cublas_us'] / r['us']:6.3f} "
              f"{flops / r['us'] / 1e6:8.1f}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker_main()
    elif "--profile" in sys.argv:
        i = sys.argv.index("--profile")
        profile_one(*sys.argv[i + 1: i + 4])
    else:
        main()
