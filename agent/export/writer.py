"""Write a run's winners into an export folder: per problem a self-contained .cu (+ cubin) with its launch
configuration in its header, `manifest.json` (kernels keyed by problem key, with the launch data the op needs at
every M they serve and the M intervals they serve, geometry.py), and
the runtime files (runtime/: the Python module `hgemm_ops.py`, the compiled op's C++ source and build helper, the
self-check; sandbox/driver.py as `hgemm_driver.py`) that run them on torch tensors and call cuBLAS where no kernel
beat it; the gated fallback's kernel (runtime/hgemm_gated.cu) compiled per dtype and gated epilogue for the run's
arch, which an unserved gated call runs after cuBLAS's GEMM (`gated_fallbacks`), and the RMSNorm kernel
(runtime/hgemm_norm.cu) per dtype, which a patched model's Llama- and Gemma-style RMSNorms run (`norm_kernels`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from agent import buckets
from agent.export.geometry import GeometryError, launch_table, resolve
from agent.store import RunStore, Winner
from core.device import ARCH_LIMITS, DeviceFacts
from core.epilogue import GATED, element_code
from core.overlap import OVERLAP_CUDA, waits
from core.records import Problem
from sandbox.build import BASE_OPTIONS, compile_cuda
from templates import get_family

RUNTIME = Path(__file__).with_name("runtime")  # every file in it is copied as it is
DRIVER = Path(__file__).parents[2] / "sandbox" / "driver.py"  # tensor maps and launches; copied as hgemm_driver.py
EPILOGUE = Path(__file__).parents[2] / "core" / "epilogue.py"  # the epilogues' math; copied as hgemm_epilogue.py
# the least share of the winner's resident threads a norm variant may keep (docs/decisions.md `norm-variant`)
NORM_OCCUPANCY = 0.75


@dataclass(frozen=True)
class ExportLine:
    problem: Problem
    kernel_file: str | None  # None: the op calls cuBLAS for this shape
    note: str


def export_run(store: RunStore, out: Path, norm_variants: bool = True) -> list[ExportLine]:
    """Per problem of the run, its winner (where it beat cuBLAS; for a bucket of M, the leader that was at least as
    fast as cuBLAS at its probe M, over the stretches where it was) with its family's launch rule for the run's GPU
    at every M it serves (with `norm_variants`, a winner whose family has a norm prologue also built with it);
    the gated fallback's kernels and the RMSNorm kernel."""
    out.mkdir(parents=True, exist_ok=True)
    device = DeviceFacts.from_dict(store.get_meta("device"))
    arch = store.get_meta("arch", "sm_90a")
    manifest: dict = {"run": store.run_id, "device": device.name, "arch": arch, "kernels": {}, "cublas": [],
                      "notes": {}}
    manifest["gated"] = gated_fallbacks(out, arch, manifest["notes"])
    manifest["norm"] = norm_kernels(out, arch, manifest["notes"])
    lines, claims = [], {}
    for p in store.problems():
        pick, why = _pick(store, p)
        claims.setdefault(buckets.series(p), []).extend(_claims(p, pick))
        try:
            launch = launch_table(get_family(pick.candidate.family), pick.candidate.params, p, device) if pick \
                else None
        except GeometryError as e:
            pick, why = None, f"its launch cannot be rebuilt at every M of the range ({e})"
        if pick is None:
            manifest["cublas"].append(p.key)
            manifest["notes"][p.key] = why
            lines.append(ExportLine(p, None, f"cuBLAS ({why})"))
            continue
        cand, result, ratio = pick.candidate, pick.result, pick.speedup
        build = store.build(cand.id)
        launch["overlap"] = launch["overlap"] and waits(build.source)  # a kernel built before the wait: plain
        stem = "hgemm_" + p.key.replace(":", "_")
        pieces = list(pick.pieces) if isinstance(pick, buckets.Served) else [p.m_span]
        (out / f"{stem}.cu").write_text(_header(store, p, cand, result, launch, ratio, pieces) + build.source)
        (out / f"{stem}.cubin").write_bytes(build.cubin)
        manifest["kernels"][p.key] = {
            "file": f"{stem}.cu", "cubin": f"{stem}.cubin", "arch": build.arch, "candidate": cand.id, **launch,
            "time_us": result.time_us, "cublas_us": result.ranked[1].median_us, "speedup": ratio,
        }
        norm = get_family(cand.family).norm_options(cand.params, p) if norm_variants else None
        if norm is not None and cand.template_override is None:
            manifest["kernels"][p.key].update(_norm_variant(out, stem, build, norm, launch["block"][0],
                                                            manifest["notes"], p.key))
        manifest["notes"][p.key] = (f"vs cuBLAS {pick.note(p)}" if isinstance(pick, buckets.Served)
                                    else f"{ratio:.3f}x of cuBLAS ({cand.id})")
        lines.append(ExportLine(p, f"{stem}.cu", manifest["notes"][p.key]))
    for series_claims in claims.values():  # each kernel's share of its series' M
        for key, pieces in resolve(series_claims).items():
            if key in manifest["kernels"]:
                manifest["kernels"][key]["serves"] = [list(piece) for piece in pieces]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    copy_runtime(out)
    return lines


