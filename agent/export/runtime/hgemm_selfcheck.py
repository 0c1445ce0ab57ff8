"""Self-check of an exported HGEMM op, run by `python hgemm_ops.py` in a fresh process (needs a CUDA GPU).

Every exported kernel on fresh random inputs, at both ends of each M interval it serves and at an M inside, through
each launch path there is (the compiled op and the Python path), against an fp64 reference and cuBLAS (with a fused
epilogue: the fp64 reference of the whole op and the model's composition; the error may be at most `factor` times
theirs); then the compiled op where CUDA graphs, side streams and torch.compile put
it: its very first call inside a CUDA-graph capture (the kernel loads and the scratch buffers are allocated there),
a call on a side stream, a 3-D input under torch.compile(fullgraph=True), and an M no interval serves, which must
give exactly cuBLAS's result; then the helper kernels through each launch path: a gated call no kernel serves (cuBLAS,
then the gated fallback's kernel) must be the model's composition bit for bit, and the RMSNorm kernel the model's norm
within 2 ulps on under 1% of the elements. Raises AssertionError on the first failure.
"""

from __future__ import annotations

import random
import types

import torch
import torch.nn.functional as F


def served_ms(ops: types.SimpleNamespace, key: str, rng: random.Random) -> list[int]:
    """Each interval's ends and an M inside it."""
    ms = []
    for lo, hi in ops.intervals.serves(key, ops.MANIFEST["kernels"][key]):
        ms += [lo, hi, rng.randint(lo, hi)]
    return list(dict.fromkeys(ms))


def operands(ops: types.SimpleNamespace, key: str, m: int | None = None) -> tuple:
    """(a, b, bias, layout, epilogue, residual) for a call of the kernel `key` at M (by default the lowest it serves:
    a bucket's kernel may serve only a stretch of it)."""
    _, n, k, layout, dtype, bias, epi = ops.parse_key(key)
    m = ops.intervals.serves(key, ops.MANIFEST["kernels"][key])[0][0] if m is None else m
    fused = ops.epilogue.Epilogue(epi)
    dt, std = ops.DTYPES[dtype], (16 / k ** 0.5) ** 0.5 if fused.quadratic else 1.0  # act(gate) * up, relu^2 in range
    a = (torch.randn(m, k, device="cuda") * std).to(dt)
    b = (torch.randn(*((k, n) if layout == "kn" else (n, k)), device="cuda") * std).to(dt)
    r = torch.randn(m, n, device="cuda").to(dt) if fused.residual else None
    return a, b, torch.randn(n, device="cuda").to(dt) if bias else None, layout, epi, r


def call(ops, path, a, b, bias, layout, epi="none", r=None) -> torch.Tensor:
    """The call through `path`: the compiled op's module or PythonPath (epilogue by number), or hgemm_ops itself."""
    if epi == "none":
        return path.mm(a, b, bias) if layout == "kn" else path.linear(a, b, bias)
    return path.fused_linear(a, b, bias, epi if path is ops else ops.EPILOGUE_CODES[epi], r)


def verdict(ops: types.SimpleNamespace, label: str, out: torch.Tensor, a, b, bias, layout, epi, r,
            factor: float) -> str:
    b_kn = b if layout == "kn" else b.t()
    y = a.double() @ b_kn.double() + (bias.double() if bias is not None else 0)
    ref = ops.epilogue.reference(y, ops.epilogue.Epilogue(epi), r)
    size = torch.linalg.norm(ref)
    err = float(torch.linalg.norm(out.double().reshape(ref.shape) - ref) / size)
    cub = float(torch.linalg.norm(ops.fallback(a, b, bias, layout, epi, r).double() - ref) / size)
    ok = out.numel() == ref.numel() and bool(torch.isfinite(out).all()) and err <= factor * cub + 1e-6
    line = f"{label}: {'ok' if ok else 'FAILED'} rel err {err:.2e} (cuBLAS {cub:.2e})"
    assert ok, line
    return line


