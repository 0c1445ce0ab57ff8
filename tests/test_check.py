"""sandbox.check's error bounds on the CPU: a batch of outputs passes or fails output by output exactly as each
would alone (the timing checks verify every timed output in batches)."""

from __future__ import annotations

import pytest
import torch

from core.records import Problem
from sandbox.check import Checker, CheckFailed


def checker(layout: str, bias: bool) -> Checker:
    c = object.__new__(Checker)  # the bounds need only the problem: no GPU, no launch
    c.problem, c.dtype, c.rel_err, c.cublas_rel_err = Problem(8, 24, 64, layout, "f16", bias), "f16", 0.0, 0.0
    return c


def operands(s: int, layout: str, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(s, 8, 64, generator=g).half()
    b = torch.randn(s, *((64, 24) if layout == "kn" else (24, 64)), generator=g).half()
    bb = torch.randn(s, 24, generator=g).half() if bias else None
    b_kn = b if layout == "kn" else b.transpose(1, 2)
    out = (a.float() @ b_kn.float() + (0 if bb is None else bb.float()[:, None])).half()  # fp32 sums, rounded once
    return out, a, b, bb


def verdicts_alone(c: Checker, out, a, b, bias) -> list[str | None]:
    found = []
    for i in range(out.shape[0]):
        try:
            c.verify(out[i], a[i], b[i], None if bias is None else bias[i], "alone")
            found.append(None)
        except CheckFailed as e:
            found.append(str(e).split(":")[0])
    return found


@pytest.mark.parametrize("layout, bias", [("kn", False), ("nk", True)])
def test_a_batch_fails_on_the_output_that_fails_alone(layout, bias):
    c = checker(layout, bias)
    out, a, b, bb = operands(5, layout, bias)
    c.verify_batch(out, a, b, bb, "batch", [f"output {i}" for i in range(5)])  # correct outputs pass
    assert 0 < c.rel_err < 1e-3 and 0 < c.cublas_rel_err < 1e-3
    bad = out.clone()
    bad[3, 2, 7] += 0.5  # one element of output 3, far beyond one rounding
    bad[4] = 0.0  # output 4 all wrong
    assert verdicts_alone(c, bad, a, b, bb) == [None, None, None, "wrong result", "wrong result"]
    with pytest.raises(CheckFailed, match=r"^output 3: relative error .* first bad element \[2, 7\] \(batch\)"):
        c.verify_batch(bad, a, b, bb, "batch", [f"output {i}" for i in range(5)])
    nan = out.clone()
    nan[1, 0, 0] = float("nan")
    with pytest.raises(CheckFailed, match=r"^output 1: NaN or Inf in the output \(batch\)"):
        c.verify_batch(nan, a, b, bb, "batch", [f"output {i}" for i in range(5)])


def test_a_shared_b_serves_every_output_of_a_batch():
    c = checker("kn", False)
    out, a, b, _ = operands(4, "kn", False)
    shared = b[:1]
    out = (a.float() @ shared.float()).half()
    c.verify_batch(out, a, shared, None, "batch", [f"output {i}" for i in range(4)])
    with pytest.raises(CheckFailed, match="^output 1"):  # each its own B: output 0's is the shared one
        c.verify_batch(out, a, b, None, "batch", [f"output {i}" for i in range(4)])