def _norm_variant(out: Path, stem: str, build, options: tuple[str, ...], threads: int, notes: dict,
                  key: str) -> dict:
    """The winner's own source compiled with its family's norm `options` (the norm ahead of the GEMM, as
    hgemm::norm_linear runs it) into `out` as <stem>_norm.cubin: {"norm_cubin": its name}, or {} with why in `notes`
    under "norm KEY" (it did not build, or by ptxas's register counts an SM would hold under NORM_OCCUPANCY of the
    winner's resident threads of `threads` a block)."""
    normed = compile_cuda(build.source, build.arch, options=(*BASE_OPTIONS, *options))
    if not normed.ok:
        notes[f"norm {key}"] = f"the norm variant did not build: {normed.error.strip()[:300]}"
        return {}
    limits = ARCH_LIMITS[build.arch]
    known = build.registers is not None and normed.registers is not None  # ptxas's counts, from the build logs
    plain, fused = (limits.resident_threads(b.registers or 0, threads, b.smem_static or 0) for b in (build, normed))
    if known and fused < NORM_OCCUPANCY * plain:
        notes[f"norm {key}"] = (f"no norm variant: {fused // 32} warps resident an SM against the kernel's "
                                f"{plain // 32} ({normed.registers} registers a thread against {build.registers})")
        return {}
    (out / f"{stem}_norm.cubin").write_bytes(normed.cubin)
    return {"norm_cubin": f"{stem}_norm.cubin"}


def _runtime_cubins(out: Path, arch: str, notes: dict | None, source: str, variants: dict[str, tuple[str, ...]],
                    kind: str, what: str) -> dict[str, dict]:
    """runtime/`source`, after core/epilogue.py's to_f32 for the variant's dtype (its key's last field),
    runtime/hgemm_dtype.cuh's text and core/overlap.py's device code, compiled for `arch` once per variant (key -> its
    -D options besides HGEMM_BF16, which the dtype sets), written into `out` as hgemm_<source's stem>_<key>.cubin: the
    manifest entries (key -> cubin, arch, and overlap: the kernel waits for the kernel ahead). One that NVRTC cannot
    build here is left out, and why goes into `notes` under "`kind` KEY" ("the `what` kernel did not build: ...")."""
    text = (RUNTIME / "hgemm_dtype.cuh").read_text() + OVERLAP_CUDA + (RUNTIME / source).read_text()
    stem, entries = Path(source).stem, {}
    for key, defines in variants.items():
        dtype = key.rsplit(":", 1)[1]
        build = compile_cuda(element_code(dtype) + text, arch,
                             options=(*BASE_OPTIONS, f"-DHGEMM_BF16={int(dtype == 'bf16')}", *defines))
        if build.ok:
            name = f"{stem}_{key.replace(':', '_')}.cubin"
            (out / name).write_bytes(build.cubin)
            entries[key] = {"cubin": name, "arch": arch, "overlap": True}  # it waits for the kernel ahead
        elif notes is not None:
            notes[f"{kind} {key}"] = f"the {what} kernel did not build: {build.error}"
    return entries


def gated_fallbacks(out: Path, arch: str, notes: dict | None = None) -> dict[str, dict]:
    """The gated fallback's cubins for `arch`, one per gated epilogue and dtype: the manifest's "gated" entries
    ('silu_mul:f16' -> cubin and arch). One that does not build is left out (that call then composes PyTorch's ops
    on views of the halves)."""
    return _runtime_cubins(out, arch, notes, "hgemm_gated.cu", {
        f"{epi}:{dtype}": (f"-DHGEMM_GELU={int(act != 'silu')}",)
        for epi, act in GATED.items() for dtype in ("f16", "bf16")}, "gated", "gated fallback's")


def norm_kernels(out: Path, arch: str, notes: dict | None = None) -> dict[str, dict]:
    """The RMSNorm kernel's cubins for `arch` (runtime/hgemm_norm.cu, which a patched model's Llama- and Gemma-style
    RMSNorms run), one per dtype: the manifest's "norm" entries ('rms_norm:f16' -> cubin and arch). One that does
    not build is left out (those norms then run as the model's own ops)."""
    return _runtime_cubins(out, arch, notes, "hgemm_norm.cu", {f"rms_norm:{dtype}": () for dtype in ("f16", "bf16")},
                           "norm", "RMSNorm")


