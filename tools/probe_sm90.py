"""Where an sm90_wgmma CTA spends its time: per-CTA %globaltimer probes (run on the GPU machine).

    python3 tools/probe_sm90.py JOBS_JSON

JOBS_JSON is a list of [params, layout, "M_N_K"] or [params, layout, "M_N_K", "variant+variant"]. Each job renders
the setting, inserts timer reads at fixed points of the source (PROBES, anchored on the template's text: a template
change that moves an anchor fails loudly here, and tests/test_probe_tool.py checks every anchor on the CPU), times
the kernel and cuBLAS with CUDA graphs in this process, then launches it three times and prints one line: per CTA,
min / median / max µs of the start offset, the first TMA copy issued, the first full stage, the mainloop, the
epilogue and the end offset; with split-K also the epilogue's parts (partial tile + cluster barrier, the sum, the
closing barrier). The probes are a few global stores per CTA: compare phases with phases, and graph times with
unprobed runs. VARIANTS are source edits measured in session 4 (BENCHMARKS.md), kept to repeat those experiments.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.records import Problem  # noqa: E402
from templates.sm90_wgmma.space import Sm90Wgmma  # noqa: E402
from tools.check_sm90_gpu import operands  # noqa: E402

FAMILY = Sm90Wgmma()
SLOTS = 8  # per CTA: start, first full, mainloop end, end, SM id, first copy issued, and two phase marks
MAX_CTAS = 16384


def _mark(slot: int, who: str) -> str:
    return f"if ({who}) probe_buf[blockIdx.x * {SLOTS} + {slot}] = gtime();"


# (anchor, replacement): the anchor text stays and the probe goes before or after it.
PROBES = [
    ("typedef unsigned long long u64;\n",
     "typedef unsigned long long u64;\n"
     f"__device__ u64 probe_buf[{MAX_CTAS} * {SLOTS}];\n"
     "__device__ __forceinline__ u64 gtime() {\n"
     "    u64 t;\n    asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t));\n    return t;\n}\n"
     "__device__ __forceinline__ u64 smid() {\n"
     "    unsigned s;\n    asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(s));\n    return s;\n}\n"),
    # the start stays in a register: a global store here would make thread 0's barrier-init fence wait for it
    ("    extern __shared__ __align__(1024) unsigned char smem_raw[];\n",
     "    extern __shared__ __align__(1024) unsigned char smem_raw[];\n    const u64 probe_t0 = gtime();\n"),
    ("        tma_load(s_a, tm_a, bar, kt * BK, m0);\n",
     "        tma_load(s_a, tm_a, bar, kt * BK, m0);\n        " + _mark(5, "kt == kt_begin") + "\n"),
    ("        mbar_wait(full + pos.stage * 8, pos.phase);\n",
     "        mbar_wait(full + pos.stage * 8, pos.phase);\n        " + _mark(1, "kt == kt_begin && t == 0 && cw == 0")
     + "\n"),
    ("    wgmma_wait<0>();\n    if (lane == 0",
     "    wgmma_wait<0>();\n    " + _mark(2, "t == 0 && cw == 0") + "\n    if (lane == 0"),
    ("    // This CTA sums rows",
     "    " + _mark(6, "t == 0 && cw == 0") + "\n    // This CTA sums rows"),
    ("    if (SPLIT_K > 1) cluster_sync_relaxed();",
     "    " + _mark(7, "t == 0 && cw == 0") + "\n    if (SPLIT_K > 1) cluster_sync_relaxed();"),
    ("    // Multicast: no CTA leaves",
     f"    if (threadIdx.x == 128) {{\n        probe_buf[blockIdx.x * {SLOTS} + 3] = gtime();\n"
     f"        probe_buf[blockIdx.x * {SLOTS}] = probe_t0;\n        probe_buf[blockIdx.x * {SLOTS} + 4] = smid();\n"
     "    }\n    // Multicast: no CTA leaves"),
]

SETMAXNREG_DEC = ("        if (SET_MAXNREG) asm volatile(\"setmaxnreg.dec.sync.aligned.u32 %0;\\n\""
                  " ::\"n\"(PRODUCER_REGS));\n")
NK_COPY = "            tma_load(s_b + rank * ROWS * 128, tm_b, bar, kt * BK, n0 + rank * ROWS, MASK);\n"
VARIANTS = {
    # the two tensor maps' descriptors prefetched at entry (TMA loader only): no change measured
    "prefetch": [("    const u64 probe_t0 = gtime();\n",
                  "    const u64 probe_t0 = gtime();\n    if (threadIdx.x == 0) {\n" + "".join(
                      f"        asm volatile(\"prefetch.tensormap [%0];\" ::\"l\"(reinterpret_cast<u64>(&{m}))"
                      " : \"memory\");\n" for m in ("tm_a", "tm_b")) + "    }\n")],
    # marks after the block barrier (slot 6) and the producer's setmaxnreg (slot 7), for plain (unsplit) settings
    "setup": [("    __syncthreads();\n", "    __syncthreads();\n    " + _mark(6, "threadIdx.x == 0") + "\n"),
              (SETMAXNREG_DEC, SETMAXNREG_DEC + "        " + _mark(7, "threadIdx.x == 0") + "\n")],
    # no fence after the barrier init: no change measured
    "nofence": [("        asm volatile(\"fence.mbarrier_init.release.cluster;\\n\" ::: \"memory\");\n", "")],
    # nk with its B tile as two 64-row copies (run with box (64, 64) for B): as slow as kn's two panel copies
    "nk2box": [(NK_COPY, NK_COPY + "            tma_load(s_b + 64 * 128, tm_b, bar, kt * BK, n0 + 64);\n")],
    # kn's loads with nk's (K-major) B descriptors: wrong results, timing only; the transposed wgmma is not the cost
    "kdesc": [("p, 1, 1, 0, 1;", "p, 1, 1, 0, 0;"),
              ("return B_KN ? smem_desc(tile + kk * 2048, B_PANEL, 1024) :", "return false ? 0 :")],
}


def source(params: dict, layout: str, variant: str = "") -> str:
    """The setting's kernel with the probes (and the variant's edits) in; AssertionError names a missing anchor."""
    src = FAMILY.render(params, Problem(256, 256, 256, layout))
    edits = PROBES + [e for name in variant.split("+") if name for e in VARIANTS[name]]
    for anchor, replacement in edits:
        assert anchor in src, f"probe anchor not in the sm90_wgmma source: {anchor!r}"
        src = src.replace(anchor, replacement, 1)
    return src


def summarize(rows, setup: bool = False) -> tuple[dict[str, tuple[float, float, float]], dict[str, int]]:
    """Phase statistics (min, median, max in µs) from the probe buffer's rows of the CTAs that ran (end stored), and
    their counts (CTAs, SMs, most CTAs on one SM); `setup`: slots 6 and 7 hold the "setup" variant's marks, not
    split-K's."""
    live = [r for r in rows if r[3] > 0]
    t0 = min(r[0] for r in live)

    def stats(values) -> tuple[float, float, float]:
        xs = sorted(v / 1e3 for v in values)
        return (xs[0], statistics.median(xs), xs[-1]) if xs else (0.0, 0.0, 0.0)

    out = {"start": stats(r[0] - t0 for r in live), "first copy": stats(r[5] - r[0] for r in live if r[5]),
           "first stage": stats(r[1] - r[0] for r in live), "mainloop": stats(r[2] - r[1] for r in live),
           "epilogue": stats(r[3] - r[2] for r in live), "end": stats(r[3] - t0 for r in live)}
    marked = [r for r in live if r[6] and r[7]]
    if marked and setup:  # since the start: the block barrier passed, the producer's registers handed over
        out.update({"barrier": stats(r[6] - r[0] for r in marked), "setmaxnreg": stats(r[7] - r[0] for r in marked)})
    elif marked:  # split-K / K groups: the partial tile and its barrier, the sum, the closing barrier
        out.update({"partials": stats(r[6] - r[2] for r in marked), "sum": stats(r[7] - r[6] for r in marked),
                    "close": stats(r[3] - r[7] for r in marked)})
    sms = [r[4] for r in live]
    return out, {"ctas": len(live), "sms": len(set(sms)), "per sm": max(sms.count(s) for s in set(sms))}


