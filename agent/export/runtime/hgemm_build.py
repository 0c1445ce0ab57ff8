"""Build and load the compiled HGEMM op (hgemm_op.cpp, hgemm_route.cpp, hgemm_library.cpp, hgemm_table.cpp,
hgemm_module.cpp, their headers) with torch.utils.cpp_extension: ninja and the host C++ compiler, against the
installed torch; no CUDA toolkit (the op opens the CUDA driver at run time).

Shipped in an hgemm-agent export next to hgemm_ops.py. A build is cached per source and torch version under the
build folder (the first one takes a few tens of seconds). One extension per process: its TORCH_LIBRARY registers the
`hgemm` namespace once, so a second export loaded in the same process shares the first one's (kernels are
registered per problem, the latest registration of a problem winning).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

PROCESS_KEY = "hgemm_ops_extension"  # sys.modules entry holding the loaded extension
SOURCES = ("hgemm_op.cpp", "hgemm_library.cpp", "hgemm_table.cpp", "hgemm_module.cpp", "hgemm_route.cpp")
HEADERS = ("hgemm_op.h", "hgemm_cuda.h")


def load(folder: Path, build_root: Path, verbose: bool = False):
    """The extension module built from the sources in `folder` (built under build_root if needed); raises whatever
    the build or the load raised."""
    if PROCESS_KEY in sys.modules:
        return sys.modules[PROCESS_KEY]
    import torch
    from torch.utils.cpp_extension import load as load_extension

    text = b"".join((folder / f).read_bytes() for f in SOURCES + HEADERS)
    name = f"hgemm_ops_{hashlib.sha256(text + torch.__version__.encode()).hexdigest()[:12]}"
    build = build_root / name
    build.mkdir(parents=True, exist_ok=True)
    ext = load_extension(name=name, sources=[str(folder / f) for f in SOURCES], build_directory=str(build),
                         extra_cflags=["-O2"], extra_ldflags=["-ldl"], with_cuda=False, verbose=verbose)
    _trace_as_ops(ext)
    sys.modules[PROCESS_KEY] = ext
    return ext


def _trace_as_ops(ext) -> None:
    """torch.compile sees the registered ops (fake kernels, no graph break) where eager code calls the fast entry
    points ext.mm / ext.linear / ext.fused_linear, which skip the dispatcher's Python argument parsing."""
    import torch

    mm_op, linear_op, fused_op, norm_op = (torch.ops.hgemm.mm.default, torch.ops.hgemm.linear.default,
                                           torch.ops.hgemm.fused_linear.default, torch.ops.hgemm.norm_linear.default)

    @torch.compiler.substitute_in_graph(ext.mm, skip_signature_check=True)
    def mm(a, b, bias=None):
        return mm_op(a, b, bias)

    @torch.compiler.substitute_in_graph(ext.linear, skip_signature_check=True)
    def linear(x, w, bias=None):
        return linear_op(x, w, bias)

    @torch.compiler.substitute_in_graph(ext.fused_linear, skip_signature_check=True)
    def fused_linear(x, w, bias, epilogue, residual):
        return fused_op(x, w, bias, epilogue, residual)

    @torch.compiler.substitute_in_graph(ext.norm_linear, skip_signature_check=True)
    def norm_linear(x, norm_w, eps, kind, w, bias, epilogue, residual):
        return norm_op(x, norm_w, eps, kind, w, bias, epilogue, residual)