def copy_runtime(out: Path) -> None:
    """The files an export runs with, beside its manifest: runtime/ as it is, the driver and the epilogues."""
    for f in RUNTIME.iterdir():
        if f.is_file() and f.suffix in (".py", ".cpp", ".h", ".cu", ".cuh"):
            shutil.copyfile(f, out / f.name)
    shutil.copyfile(DRIVER, out / "hgemm_driver.py")
    shutil.copyfile(EPILOGUE, out / "hgemm_epilogue.py")


def _claims(p: Problem, pick) -> list[tuple[str, tuple[int, int]]]:
    """The M intervals a problem claims in its series: its span, or a bucket's served stretches under its key and the
    rest of the bucket under a key no kernel has (cuBLAS serves it)."""
    if not isinstance(pick, buckets.Served):
        return [(p.key, p.m_span)]
    rest = [(p.key + "#cublas", piece) for piece in _gaps(p.m_span, list(pick.pieces))]
    return [(p.key, piece) for piece in pick.pieces] + rest


def _gaps(span: tuple[int, int], pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, at = [], span[0]
    for a, z in sorted(pieces):
        if a > at:
            out.append((at, a - 1))
        at = z + 1
    return out + ([(at, span[1])] if at <= span[1] else [])


def _pick(store: RunStore, p: Problem) -> tuple[Winner | buckets.Served | None, str]:
    """The kernel that serves the problem, or None and why cuBLAS does."""
    win = store.winner(p)
    if win is None:
        return None, "no candidate passed the checks"
    if p.m_range is None:
        return (win, "") if win.speedup > 1.0 else (None, f"best was {win.speedup:.3f}x of cuBLAS")
    if (served := buckets.served(store, p)) is not None:
        return served, ""
    timed = store.bucket_ends(p)
    return None, ("no leader was at least as fast as cuBLAS at two neighbouring probe M of the bucket" if timed
                  else "its leaders were not re-timed at the bucket's probe M")


def _header(store, p, cand, result, launch, ratio, pieces) -> str:
    dtype = {"f16": "fp16", "bf16": "bf16"}[p.dtype]
    lo, hi = p.m_span
    serves = f"every M from {lo} to {hi}" if pieces == [(lo, hi)] else \
        "M " + ", ".join(f"{a}-{z}" for a, z in pieces) + f" of the bucket {lo}-{hi} (cuBLAS the rest)"
    grid, block, smem = tuple(launch["grid"]), tuple(launch["block"]), launch["smem_bytes"]
    return (
        f"// hgemm-agent export: run {store.run_id}, candidate {cand.id}, family {cand.family}\n"
        f"// C[M,N] = A[M,K] @ B{' + bias[N]' if p.bias else ''}, M={p.m} N={p.n} K={p.k}, B layout {p.b_layout} "
        f"({'K x N' if p.b_layout == 'kn' else 'N x K'} row-major), {dtype} in, fp32 accumulate, {dtype} out\n"
        + (f"// serves {serves}: the launch below is M={p.m}'s; the grid and the tensor maps' "
           "dims and boxes at each M are in manifest.json (segments, m_dims)\n" if p.m_range else "")
        + f"// params: {json.dumps(cand.params, sort_keys=True)}\n"
        f"// launch: hgemm<<<dim3{grid}, dim3{block}, {smem}>>>(A, B, C, M, N, K"
        f"{', bias' if p.bias else ''}); raise cudaFuncAttributeMaxDynamicSharedMemorySize to {smem} first\n"
        + "".join(_map_line(t) for t in launch["tensor_maps"])
        + (f"// then a scratch buffer of at least {launch['workspace_bytes']} bytes and a zeroed array of at least "
           f"{launch['counters']} unsigned ints, reused from call to call (the kernel leaves the counters zeroed; one "
           "launch at a time)\n" if launch["workspace_bytes"] or launch["counters"] else "")
        + ("// it waits for the kernel ahead of it (griddepcontrol.wait) before touching memory: on sm_90 it may be "
           "launched with programmatic stream serialization (cudaLaunchKernelEx)\n" if launch.get("overlap") else "")
        + f"// measured: {result.time_us:.2f} us vs cuBLAS {result.ranked[1].median_us:.2f} us "
        f"(median ratio {ratio:.3f}x), {result.device.get('name', '?')}\n"
        f"// compile: nvrtc / nvcc -arch={store.get_meta('arch', 'sm_90a')} (no headers needed)\n\n"
    )


def _map_line(t: dict) -> str:
    strides = f"byte strides {tuple(t['strides'])} after the first, " if t["strides"] else ""
    return (f"// then, by value, a CUtensorMap over {t['operand']}: 16-bit elements (encode as fp16), dims "
            f"{tuple(t['dims'])} and box {tuple(t['box'])} innermost first, {strides}{t['swizzle']}-byte swizzle, "
            "zero fill\n")


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
