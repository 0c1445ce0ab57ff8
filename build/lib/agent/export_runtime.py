"""Exported HGEMM op: runs the kernels an hgemm-agent run found, on torch tensors; cuBLAS for everything else.

This file is copied as `hgemm_ops.py` next to `manifest.json`, the kernels' `.cu` / `.cubin` files and
`hgemm_driver.py` (tensor maps and launches through the CUDA driver); it needs only torch and cupy.
`mm(a, b)` is `torch.matmul(a, b)` (b K x N), `linear(x, w)` is `F.linear(x, w)` without bias (w N x K).
A shape the run did not tune, or tuned without beating cuBLAS, calls cuBLAS. `selfcheck()` compares every
exported kernel against an fp64 reference and cuBLAS on fresh random inputs. Kernels whose manifest entry has a
`workspace_bytes` share one scratch buffer and one array of counters per GPU (allocated on first use): do not run two
of them at the same time on different streams, and call each once before capturing it in a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MANIFEST = json.loads((HERE / "manifest.json").read_text())
_loaded: dict[str, object] = {}
_spec = importlib.util.spec_from_file_location("hgemm_driver", HERE / "hgemm_driver.py")
driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver)


def _kernel(entry: dict):
    import cupy

    key = entry["file"]
    if key not in _loaded:
        major, minor = torch.cuda.get_device_capability()
        arch = "sm_90a" if major == 9 else f"sm_{major}{minor}"
        cubin = HERE / entry["cubin"]
        if entry["arch"] == arch and cubin.is_file():
            module = cupy.RawModule(path=str(cubin))
        else:  # another GPU: compile the source for it
            code = (HERE / entry["file"]).read_text()
            module = cupy.RawModule(code=code, options=("-std=c++17",), backend="nvrtc")
        fn = module.get_function("hgemm")
        fn.max_dynamic_shared_size_bytes = entry["smem_bytes"]
        _loaded[key] = fn
    return _loaded[key]


def _find(m: int, n: int, k: int, layout: str) -> dict | None:
    return MANIFEST["kernels"].get(f"{m}_{n}_{k}:{layout}")


def _run(a: torch.Tensor, b: torch.Tensor, layout: str) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1] if layout == "kn" else b.shape[0]
    entry = _find(m, n, k, layout)
    usable = (entry is not None and a.is_cuda and a.dtype == b.dtype == torch.float16
              and a.is_contiguous() and b.is_contiguous()
              and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0)  # TMA and 16-byte loads need it
    if not usable:
        return torch.matmul(a, b if layout == "kn" else b.t())
    c = torch.empty(m, n, dtype=torch.float16, device=a.device)
    driver.launch(_kernel(entry).kernel.ptr, tuple(entry["grid"]), tuple(entry["block"]), entry["smem_bytes"],
                  torch.cuda.current_stream().cuda_stream, (a.data_ptr(), b.data_ptr(), c.data_ptr()), (m, n, k),
                  [(t["operand"], t["dims"], t["box"], t["swizzle"], t.get("strides", ()))
                   for t in entry.get("tensor_maps", [])],
                  entry.get("workspace_bytes", 0), entry.get("counters", 0))
    return c


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with b of shape K x N (row-major)."""
    return _run(a, b, "kn")


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with w of shape N x K (an nn.Linear weight), no bias."""
    return _run(x, w, "nk")


def selfcheck(factor: float = 2.0) -> list[str]:
    """Check every exported kernel on fresh random inputs; raises AssertionError on the first failure."""
    lines = []
    for key in MANIFEST["kernels"]:
        m, n, k = (int(x) for x in key.split(":")[0].split("_"))
        layout = key.split(":")[1]
        a = torch.randn(m, k, device="cuda").half()
        b = torch.randn(k, n, device="cuda").half() if layout == "kn" else torch.randn(n, k, device="cuda").half()
        b_kn = b if layout == "kn" else b.t()
        out = _run(a, b, layout)
        torch.cuda.synchronize()
        ref = a.double() @ b_kn.double()
        err = float(torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref))
        cub = float(torch.linalg.norm((a @ b_kn).double() - ref) / torch.linalg.norm(ref))
        ok = bool(torch.isfinite(out).all()) and err <= factor * cub + 1e-6
        lines.append(f"{key}: {'ok' if ok else 'FAILED'} rel err {err:.2e} (cuBLAS {cub:.2e})")
        assert ok, lines[-1]
    lines.extend(f"{key}: cuBLAS (no kernel beat it)" for key in MANIFEST.get("cublas", []))
    return lines


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device: the exported kernels were not re-checked")
        raise SystemExit(3)
    print("\n".join(selfcheck()))
