"""The export's kernels as CuPy loads them on the Python launch path: its GEMM kernels (`kernel`), and its helper
kernels, the gated fallback's (hgemm_gated.cu: act(gate) * up of an unfused gated GEMM's output, read once) and the
RMSNorm's (hgemm_norm.cu: an RMSNorm, plus a residual, in one kernel), their cubins listed in the manifest's "gated"
and "norm" sections by key ('silu_mul:f16', 'rms_norm:bf16'). Shipped
beside hgemm_ops.py, which makes one `Helpers` for its export. The helper kernels run only on `usable` operands
(plain contiguous CUDA tensors of one dtype, no gradient wanted, not under torch.compile), as the Python launch
path's GEMM kernels do.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

THREADS = 256  # both kernels' block


def usable(*tensors: torch.Tensor) -> bool:
    """Plain contiguous, 16-byte aligned CUDA tensors of one device and dtype, no gradient wanted of them, not under
    torch.compile's tracing: what the exported kernels read (TMA and 16-byte loads)."""
    device = tensors[0].device
    return (device.type == "cuda" and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            and all(type(t) in (torch.Tensor, nn.Parameter) and t.device == device and t.dtype == tensors[0].dtype
                    and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors))


class Helpers:
    def __init__(self, manifest: dict, folder: Path, arch_of, dtype_names: dict):
        self.entries = {**manifest.get("gated", {}), **manifest.get("norm", {})}  # key -> cubin, arch
        self.folder, self.arch_of, self.dtype_names = folder, arch_of, dtype_names
        self.loaded: dict[str, object] = {}

    def function(self, name: str, x: torch.Tensor):
        """The kernel `name`:x's dtype, or None where the export has none that runs on x's GPU."""
        entry = self.entries.get(f"{name}:{self.dtype_names.get(x.dtype)}")
        if entry is None or not (self.folder / entry["cubin"]).is_file() or entry["arch"] != self.arch_of(x.device):
            return None
        if entry["cubin"] not in self.loaded:
            import cupy

            self.loaded[entry["cubin"]] = cupy.RawModule(path=str(self.folder / entry["cubin"])).get_function("hgemm")
        return self.loaded[entry["cubin"]]

    def kernel(self, entry: dict):
        """An exported GEMM kernel (its manifest entry) as a CuPy function: its cubin where built for this GPU,
        else its source compiled for it by NVRTC; loaded once."""
        if entry["file"] not in self.loaded:
            import cupy

            cubin = self.folder / entry["cubin"]
            if entry["arch"] == self.arch_of() and cubin.is_file():
                module = cupy.RawModule(path=str(cubin))
            else:  # another GPU: compile the source for it
                module = cupy.RawModule(code=(self.folder / entry["file"]).read_text(), options=("-std=c++17",),
                                        backend="nvrtc")
            fn = module.get_function("hgemm")
            fn.max_dynamic_shared_size_bytes = entry["smem_bytes"]
            self.loaded[entry["file"]] = fn
        return self.loaded[entry["file"]]

    @staticmethod
    def launch(fn, grid: int, x: torch.Tensor, *args) -> None:
        """fn on `grid` blocks on PyTorch's current stream of x's device (so that CUDA graphs capture it)."""
        import cupy

        stream = torch.cuda.current_stream(x.device).cuda_stream
        with cupy.cuda.Device(x.device.index), cupy.cuda.ExternalStream(stream):
            fn((grid,), (THREADS,), args)

    def gated(self, y: torch.Tensor, epi: str) -> torch.Tensor | None:
        """act(gate) * up of y (rows x 2n, gate and up interleaved in blocks of 8 columns), or None where no kernel
        serves it (or y is not `usable`)."""
        fn = self.function(epi, y) if usable(y) and y.dim() >= 1 and y.shape[-1] % 16 == 0 else None
        if fn is None:
            return None
        import numpy

        out = torch.empty((*y.shape[:-1], y.shape[-1] // 2), dtype=y.dtype, device=y.device)
        blocks = y.numel() // 16  # 8 gate and 8 up columns each
        if blocks:
            self.launch(fn, min(-(-blocks // THREADS), 1 << 20), y, numpy.uint64(y.data_ptr()),
                        numpy.uint64(out.data_ptr()), numpy.int64(blocks))
        return out

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, kind: int = 0,
                 residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """The RMSNorm of x (rows x h) with weight w, rounded as `kind` says (hgemm_recognise.RMS_NORMS: Llama's,
        Gemma's, Olmo 2's), plus `residual` (x's shape) where given, a block a row, or None where no kernel serves
        it (or the operands are not `usable`)."""
        if not (usable(x, w) if residual is None else usable(x, w, residual)):
            return None
        h = x.shape[-1] if x.dim() else 0
        fits = kind in (0, 1, 2) and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                    and residual.is_contiguous() and residual.device == x.device))
        fn = self.function("rms_norm", x) if (w.dim() == 1 and h and w.shape[0] == h and h % 8 == 0 and fits
                                              and x.numel() // h < 2**31) else None
        if fn is None:
            return None
        import numpy

        out = torch.empty_like(x)
        if x.numel():
            self.launch(fn, x.numel() // h, x, numpy.uint64(x.data_ptr()), numpy.uint64(w.data_ptr()),
                        numpy.uint64(0 if residual is None else residual.data_ptr()), numpy.uint64(out.data_ptr()),
                        numpy.int32(h), numpy.float32(eps), numpy.int32(kind))
        return out
