"""Record the GEMMs a piece of PyTorch code runs and write them as a shapes file that `run --shapes` reads.

    with agent.record_gemm_shapes("shapes.txt"):              # or serve_m=(1, 256): every M from 1 to 256 too
        model(input_ids)

What counts as a GEMM here is what the exported op computes: C[M,N] = A[M,K] @ B (+ bias[N]) with one B for all of
A's rows. Recorded: `F.linear` / `nn.Linear` (B is the N x K weight: layout nk, `:bias` when it has one),
`torch.matmul`, `Tensor.matmul`, `@`, `torch.mm` (B K x N: layout kn) and `torch.addmm` with a bias vector (kn:bias).
A's leading dimensions fold into M (a (batch, seq, K) input is M = batch * seq), as the op folds them. A B that
is a transposed view of a row-major N x K tensor (`x @ w.t()`) records as nk, its real layout. Not recorded, and
counted by reason in the file's header: batched products with a B per batch (`bmm`, `baddbmm`, `matmul` with a 3-D
B), matrix-vector products (a 1-D B), dtypes other than fp16 and bf16, mixed dtypes, `addmm` with a full C
or scaling, strided B views and shapes the kernels do not take (N or K not a multiple of 8).

A problem seen at several M (a decode step and a prefill, or several batch sizes) is written as one range of M,
`LO-HI_N_K:...` from the smallest M seen to the largest, which `run` searches in buckets and the export serves at
every M inside; `serve_m=(lo, hi)` widens every problem's range to hold lo-hi as well (the batch sizes a server
will see, recorded or not).

Calls run exactly as they would without the recorder (a TorchFunctionMode only looks at them).

    with agent.record_gemm_shapes("shapes.txt", model=model):   # the problems hgemm_ops.patch(model) will run
        model(input_ids)

With `model`, the model's decoder layers are fused for the recording as the export's patch fuses them
(agent/export/runtime/hgemm_fuse.py: q/k/v as one GEMM, gate/up as one gated GEMM, o_proj and down_proj with the
residual add), computing with PyTorch, and put back afterwards: the file names the merged problems with their
epilogues (`M_N_K:nk:f16:silu_mul`, `...:residual`) instead of the separate projections.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from agent.buckets import representative, series
from core.epilogue import Epilogue, compose
from core.records import Problem

DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16"}
MATMULS = {torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm}
BATCHED = {torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm}
ADDMMS = {torch.addmm, torch.Tensor.addmm}


class GemmRecorder(TorchFunctionMode):
    """Counts each distinct Problem the code inside it runs (`problems`, one M each), and each call it skipped by
    reason (`skipped`); `serve_m` (lo, hi) widens each problem's M range in the file to hold lo-hi."""

    def __init__(self, serve_m: tuple[int, int] | None = None) -> None:
        super().__init__()
        if serve_m is not None and not 1 <= serve_m[0] <= serve_m[1]:
            raise ValueError(f"serve_m={serve_m}: expected (lo, hi) with 1 <= lo <= hi")
        self.serve_m = serve_m
        self.problems: Counter[Problem] = Counter()
        self.skipped: Counter[str] = Counter()
        self.paused = False  # inside a fused op: its own products are not the problem

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            self._look(func, args, kwargs)
        return func(*args, **kwargs)

    # the ops hgemm_fuse calls while recording: each call recorded as the problem it is, computed by PyTorch
    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.fused_linear(x, w, bias, "none", None)

    def fused_linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
                     residual: torch.Tensor | None) -> torch.Tensor:
        self._add(x, w.t(), bias, epilogue)
        self.paused = True
        try:
            return compose(torch.nn.functional.linear(x, w, bias), Epilogue(epilogue), residual)
        finally:
            self.paused = False

    def _look(self, func, args, kwargs) -> None:
        if func is torch.nn.functional.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self._add(x, w.t(), bias)
        elif func in MATMULS:
            self._add(args[0], args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2")), None)
        elif func is torch.Tensor.__rmatmul__:
            self._add(args[1], args[0], None)
        elif func in ADDMMS:
            bias, a, b = args[:3]
            if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1 or bias.dim() != 1:
                self.skipped["addmm with a full C or scaling (not a bias vector)"] += 1
            else:
                self._add(a, b, bias)
        elif func in BATCHED:
            self.skipped["bmm/baddbmm (a B per batch)"] += 1

    def _add(self, a: torch.Tensor, b_kn: torch.Tensor, bias: torch.Tensor | None, epilogue: str = "none") -> None:
        """a @ b_kn (+ bias) (then the epilogue), b_kn the K x N view of B, whatever its storage."""
        if b_kn.dim() != 2:
            self.skipped["matmul with a batched B" if b_kn.dim() > 2 else "matrix-vector product"] += 1
            return
        if a.dim() < 1 or a.shape[-1] != b_kn.shape[0]:
            return  # torch raises on these itself
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in (a, b_kn, bias) if t is not None})
        if len(dtypes) != 1 or getattr(torch, dtypes[0]) not in DTYPES:
            self.skipped[f"dtype {'/'.join(dtypes)} (only float16 and bfloat16 are tuned)"] += 1
            return
        dtype = a.dtype
        if b_kn.is_contiguous():
            layout = "kn"
        elif b_kn.t().is_contiguous():
            layout = "nk"
        else:
            self.skipped["B is a strided view (neither K x N nor N x K row-major)"] += 1
            return
        k, n = b_kn.shape
        m = a.numel() // k if k else 0
        try:
            self.problems[Problem(m, n, k, layout, DTYPES[dtype], bias is not None, epilogue)] += 1
        except ValueError as e:
            self.skipped[f"not a kernel shape ({e})"] += 1

    def ranges(self) -> dict[Problem, tuple[tuple[int, ...], int]]:
        """Per problem as the file writes it (a range of M where it was seen at several M or serve_m widens it),
        first seen first: the M values seen and the calls."""
        seen: dict[Problem, list] = {}
        for p, calls in self.problems.items():
            entry = seen.setdefault(series(p), [[], 0])
            entry[0].append(p.m)
            entry[1] += calls
        out = {}
        for s, (ms, calls) in seen.items():
            lo, hi = min(ms), max(ms)
            if self.serve_m:
                lo, hi = min(lo, self.serve_m[0]), max(hi, self.serve_m[1])
            span = (lo, hi) if hi > lo else None
            out[dataclasses.replace(s, m=representative(lo, hi) if span else lo, m_range=span)] = (tuple(ms), calls)
        return out

    def text(self) -> str:
        """The shapes file: a comment header, then one M_N_K:layout:dtype[:bias][:epilogue] line per problem
        (LO-HI_N_K:... where it ran at several M, or serve_m widens it), first seen first."""
        calls = sum(self.problems.values())
        head = [f"# GEMM shapes recorded by hgemm-agent (agent.record_gemm_shapes): {calls} calls, "
                f"{len(self.problems)} distinct problems" + (f", every M widened to hold {self.serve_m[0]}-"
                                                              f"{self.serve_m[1]}" if self.serve_m else "")]
        if self.skipped:
            head.append(f"# skipped {sum(self.skipped.values())} calls: "
                        + "; ".join(f"{n} {why}" for why, n in self.skipped.items()))
        if self.problems:
            head.append("# search them: python -m agent run --shapes THIS_FILE")
        else:
            head.append("# nothing to search: no GEMM the kernels take (fp16 or bf16, a 2-D B) ran inside the recorder")
        lines = [f"{p.key}  # {n} call{'s' if n > 1 else ''}" + (f" at M = {_listed(ms)}" if p.m_range else "")
                 for p, (ms, n) in self.ranges().items()]
        return "\n".join(head + lines) + "\n"


def _listed(ms: tuple[int, ...], most: int = 8) -> str:
    ms = sorted(ms)
    return ", ".join(map(str, ms)) if len(ms) <= most else f"{', '.join(map(str, ms[:most]))}, ... ({len(ms)} M)"


@contextmanager
def record_gemm_shapes(path: str | Path | None, model: torch.nn.Module | None = None,
                       serve_m: tuple[int, int] | None = None) -> Iterator[GemmRecorder]:
    """Record the GEMMs run inside the block; on leaving it normally, write them to `path` (a shapes file; None:
    no file, the recorder it yields holds them), each problem seen at several M as a range of M, every range widened
    to hold serve_m=(lo, hi) where given. With `model`, its decoder layers run fused inside the block, as
    hgemm_ops.patch will run them, and are put back."""
    from agent.export.runtime import hgemm_fuse

    recorder = GemmRecorder(serve_m)
    if model is not None:
        hgemm_fuse.fuse(model, recorder)
    try:
        with recorder:
            yield recorder
    finally:
        if model is not None:
            hgemm_fuse.unfuse(model)
    if path is not None:
        Path(path).write_text(recorder.text())