def line(label: str, graph_us: float, cublas_us: float, phases: dict, counts: dict) -> str:
    where = f"ctas {counts['ctas']} on {counts['sms']} SMs (<= {counts['per sm']} each)"
    parts = [f"{k} {a:.2f}/{m:.2f}/{b:.2f}" for k, (a, m, b) in phases.items()]
    return f"{label}: graph {graph_us:.2f} µs, cuBLAS {cublas_us:.2f} | {where} | " + " | ".join(parts)


def run(params: dict, layout: str, mnk: str, variant: str = "") -> str:
    import dataclasses

    import cupy
    import torch

    from sandbox.build import compile_cuda
    from sandbox.launch import Kernel
    from sandbox.timing import measure

    m, n, k = map(int, mnk.split("_"))
    params = FAMILY.parse(params, Problem(m, n, k, layout)).model_dump()
    build = compile_cuda(source(params, layout, variant), cache_dir=None)
    assert build.ok, build.error or build.log

    def rule(mm: int, nn: int, kk: int):
        spec = FAMILY.launch(params, Problem(mm, nn, kk, layout))
        if "nk2box" in variant:  # B in 64-row boxes, two per stage
            maps = tuple(dataclasses.replace(t, box=(64, 64)) if t.operand == "B" else t for t in spec.tensor_maps)
            spec = dataclasses.replace(spec, tensor_maps=maps)
        return spec

    kern = Kernel(build.cubin, rule)
    grid = rule(m, n, k).grid[0]
    assert grid <= MAX_CTAS, f"{grid} CTAs: the probe buffer holds {MAX_CTAS}"
    a, b, b_kn = operands(Problem(m, n, k, layout))
    c, c2 = torch.empty(m, n, device="cuda", dtype=torch.float16), torch.empty(m, n, device="cuda", dtype=torch.float16)
    t = measure({"k": lambda: kern(a, b, c, m, n, k), "cublas": lambda: torch.matmul(a, b_kn, out=c2)}, None, replays=5)
    ref = a.double() @ b_kn.double()
    err = ((c.double() - ref).norm() / ref.norm()).item()
    buf = kern.module.get_global("probe_buf")
    for _ in range(3):  # back to back; the last launch's probes are read
        buf.memset(0, buf.mem.size)
        kern(a, b, c, m, n, k)
    torch.cuda.synchronize()
    rows = cupy.ndarray((MAX_CTAS * SLOTS,), dtype=cupy.uint64, memptr=buf).get()[: grid * SLOTS]
    phases, counts = summarize([[int(x) for x in rows[i * SLOTS:(i + 1) * SLOTS]] for i in range(grid)],
                               "setup" in variant)
    label = f"{mnk} {layout} {json.dumps(params, sort_keys=True)}" + (f" [{variant}]" if variant else "")
    label += f" err {err:.1e}"
    return line(label, t["k"].median_us, t["cublas"].median_us, phases, counts)


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    print("per CTA, µs, min/median/max (warm L2)", flush=True)
    for params, layout, mnk, *variant in jobs:
        try:
            print(run(params, layout, mnk, *variant), flush=True)
        except Exception as e:  # noqa: BLE001 - one bad job must not end the sweep
            print(f"FAILED {mnk} {layout} {params} {variant}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main()
