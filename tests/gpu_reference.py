"""A family's kernel on the GPU against torch and an fp64 reference, for a problem of either dtype, with or without a
bias (the family tests' gpu-marked checks of every epilogue kind).

Two checks per setting, each launch run twice (bit-identical: the kernels are deterministic, and K groups must find
their arrival counters reset):
- exact: integer A and B in [-8, 8] and a bias of quarters in [-64, 64]. Every product, partial sum and the sum plus
  the bias are exact in fp32, so C must equal the exact result rounded once to the dtype, bit for bit. The sums reach
  past the range where the dtype holds integers exactly (256 for bf16, 2048 for fp16), so the rounding is exercised:
  a bias added after rounding, a dropped bias or a sum rounded through fp16 shows.
- random: normal inputs; the relative (Frobenius) error against fp64 is at most twice torch's (torch.matmul, or
  F.linear with the bias, in the same dtype), and no element is further off than twice torch's worst element plus one
  unit in the last place of the dtype.
"""

from __future__ import annotations

import torch

from core.records import Problem
from sandbox.build import compile_cuda
from templates import get_family

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
MANTISSA_BITS = {"f16": 10, "bf16": 7}
ERR_FACTOR = 2.0
# every (dtype, bias) pair; plain fp16 too, the control that the exact check's premise holds where nothing is new
PAIRS = [("f16", False), ("bf16", False), ("f16", True), ("bf16", True)]


def cases(kinds: dict[str, tuple[dict, tuple[int, int, int]]]) -> list:
    """pytest params (params, problem) of every kind x layout x (dtype, bias) pair, with readable ids."""
    import pytest

    return [pytest.param(params, Problem(*mnk, layout, dtype, bias),
                         id=f"{kind}-{layout}-{dtype}{'-bias' if bias else ''}")
            for kind, (params, mnk) in kinds.items() for layout in ("kn", "nk") for dtype, bias in PAIRS]


def _kernel(family: str, params: dict, problem: Problem):
    from sandbox.launch import Kernel

    arch = "sm_90a" if torch.cuda.get_device_capability() >= (9, 0) else "sm_80"
    build = compile_cuda(get_family(family).render(params, problem), arch)
    assert build.ok, build.log[-2000:]
    return Kernel.for_family(build.cubin, family, params, problem)


def check_in_sandbox(family: str, params: dict, problem: Problem) -> None:
    """The sandbox's own checks of the setting's kernel on `problem` (sandbox.check.Checker.check_all: a fused
    epilogue against the model's composition, guard regions, poisoned outputs, scrubbed shared memory); raises
    CheckFailed naming the first it fails. check_kernel is the plain GEMM's check; this one takes every epilogue."""
    from sandbox.check import Checker
    from sandbox.launch import SmemScrubber

    kernel = _kernel(family, params, problem)
    props = torch.cuda.get_device_properties(0)
    scrub = SmemScrubber(props.shared_memory_per_block_optin, props.multi_processor_count)
    Checker(kernel, problem, deterministic=get_family(family).deterministic, scrub=scrub, seed=7).check_all(problem)


def _run_twice(kernel, problem: Problem, a, b, bias) -> torch.Tensor:
    outs = []
    for _ in range(2):
        c = torch.full((problem.m, problem.n), float("nan"), device="cuda", dtype=DTYPES[problem.dtype])
        kernel(a, b, c, problem.m, problem.n, problem.k, bias)
        outs.append(c)
    torch.cuda.synchronize()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), "two launches differ"
    return outs[0]


def _ulp(ref: torch.Tensor, dtype: str) -> torch.Tensor:
    """Spacing of the dtype's numbers at each reference value (bf16 has fp32's exponent range, fp16 subnormals)."""
    tiny = 2.0 ** -126 if dtype == "bf16" else 2.0 ** -14
    return torch.pow(2.0, torch.floor(torch.log2(ref.abs().clamp_min(tiny))) - MANTISSA_BITS[dtype])


def check_kernel(family: str, params: dict, problem: Problem) -> None:
    """Raises AssertionError naming the first check the setting's kernel fails on `problem`."""
    import torch.nn.functional as F

    kernel = _kernel(family, params, problem)
    dt, (m, n, k) = DTYPES[problem.dtype], (problem.m, problem.n, problem.k)
    gen = torch.Generator(device="cuda").manual_seed(m * 7919 + n * 31 + k)
    b_shape = (k, n) if problem.b_layout == "kn" else (n, k)

    def as_kn(b: torch.Tensor) -> torch.Tensor:
        return b if problem.b_layout == "kn" else b.t()

    # exact
    a = torch.randint(-8, 9, (m, k), generator=gen, device="cuda").to(dt)
    b = torch.randint(-8, 9, b_shape, generator=gen, device="cuda").to(dt)
    bias = torch.randint(-256, 257, (n,), generator=gen, device="cuda").to(dt) / 4 if problem.bias else None
    exact = a.double() @ as_kn(b).double() + (bias.double() if problem.bias else 0)
    assert exact.abs().max() < 2**22, "the exact check's sums must stay exact in fp32"
    out = _run_twice(kernel, problem, a, b, bias)
    bad = out.double() != exact.to(dt).double()
    if bad.any():
        r, c = bad.nonzero()[0].tolist()
        raise AssertionError(f"integer inputs: {int(bad.sum())} elements differ from the exact result rounded once; "
                             f"C[{r},{c}] = {out[r, c].item():g}, exact {exact[r, c].item():g} "
                             f"(rounded {exact.to(dt)[r, c].item():g})")

    # random
    a = torch.randn(m, k, generator=gen, device="cuda").to(dt)
    b = torch.randn(*b_shape, generator=gen, device="cuda").to(dt)
    bias = torch.randn(n, generator=gen, device="cuda").to(dt) if problem.bias else None
    out = _run_twice(kernel, problem, a, b, bias).double()
    ref = a.double() @ as_kn(b).double() + (bias.double() if problem.bias else 0)
    theirs = (F.linear(a, b, bias) if problem.b_layout == "nk" else
              torch.addmm(bias, a, b) if problem.bias else a @ b).double()
    assert torch.isfinite(out).all(), "NaN or Inf in C (an element left unwritten?)"
    err = float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref))
    torch_err = float(torch.linalg.norm(theirs - ref) / torch.linalg.norm(ref))
    assert err <= ERR_FACTOR * torch_err + 1e-6, f"relative error {err:.2e} vs torch {torch_err:.2e}"
    far = (out - ref).abs() > ERR_FACTOR * (theirs - ref).abs().max() + _ulp(ref, problem.dtype)
    assert not far.any(), f"C{far.nonzero()[0].tolist()} too far from the fp64 reference"