def helper_lines(ops: types.SimpleNamespace, paths: dict) -> list[str]:
    """The gated fallback's and the RMSNorm's kernels (the manifest's "gated" and "norm" sections) through each path."""
    lines = []
    for key in ops.MANIFEST.get("gated", {}):
        epi, dtype = key.split(":")
        x = torch.randn(7, 256, device="cuda").to(ops.DTYPES[dtype])
        w = (torch.randn(48, 256, device="cuda") * 0.25).to(ops.DTYPES[dtype])  # 48 rows: no kernel serves it
        if ops.INDEX.find_key(ops.problem_key(x, w, None, "nk", epi)) is not None:
            continue
        want = ops.epilogue.compose(F.linear(x, w), ops.epilogue.Epilogue(epi))
        for name, path in paths.items():
            same = torch.equal(call(ops, path, x, w, None, "nk", epi), want)
            lines.append(f"{key} fallback {name}: {'the composition, bit for bit' if same else 'FAILED'}")
            assert same, lines[-1]
    for key in ops.MANIFEST.get("norm", {}):
        dt = ops.DTYPES[key.split(":")[1]]
        x = (torch.randn(5, 4096, device="cuda") * 3).to(dt)
        weight = (1 + 0.2 * torch.randn(4096, device="cuda")).to(dt)
        for kind, norm in enumerate(ops.rms_norms):
            want = norm(x, weight, 1e-5)
            for name, path in paths.items():
                got = path.rms_norm(x, weight, 1e-5, kind)
                if got is None:  # its cubin does not load on this GPU: rms_norm runs PyTorch's ops
                    lines.append(f"{key} {name}: not served on this GPU (PyTorch's ops)")
                    continue
                off = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
                ok = int(off.max()) <= 2 and float((off > 0).float().mean()) < 0.01
                lines.append(f"{key} {name}: " + (f"within {int(off.max())} ulps of {norm.__name__}" if ok
                                                        else "FAILED"))
                assert ok, lines[-1]
    return lines


def norm_lines(ops: types.SimpleNamespace, paths: dict, rng: random.Random, factor: float) -> list[str]:
    """Each kernel exported with a norm variant (norm_linear's), at the M it serves, through each path and for each
    rounding kind of the norm, against the reference of the model's norm output times B."""
    lines = []
    for key, entry in ops.MANIFEST["kernels"].items():
        if not entry.get("norm_cubin"):
            continue
        for m in served_ms(ops, key, rng):
            a, b, bias, layout, epi, r = operands(ops, key, m)
            a = a * 3  # rows whose norm scales them
            weight = (1 + 0.2 * torch.randn(a.shape[-1], device="cuda")).to(a.dtype)
            for kind, norm in enumerate(ops.rms_norms):
                for name, path in paths.items():
                    out = path.norm_linear(a, weight, 1e-5, kind, b, bias, ops.EPILOGUE_CODES[epi], r)
                    torch.cuda.synchronize()
                    lines.append(verdict(ops, f"{key} at M={m} {name}, the norm (kind {kind}) inside", out,
                                         norm(a, weight, 1e-5), b, bias, layout, epi, r, factor))
    return lines


def selfcheck(ops: types.SimpleNamespace, factor: float = 2.0) -> list[str]:
    ext = ops.compiled()
    kernels = list(ops.MANIFEST["kernels"])
    lines = [f"compiled op: {'built and loaded' if ext else 'unavailable (see the warning): Python path only'}"]
    torch.manual_seed(0)
    if ext is not None and kernels:
        args = operands(ops, kernels[0])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(ops, ext, *args)
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
                    out = call(ops, path, *args)
                    torch.cuda.synchronize()
                    lines.append(verdict(ops, f"{key} at M={m} {name}", out, *args, factor))
    with torch.no_grad():
        lines += helper_lines(ops, paths) + norm_lines(ops, paths, rng, factor)
    if ext is None or not kernels:
        return lines + [f"{key}: cuBLAS (no kernel beat it)" for key in ops.MANIFEST.get("cublas", [])]
    a, b, bias, layout, epi, r = args = operands(ops, kernels[-1])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = call(ops, ext, *args)
    side.synchronize()
    lines.append(verdict(ops, f"{kernels[-1]} compiled, on a side stream", out, *args, factor))
    traced = torch.compile(lambda a3, b, bias, r3: call(ops, ops, a3, b, bias, layout, epi, r3), fullgraph=True,
                           backend="aot_eager")
    with torch.no_grad():
        out = traced(a.unsqueeze(0), b, bias, None if r is None else r.unsqueeze(0))
    lines.append(verdict(ops, f"{kernels[-1]} under torch.compile(fullgraph=True), a 3-D input", out, *args, factor))
    top = max((hi for _, hi in ops.intervals.serves(kernels[-1], ops.MANIFEST["kernels"][kernels[-1]])),
              default=a.shape[0])
    untuned = torch.cat([a, a[:1].expand(top + 1 - a.shape[0], -1)])  # one row past the highest M served
    r_untuned = None if r is None else torch.cat([r, r[:1].expand(top + 1 - r.shape[0], -1)])
    if ops.INDEX.find_key(ops.problem_key(untuned, b, bias, layout, epi)) is None:
        same = torch.equal(call(ops, ext, untuned, b, bias, layout, epi, r_untuned),
                           ops.fallback(untuned, b, bias, layout, epi, r_untuned))
        lines.append(f"{kernels[-1]} at M={top + 1} (not served): {'cuBLAS, same result' if same else 'FAILED'}")
        assert same, lines[-1]
    return lines + [f"{key}: cuBLAS (no kernel beat it)" for key in ops.MANIFEST.get("cublas", [])]
