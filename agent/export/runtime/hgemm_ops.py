"""Exported HGEMM op: runs the kernels an hgemm-agent run found, on torch tensors; cuBLAS for everything else.

This file is copied as `hgemm_ops.py` next to `manifest.json` (kernels keyed by problem, `M_N_K:layout:dtype[:bias]`
or `LO-HI_N_K:...` for a bucket of M, each with the M intervals it serves and its launch at every M of them), the
kernels' `.cu` / `.cubin` files, the compiled op's sources (`hgemm_op.cpp`, `hgemm_library.cpp`,
`hgemm_table.cpp`, `hgemm_module.cpp`, their headers) with its build helper `hgemm_build.py`, `hgemm_intervals.py`
(which kernel serves an M, and its launch there), `hgemm_driver.py` (tensor maps and launches by ctypes) and the
helper kernels (`hgemm_helpers.py` runs them on the Python path): the gated fallback's (`hgemm_gated.cu`, its cubins
per dtype and epilogue) and the RMSNorm's (`hgemm_norm.cu`, its cubins per dtype).

- `mm(a, b, bias=None)` is `torch.matmul(a, b)` (a (*, K), b K x N), with a bias `torch.addmm(bias, a, b)` (the
  bias fused); `linear(x, w, bias=None)` is `F.linear` (w N x K); `fused_linear(x, w, bias, epilogue,
  residual=None)` is F.linear followed by a fused epilogue (hgemm_epilogue.py), in one kernel where one was
  exported for it; `rms_norm(x, weight, eps, kind=0, residual=None)` an RMSNorm (hgemm_recognise.RMS_NORMS) plus
  a residual in one kernel (hgemm_norm.cu).
- `patch(model, matmul=False, fuse=True)` fuses the model's decoder layers (hgemm_fuse.py: q/k/v as one GEMM,
  gate/up as one gated GEMM, o_proj and down_proj with the residual add), then routes each other `nn.Linear` whose
  (N, K, dtype, bias) was tuned through `linear`, and each transformers `Conv1D` (GPT-2's projections: x @ W + b
  with W K x N) through `mm`; with matmul=True also `F.linear` / `torch.matmul` / `@` / `mm` / `addmm` on tuned
  shapes; it returns what it did, by kind; `explain_model(model)` lists the fused layers; `unpatch(model)` undoes
  it all (hgemm_patch.py).
- Each call runs the exported kernel where its N, K, layout, dtype and bias were tuned for an M interval holding its
  M (and beat cuBLAS there), the operands are contiguous, 16-byte aligned tensors of one CUDA device and no gradient
  is wanted; anything else is `torch.matmul` / `F.linear`, with the same result it would have had.
  `explain(a, b, bias, layout)` names the kernel and the interval, or why not. An export tuned on another GPU model
  than this process's (the manifest's `device`) warns once, at the first call: `tuned_elsewhere()`.
- Launches go through the compiled op (`hgemm::mm` / `hgemm::linear` / `hgemm::fused_linear`, C++, built on first use
  and cached under `build/`; `compiled()` builds it) where it builds, else through the Python launch path (about 20 µs
  more host time a call), with a one-line warning. `HGEMM_OPS_COMPILED=0` chooses the Python path;
  `HGEMM_OPS_BUILD_DIR` moves the build. Under `torch.compile` the calls trace as the ops `torch.ops.hgemm.mm` /
  `.linear`. On sm_90 and newer the compiled op launches a kernel whose manifest entry says `overlap` overlapped with
  the kernel ahead of it (it waits for that one itself); `HGEMM_OPS_OVERLAP=0` launches every kernel plainly,
  `overlap(False)` from then on.
- Kernels with a `workspace_bytes` share one scratch buffer and one counter array per GPU: do not run two of them at
  the same time on different streams. `python hgemm_ops.py` runs `selfcheck()` (hgemm_selfcheck.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
MANIFEST = json.loads((HERE / "manifest.json").read_text())
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _sibling(name: str) -> types.ModuleType:
    """A module shipped beside this one, registered under a name of its own for this export (torch.compile looks
    the modules of the functions it traces up by name)."""
    spec = importlib.util.spec_from_file_location(f"{__name__}__{name}", HERE / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


driver = _sibling("hgemm_driver")
intervals = _sibling("hgemm_intervals")
epilogue = _sibling("hgemm_epilogue")
EPILOGUE_CODES = {name: i for i, name in enumerate(epilogue.EPILOGUES)}  # as the compiled op numbers them


def parse_key(key: str) -> tuple[int, int, int, str, str, bool, str]:
    """'M_N_K:layout:dtype[:bias][:epilogue]' -> (m, n, k, layout, dtype, bias, epilogue); a range 'LO-HI_N_K:...'
    gives m = LO."""
    mnk, layout, dtype, *rest = key.split(":")
    m, n, k = mnk.split("_")
    epi = next((r for r in rest if r != "bias"), "none")
    return intervals.key_m(key)[0], int(n), int(k), layout, dtype, "bias" in rest, epi


INDEX = intervals.Index(MANIFEST)  # the kernels by series (the key after M) and M interval


def problem_key(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, layout: str,
                epi: str = "none") -> str | None:
    """The manifest key of a @ B (+ bias) (then the epilogue), B given K x N ("kn") or N x K ("nk"); None where it is
    no GEMM of ours."""
    if b.dim() != 2 or a.dim() < 1 or a.dtype not in DTYPE_NAMES:
        return None
    k = a.shape[-1]
    n = b.shape[1] if layout == "kn" else b.shape[0]
    if k == 0 or (b.shape[0] if layout == "kn" else b.shape[1]) != k:
        return None
    return (f"{a.numel() // k}_{n}_{k}:{layout}:{DTYPE_NAMES[a.dtype]}" + (":bias" if bias is not None else "")
            + (f":{epi}" if epi != "none" else ""))


# ---- the compiled op ------------------------------------------------------------------------------------------------
_ext_state: dict = {}  # "module": the loaded extension or None, once tried


def compiled():
    """The compiled op's Python module with this export's kernels registered (built on the first call), or None
    where it cannot be built or loaded here (one warning says why)."""
    if "module" in _ext_state:
        return _ext_state["module"]
    ext = None
    if os.environ.get("HGEMM_OPS_COMPILED", "1") != "0":
        build_root = Path(os.environ.get("HGEMM_OPS_BUILD_DIR", HERE / "build"))
        try:
            ext = _sibling("hgemm_build").load(HERE, build_root)
            for key, entry in MANIFEST["kernels"].items():
                ext.add_kernel(_prepared(key, entry))
            for key, entry in _helpers.entries.items():
                if (HERE / entry["cubin"]).is_file():  # a copied export without it: PyTorch's ops serve
                    ext.add_helper({"key": key, "arch": entry["arch"], "cubin": (HERE / entry["cubin"]).read_bytes(),
                                    "overlap": entry.get("overlap", False)})
        except Exception as e:  # no compiler, no ninja, a failed build or load: the Python path still works
            text = str(e).strip().splitlines() or [type(e).__name__]
            reason = next((ln for ln in text if "error" in ln.lower()), text[-1])[:200]
            log = build_root / "error.log"
            try:
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(f"{type(e).__name__}: {e}\n")
            except OSError:
                log = None
            warnings.warn(f"hgemm_ops: the compiled op is unavailable ({reason}{f'; see {log}' if log else ''}); "
                          "the Python launch path serves calls (about 20 us more host time each)", RuntimeWarning,
                          stacklevel=2)
            ext = None
    _ext_state["module"] = ext
    return ext


def _prepared(key: str, entry: dict) -> dict:
    """A manifest entry as the compiled op's add_kernel takes it: problem fields, the M intervals it serves, cubin
    bytes, its launch segments, and each tensor map as cuTensorMapEncodeTiled's arguments (checked at each segment's
    first M and derived here, by the driver module's rules)."""
    _, n, k, layout, dtype, bias, epi = parse_key(key)
    segments = intervals.segments(key, entry)
    maps = []
    for i, t in enumerate(entry.get("tensor_maps", [])):
        strides = tuple(t.get("strides") or ())
        for seg in segments:
            dims = tuple(seg["m"] if d in t.get("m_dims", ()) else v for d, v in enumerate(t["dims"]))
            driver.check_tiled(16, dims, tuple(seg["boxes"][i]), t["swizzle"], strides)
        dims = tuple(t["dims"])
        maps.append({"operand": driver.OPERANDS.index(t["operand"]), "dims": dims, "m_dims": t.get("m_dims", []),
                     "strides": strides or driver.packed_strides(dims), "swizzle": driver.SWIZZLE[t["swizzle"]],
                     "l2": driver.l2_promotion(dims, strides)})
    return {"key": key, "n": n, "k": k, "nk": layout == "nk", "bf16": dtype == "bf16", "bias": bias,
            "epilogue": EPILOGUE_CODES[epi], "serves": intervals.serves(key, entry), "arch": entry["arch"],
            "cubin": (HERE / entry["cubin"]).read_bytes(), "segments": segments, "block": entry["block"],
            "smem_bytes": entry["smem_bytes"], "workspace_bytes": entry.get("workspace_bytes", 0),
            "counters": entry.get("counters", 0), "tensor_maps": maps, "overlap": entry.get("overlap", False),
            **({"norm_cubin": (HERE / entry["norm_cubin"]).read_bytes()} if entry.get("norm_cubin") else {})}


