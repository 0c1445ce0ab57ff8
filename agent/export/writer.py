"""Write a run's winners into an export folder: per problem a self-contained .cu (+ cubin) with its launch
configuration in its header, `manifest.json` (kernels keyed by problem key, with the launch data the op needs), and
the runtime files (runtime/: the Python module `hgemm_ops.py`, the compiled op's C++ source and build helper, the
self-check; sandbox/driver.py as `hgemm_driver.py`) that run them on torch tensors and call cuBLAS where no kernel
beat it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.store import RunStore
from core.device import DeviceFacts
from core.records import Problem
from templates import get_family

RUNTIME = Path(__file__).with_name("runtime")  # every file in it is copied as it is
DRIVER = Path(__file__).parents[2] / "sandbox" / "driver.py"  # tensor maps and launches; copied as hgemm_driver.py


@dataclass(frozen=True)
class ExportLine:
    problem: Problem
    kernel_file: str | None  # None: the op calls cuBLAS for this shape
    note: str


def export_run(store: RunStore, out: Path) -> list[ExportLine]:
    """Per problem of the run, its winner (where it beat cuBLAS) with its family's launch rule for the run's GPU."""
    out.mkdir(parents=True, exist_ok=True)
    device = DeviceFacts.from_dict(store.get_meta("device"))
    manifest: dict = {"run": store.run_id, "device": device.name, "kernels": {}, "cublas": []}
    lines = []
    for p in store.problems():
        win = store.winner(p)
        if win is None or win.speedup <= 1.0:
            manifest["cublas"].append(p.key)
            why = "no candidate passed the checks" if win is None else f"best was {win.speedup:.3f}x of cuBLAS"
            lines.append(ExportLine(p, None, f"cuBLAS ({why})"))
            continue
        cand, result, ratio = win.candidate, win.result, win.speedup
        build = store.build(cand.id)
        spec = get_family(cand.family).launch(cand.params, p, device)
        stem = "hgemm_" + p.key.replace(":", "_")
        (out / f"{stem}.cu").write_text(_header(store, p, cand, result, spec, ratio) + build.source)
        (out / f"{stem}.cubin").write_bytes(build.cubin)
        manifest["kernels"][p.key] = {
            "file": f"{stem}.cu", "cubin": f"{stem}.cubin", "arch": build.arch, "candidate": cand.id,
            "grid": list(spec.grid), "block": list(spec.block), "smem_bytes": spec.smem_bytes,
            "tensor_maps": [asdict(t) for t in spec.tensor_maps], "workspace_bytes": spec.workspace_bytes,
            "counters": spec.counters,
            "time_us": result.time_us, "cublas_us": result.ranked[1].median_us, "speedup": ratio,
        }
        lines.append(ExportLine(p, f"{stem}.cu", f"{ratio:.3f}x of cuBLAS ({cand.id})"))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for f in RUNTIME.iterdir():
        if f.is_file() and f.suffix in (".py", ".cpp", ".h"):
            shutil.copyfile(f, out / f.name)
    shutil.copyfile(DRIVER, out / "hgemm_driver.py")
    return lines


def _header(store, p, cand, result, spec, ratio) -> str:
    dtype = {"f16": "fp16", "bf16": "bf16"}[p.dtype]
    return (
        f"// hgemm-agent export: run {store.run_id}, candidate {cand.id}, family {cand.family}\n"
        f"// C[M,N] = A[M,K] @ B{' + bias[N]' if p.bias else ''}, M={p.m} N={p.n} K={p.k}, B layout {p.b_layout} "
        f"({'K x N' if p.b_layout == 'kn' else 'N x K'} row-major), {dtype} in, fp32 accumulate, {dtype} out\n"
        f"// params: {json.dumps(cand.params, sort_keys=True)}\n"
        f"// launch: hgemm<<<dim3{spec.grid}, dim3{spec.block}, {spec.smem_bytes}>>>(A, B, C, M, N, K"
        f"{', bias' if p.bias else ''}); raise cudaFuncAttributeMaxDynamicSharedMemorySize to {spec.smem_bytes} "
        "first\n"
        + "".join(f"// then, by value, a CUtensorMap over {t.operand}: 16-bit elements (encode as fp16), dims "
                  f"{t.dims} and box {t.box} innermost first, "
                  f"{f'byte strides {t.strides} after the first, ' if t.strides else ''}{t.swizzle}-byte "
                  "swizzle, zero fill\n" for t in spec.tensor_maps)
        + (f"// then a scratch buffer of at least {spec.workspace_bytes} bytes and a zeroed array of at least "
           f"{spec.counters} unsigned ints, reused from call to call (the kernel leaves the counters zeroed; one "
           "launch at a time)\n" if spec.workspace_bytes or spec.counters else "")
        + f"// measured: {result.time_us:.2f} us vs cuBLAS {result.ranked[1].median_us:.2f} us "
        f"(median ratio {ratio:.3f}x), {result.device.get('name', '?')}\n"
        f"// compile: nvrtc / nvcc -arch={store.get_meta('arch', 'sm_90a')} (no headers needed)\n\n"
    )


def recheck(out: Path, timeout_s: float = 600) -> tuple[str, str]:
    """Load the exported module in a fresh process (the agent never touches the GPU) and run its self-check (which
    builds the compiled op first where it can).

    Returns ("ok" | "failed" | "no-gpu", what it printed)."""
    try:
        proc = subprocess.run([sys.executable, "hgemm_ops.py"], cwd=out, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "failed", f"self-check timed out after {timeout_s:.0f} s"
    text = (proc.stdout + proc.stderr).strip()
    return {0: "ok", 3: "no-gpu"}.get(proc.returncode, "failed"), text
