"""Self-check of an exported HGEMM op, run by `python hgemm_ops.py` in a fresh process (needs a CUDA GPU).

Every exported kernel on fresh random inputs, at both ends of each M interval it serves and at an M inside, through
each launch path there is (the compiled op and the Python path), against an fp64 reference and cuBLAS (its error
may be at most `factor` times cuBLAS's); then the compiled op where CUDA graphs, side streams and torch.compile put
it: its very first call inside a CUDA-graph capture (the kernel loads and the scratch buffers are allocated there),
a call on a side stream, a 3-D input under torch.compile(fullgraph=True), and an M no interval serves, which must
give exactly cuBLAS's result. Raises AssertionError on the first failure.
"""

from __future__ import annotations

import random
import types

import torch


def served_ms(ops: types.SimpleNamespace, key: str, rng: random.Random) -> list[int]:
    """Each interval's ends and an M inside it."""
    ms = []
    for lo, hi in ops.intervals.serves(key, ops.MANIFEST["kernels"][key]):
        ms += [lo, hi, rng.randint(lo, hi)]
    return list(dict.fromkeys(ms))


def operands(ops: types.SimpleNamespace, key: str, m: int | None = None) -> tuple:
    low, n, k, layout, dtype, bias = ops.parse_key(key)
    m = low if m is None else m
    dt = ops.DTYPES[dtype]
    a = torch.randn(m, k, device="cuda").to(dt)
    b = torch.randn(k, n, device="cuda").to(dt) if layout == "kn" else torch.randn(n, k, device="cuda").to(dt)
    return a, b, torch.randn(n, device="cuda").to(dt) if bias else None, layout


def call(path, a, b, bias, layout) -> torch.Tensor:
    return path.mm(a, b, bias) if layout == "kn" else path.linear(a, b, bias)


def verdict(ops: types.SimpleNamespace, label: str, out: torch.Tensor, a, b, bias, layout, factor: float) -> str:
    b_kn = b if layout == "kn" else b.t()
    ref = a.double() @ b_kn.double() + (bias.double() if bias is not None else 0)
    size = torch.linalg.norm(ref)
    err = float(torch.linalg.norm(out.double().reshape(ref.shape) - ref) / size)
    cub = float(torch.linalg.norm(ops.fallback(a, b, bias, layout).double() - ref) / size)
    ok = out.numel() == ref.numel() and bool(torch.isfinite(out).all()) and err <= factor * cub + 1e-6
    line = f"{label}: {'ok' if ok else 'FAILED'} rel err {err:.2e} (cuBLAS {cub:.2e})"
    assert ok, line
    return line


def selfcheck(ops: types.SimpleNamespace, factor: float = 2.0) -> list[str]:
    ext = ops.compiled()
    kernels = list(ops.MANIFEST["kernels"])
    lines = [f"compiled op: {'built and loaded' if ext else 'unavailable (see the warning): Python path only'}"]
    torch.manual_seed(0)
    if ext is not None and kernels:
        a, b, bias, layout = args = operands(ops, kernels[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(ext, *args)
        graph.replay()
        torch.cuda.synchronize()
        lines.append(verdict(ops, f"{kernels[0]} compiled, first call inside a CUDA-graph capture", out, *args, factor))
    paths = {"compiled": ext, "python": ops.PythonPath} if ext is not None else {"python": ops.PythonPath}
    rng = random.Random(0)
    with torch.no_grad():
        for key in kernels:
            for m in served_ms(ops, key, rng):
                args = operands(ops, key, m)
                for name, path in paths.items():
                    out = call(path, *args)
                    torch.cuda.synchronize()
                    lines.append(verdict(ops, f"{key} at M={m} {name}", out, *args, factor))
    if ext is None or not kernels:
        return lines + [f"{key}: cuBLAS (no kernel beat it)" for key in ops.MANIFEST.get("cublas", [])]
    a, b, bias, layout = args = operands(ops, kernels[-1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = call(ext, *args)
    side.synchronize()
    lines.append(verdict(ops, f"{kernels[-1]} compiled, on a side stream", out, *args, factor))
    traced = torch.compile(lambda a3, b, bias: call(ops, a3, b, bias, layout), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = traced(a.unsqueeze(0), b, bias)
    lines.append(verdict(ops, f"{kernels[-1]} under torch.compile(fullgraph=True), a 3-D input", out, *args, factor))
    top = max((hi for _, hi in ops.intervals.serves(kernels[-1], ops.MANIFEST["kernels"][kernels[-1]])),
              default=a.shape[0])
    untuned = torch.cat([a, a[:1].expand(top + 1 - a.shape[0], -1)])  # one row past the highest M served
    if ops.INDEX.find_key(ops.problem_key(untuned, b, bias, layout)) is None:
        same = torch.equal(call(ext, untuned, b, bias, layout), ops.fallback(untuned, b, bias, layout))
        lines.append(f"{kernels[-1]} at M={top + 1} (not served): {'cuBLAS, same result' if same else 'FAILED'}")
        assert same, lines[-1]
    return lines + [f"{key}: cuBLAS (no kernel beat it)" for key in ops.MANIFEST.get("cublas", [])]