# ---- the Python launch path (where the compiled op is unavailable) ------------------------------------------------
def _arch(device=None) -> str:
    """The arch an exported cubin must have been built for to run on this GPU."""
    major, minor = torch.cuda.get_device_capability(device)
    return "sm_90a" if major == 9 else f"sm_{major}{minor}"


helpers = _sibling("hgemm_helpers")
_helpers = helpers.Helpers(MANIFEST, HERE, _arch, DTYPE_NAMES)  # CuPy's modules, the helper kernels
_usable = helpers.usable


def fallback(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, layout: str, epi: str = "none",
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """What the call means, computed by PyTorch (cuBLAS): F.linear, torch.matmul, or with a K x N B and a bias the
    fused addmm (F.linear of B's transpose: torch.addmm(bias, a, b) for a 2-D a); then the epilogue's ops as a model
    runs them (an unserved gated call on a GPU: the export's one gated kernel where it has one)."""
    a2 = a if a.dim() == 2 else a.reshape(-1, a.shape[-1])  # one matrix of rows (hgemm_op.cpp's fallback says why)
    if layout == "nk":
        y = F.linear(a2, b, bias)
    else:
        y = torch.mm(a2, b) if bias is None else F.linear(a2, b.t(), bias)
    if a.dim() != 2:
        y = y.view(*a.shape[:-1], y.shape[-1])
    if epi == "none":
        return y
    fused = epilogue.Epilogue(epi)
    out = _helpers.gated(y, epi) if fused.gated else None  # None under torch.compile's tracing too (usable)
    return out if out is not None else epilogue.compose(y, fused, residual)


def python_run(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, layout: str, epi: str = "none",
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """The Python launch path: the kernel through hgemm_driver (ctypes), or cuBLAS (and under torch.compile, which
    traces what the call means)."""
    if torch.compiler.is_compiling():
        return fallback(a, b, bias, layout, epi, residual)
    call = problem_key(a, b, bias, layout, epi)
    key = INDEX.find_key(call)
    entry = MANIFEST["kernels"][key] if key else None
    operands = [t for t in (a, b, bias, residual) if t is not None]
    n = b.shape[0] if layout == "nk" else b.shape[-1]
    out_shape = (*a.shape[:-1], n // 2 if epilogue.Epilogue(epi).gated else n)
    if (entry is None or (bias is not None and bias.shape != (n,)) or not _usable(*operands)
            or (residual is not None and residual.shape != out_shape)):
        return fallback(a, b, bias, layout, epi, residual)
    m, n, k = parse_key(call)[:3]
    grid, maps = INDEX.launch_at(key, entry, m)
    c = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    driver.launch(_helpers.kernel(entry).kernel.ptr, grid, tuple(entry["block"]), entry["smem_bytes"],
                  torch.cuda.current_stream(a.device).cuda_stream, (a.data_ptr(), b.data_ptr(), c.data_ptr()),
                  (m, n, k), maps, entry.get("workspace_bytes", 0), entry.get("counters", 0),
                  None if bias is None else bias.data_ptr(), None if residual is None else residual.data_ptr())
    return c


class PythonPath:
    """The Python launch path behind the compiled op's calls."""

    @staticmethod
    def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return python_run(a, b, bias, "kn")

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return python_run(x, w, bias, "nk")

    @staticmethod
    def fused_linear(x, w, bias, code: int, residual) -> torch.Tensor:
        return python_run(x, w, bias, "nk", epilogue.EPILOGUES[code], residual)

    @staticmethod
    def norm_linear(x, norm_w, eps, kind, w, bias, code, residual) -> torch.Tensor:
        """The norm (the export's kernel, or the model's ops), then fused_linear: no norm variants on this path."""
        return PythonPath.fused_linear(rms_norm(x, norm_w, eps, kind), w, bias, code, residual)

    rms_norm = _helpers.rms_norm  # the export's norm kernel through CuPy, or None where it does not serve


class _Unresolved:
    """Before the first call: pick the compiled op or the Python path, then step aside."""

    @staticmethod
    def mm(a, b, bias=None):
        return fallback(a, b, bias, "kn") if torch.compiler.is_compiling() else _resolve().mm(a, b, bias)

    @staticmethod
    def linear(x, w, bias=None):
        return F.linear(x, w, bias) if torch.compiler.is_compiling() else _resolve().linear(x, w, bias)

    @staticmethod
    def fused_linear(x, w, bias, code, residual):
        if torch.compiler.is_compiling():
            return fallback(x, w, bias, "nk", epilogue.EPILOGUES[code], residual)
        return _resolve().fused_linear(x, w, bias, code, residual)

    @staticmethod
    def norm_linear(x, norm_w, eps, kind, w, bias, code, residual):
        if torch.compiler.is_compiling():
            return fallback(rms_norm(x, norm_w, eps, kind), w, bias, "nk", epilogue.EPILOGUES[code], residual)
        return _resolve().norm_linear(x, norm_w, eps, kind, w, bias, code, residual)

    @staticmethod
    def rms_norm(x, w, eps, kind=0, residual=None):
        return _resolve().rms_norm(x, w, eps, kind, residual)


_eager = _Unresolved  # the compiled op's module, or PythonPath, once resolved


def tuned_elsewhere(device=None) -> str | None:
    """The GPU model the kernels were timed on against cuBLAS, where this one is another (None: the same, or no GPU)."""
    tuned = MANIFEST.get("device") if torch.cuda.is_available() else None
    return tuned if tuned and tuned != torch.cuda.get_device_name(device) else None


def _resolve():
    global _eager
    if (tuned := tuned_elsewhere()) is not None:
        warnings.warn(f"hgemm_ops: this export was tuned on {tuned}, this GPU is {torch.cuda.get_device_name()}: "
                      "its kernels beat cuBLAS there and may not here; search on this GPU and export again",
                      RuntimeWarning, stacklevel=3)
    ext = compiled()
    _eager = ext if ext is not None else PythonPath
    return _eager


def path() -> str:
    """Which launch path calls take: 'compiled' or 'python' (resolving it if no call has yet)."""
    return "python" if (_resolve() if _eager is _Unresolved else _eager) is PythonPath else "compiled"


def overlap(enabled: bool | None = None) -> bool:
    """Whether the compiled op launches its kernels overlapped with the kernel ahead (sm_90 and newer, kernels that
    wait for it); with `enabled`, sets it for the launches that follow (a captured CUDA graph keeps its own) and
    returns what it was. Always False on the Python launch path, which launches plainly."""
    ext = compiled()
    if ext is None:
        return False
    return ext.overlap() if enabled is None else ext.overlap(bool(enabled))


def mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch.matmul(a, b) with b of shape K x N (row-major); with a bias, torch.addmm(bias, a, b)."""
    return _eager.mm(a, b, bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias): x @ w.T (+ bias) with w of shape N x K (an nn.Linear weight)."""
    return _eager.linear(x, w, bias)


def fused_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) followed by `epilogue` (hgemm_epilogue.EPILOGUES), in one kernel where one was exported
    for the call: an activation; silu_mul / gelu_mul with w's gate and up rows interleaved in blocks of 8
    (hgemm_epilogue.interleave_gate_up), N / 2 columns out; residual: + `residual` (x's rows by N)."""
    return _eager.fused_linear(x, w, bias, EPILOGUE_CODES[epilogue], residual)


def norm_linear(x: torch.Tensor, norm_w: torch.Tensor, eps: float, kind: int, w: torch.Tensor,
                bias: torch.Tensor | None, epilogue: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    """fused_linear(rms_norm(x, norm_w, eps, kind), w, bias, epilogue, residual): in one kernel where the call's
    kernel was exported with a norm variant (the gemv family's: it normalises x's rows as it reads them), otherwise
    the norm's kernel and then fused_linear's."""
    if not 0 <= kind < 3:
        raise ValueError(f"norm_linear: the norm's kind is 0, 1 or 2, not {kind}")
    return _eager.norm_linear(x, norm_w, eps, kind, w, bias, EPILOGUE_CODES[epilogue], residual)


# ---- patching a model (hgemm_patch.py, hgemm_fuse.py) ---------------------------------------------------------------
_patching = _sibling("hgemm_patch")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: int = 0,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """An RMSNorm, x in fp32 times rsqrt(mean(x^2) + eps), with the weight as `kind` says (hgemm_recognise.RMS_NORMS:
    0 Llama's, rounded to x's dtype, times weight; 1 Gemma's, times 1 + weight in fp32, rounded once; 2 Olmo 2's,
    times weight in fp32, rounded once), then `residual` + that where given, in one kernel (hgemm_norm.cu) where the
    export has one for x's dtype and GPU and the tensors are plain contiguous ones of that dtype; otherwise, and
    under torch.compile, PyTorch's ops as the model runs them."""
    if _usable(x, weight) if residual is None else _usable(x, weight, residual):  # plain CUDA tensors of one dtype,
        out = _eager.rms_norm(x, weight, eps, kind, residual)  # no gradient wanted, not under torch.compile
        if out is not None:
            return out
    out = _patching.fuse.recognise.RMS_NORMS[kind](x, weight, eps)
    return out if residual is None else residual + out


def patch(model: nn.Module, matmul: bool = False, fuse: bool = True, norms: bool = True) -> dict[str, int]:
    """Fuse `model`'s decoder layers (fuse=True: hgemm_fuse) and its Llama-style RMSNorms (fuse and norms: each one
    kernel, `rms_norm`), route its other tuned nn.Linear and Conv1D layers through the exported op (and with
    matmul=True its tuned F.linear / matmul calls); returns how many of each kind (hgemm_patch.patch).
    `unpatch(model)` restores the model exactly."""
    return _patching.patch(sys.modules[__name__], model, matmul, fuse, norms)


def unpatch(model: nn.Module) -> int:
    """Undo patch(model) (and any patch of its submodules); returns how many modules were restored."""
    return _patching.unpatch(model)


def explain_model(model: nn.Module) -> list[str]:
    """What patch(model) fused, a line per decoder layer."""
    return _patching.fuse.describe(model)


def explain(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, layout: str = "kn",
            epilogue: str = "none", residual: torch.Tensor | None = None) -> str:
    """Which kernel the compiled op runs for these operands (and epilogue) and the M interval it serves, or why it
    calls cuBLAS instead (naming the bucket of M cuBLAS serves, where the run found no kernel for it)."""
    ext = compiled()
    call = problem_key(a, b, bias, layout, epilogue)
    listed = INDEX.describe(parse_key(call)[0], intervals.series_of(call)) if call else ""
    if ext is None:
        return f"the compiled op is unavailable; the manifest says: {listed or 'not a GEMM of this export'}"
    why = ext.explain(a, b, bias, layout == "nk", EPILOGUE_CODES[epilogue], residual)
    return listed if why.startswith("M=") and "cuBLAS serves" in listed else why


def checked() -> types.SimpleNamespace:
    """What hgemm_selfcheck.py checks: this module's manifest, paths and references."""
    return types.SimpleNamespace(MANIFEST=MANIFEST, DTYPES=DTYPES, parse_key=parse_key, problem_key=problem_key,
                                 compiled=compiled, PythonPath=PythonPath, mm=mm, linear=linear, fallback=fallback,
                                 fused_linear=fused_linear, EPILOGUE_CODES=EPILOGUE_CODES, epilogue=epilogue,
                                 INDEX=INDEX, intervals=intervals,
                                 rms_norms=_patching.fuse.recognise.RMS_NORMS)


def selfcheck(factor: float = 2.0) -> list[str]:
    """hgemm_selfcheck.py: every exported kernel through each launch path against an fp64 reference and cuBLAS,
    then the compiled op in a CUDA graph, on a side stream and under torch.compile, and the helper kernels (the gated
    fallback's, the RMSNorm's) through each path."""
    return _sibling("hgemm_selfcheck").selfcheck(checked(), factor)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device: the exported kernels were not re-checked")
        raise SystemExit(3)
    print("\n".join(selfcheck()))
