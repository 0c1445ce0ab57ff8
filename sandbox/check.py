"""Correctness checks that a fast-but-wrong kernel cannot pass (GPU worker only).

Every candidate, before it is timed, on the target shape and on edge shapes:
- fresh random normal inputs, an fp64 reference, and cuBLAS's own error on the same inputs. Accepted when the
  candidate's relative Frobenius error is at most ERR_FACTOR x cuBLAS's (plus a tiny absolute slack) and its largest
  element error at most ERR_FACTOR x cuBLAS's largest plus one ulp of that element in the output dtype. Why: with
  fp32 accumulation the error is dominated by the one final rounding, the same for any summation order, so a correct
  kernel lands at about 1.0x; accumulating in 16 bits or dropping a K slice lands far above 2x;
- exact checks: inputs from {0, 1} (and such a bias), so every dot product is an integer; where it is representable
  in the dtype (|x| <= 2048 for fp16, 256 for bf16) the output must equal it exactly. Then integers in [-8, 8] and a
  bias in quarters: every partial sum is exact in fp32, so every output must be the exact result rounded once, bit
  for bit; a result rounded twice (the sum first, then the sum plus the bias, or through fp16 on the way to bf16)
  differs. They reuse the random check's buffers, so a kernel that returns a result cached from a previous call is
  caught;
- bf16 only: inputs scaled so that the outputs lie far outside fp16's range: a kernel computing or rounding through
  fp16 overflows there;
- an activation epilogue: inputs scaled so that the sums lie where the activation bends (a cheap approximation of it
  shows there);
- the output poisoned with NaN before each launch (unwritten elements stay NaN), guard regions around inputs and
  output (out-of-bounds writes), inputs compared bit for bit afterwards (a kernel must not write its inputs),
  shared memory filled with NaN before each launch (reads of uninitialised shared memory),
- the same inputs launched twice must give identical bits unless the family declares itself nondeterministic;
- a kernel its launch rule lets start before the kernel ahead of it has finished (an overlapped launch,
  core/overlap.py) is launched so after one that writes its operands late, and must give the same output
  (sandbox/overlap_check.py).
`verify_batch` checks several outputs at once the same way; the timing checks (sandbox/timed.py) use it on a random
sample of rows of every output of every timed replay.

A fused epilogue (core/epilogue.py) is checked against what the model would run instead: the GEMM by cuBLAS in the
dtype, then PyTorch's elementwise ops in the dtype (`composition`); that composition's error from the fp64 result of the
whole fused op sets the bound. The exact checks run where the result is exactly representable (no activation, or
relu; the residual in quarters like the bias), and a residual epilogue is also run in place (R is C).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.epilogue import Epilogue, compose
from core.epilogue import reference as apply_epilogue
from core.plan import ceil_div
from core.records import Problem

ERR_FACTOR = 2.0
POISON = 0x7E00  # fp16 quiet NaN; as bf16 bits 0x7E00 is 2^125 (finite): the poison is found by its bits
GUARD = 0x7E55  # a pattern no arithmetic produces in either dtype's outputs here
EXACT_LIMIT = {"f16": 2048, "bf16": 256}  # largest integer range each dtype holds exactly
TORCH_DTYPE = {"f16": torch.float16, "bf16": torch.bfloat16}
MANTISSA_BITS = {"f16": 10, "bf16": 7}
MIN_NORMAL_EXP = {"f16": -14, "bf16": -126}
RANGE_SCALE = 2.0 ** 9  # bf16 range check: each input x 2^9, so |C| ~ 2^18 sqrt(K), above fp16's 65504
# An activation's check: inputs scaled so the sums (and the bias) have this standard deviation, where the activations
# bend (with unit inputs the sums grow as sqrt(K) and most land where an activation is linear or zero)
ACT_STD = 2.0
# A quadratic epilogue's inputs (gated, relu2): scaled so the sums have about this standard deviation. act(gate) * up
# and relu(x)^2 grow as the square of the sums, and unit inputs give sums of sqrt(K): at K in the thousands they pass
# fp16's 65504 and the true result (and the model's) is Inf. Models' activations are small; so are these.
QUADRATIC_STD = 16.0


def input_std(problem: Problem) -> float:
    """The standard deviation of the random A and B the checks and timings use for this problem."""
    return (QUADRATIC_STD / problem.k ** 0.5) ** 0.5 if problem.fused.quadratic else 1.0

NO_EPILOGUE = Epilogue()
# launch(A, B, C, M, N, K, bias, residual): bias and residual are None where the problem has none
Launch = Callable[..., None]
DEVICE = "cuda"  # where the checks' tensors live: the worker's GPU (CPU tests of the checks' logic set "cpu")


def synchronize() -> None:
    """Wait for the device (a CUDA fault surfaces here, as an exception the worker reports)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class CheckFailed(Exception):
    """A correctness finding; its message is the reason recorded with the candidate."""


@dataclass
class GuardedStack:
    """`count` 2-D tensors of one dtype (rows x cols each) in one allocation, each between margins holding a sentinel
    pattern: out-of-bounds writes land in a margin. `count` 1 is a single guarded tensor."""

    rows: int
    cols: int
    dtype: torch.dtype = torch.float16
    count: int = 1

    def __post_init__(self) -> None:
        self.margin = 256 * self.cols + 4096  # a whole tile-row overrun stays inside the margin
        self.slot = self.rows * self.cols + self.margin
        self.flat = torch.full((self.margin + self.count * self.slot,), GUARD, dtype=torch.int16, device=DEVICE)
        slots = self.flat[self.margin:].view(self.count, self.slot)
        self.bits = slots[:, : self.rows * self.cols]  # a strided view of every tensor's elements
        self.all = self.bits.view(self.dtype).view(self.count, self.rows, self.cols)
        self.tensor = self.all[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.all[i]

    def guards_intact(self) -> bool:
        tails = self.flat[self.margin:].view(self.count, self.slot)[:, self.rows * self.cols:]
        return bool((self.flat[: self.margin] == GUARD).all() and (tails == GUARD).all())

    def poison(self) -> None:
        self.bits.fill_(POISON)

    def poisoned(self) -> torch.Tensor:
        """Per tensor: the flat index of its first element still holding the poison, or -1."""
        hit = self.bits == POISON
        first = hit.int().argmax(dim=1)
        return torch.where(hit.any(dim=1), first, torch.full_like(first, -1))


def guarded(rows: int, cols: int, dtype: str = "f16") -> GuardedStack:
    return GuardedStack(rows, cols, TORCH_DTYPE[dtype])


def edge_shapes(problem: Problem, seed: int = 0) -> list[tuple[int, int, int]]:
    """The target, a tiny ragged shape, and shapes just off the target's tile multiples; for a range of M also its
    ends and M inside it (range_ms); N a multiple of 16 where a gated epilogue needs it (the nearest above)."""
    m, n, k = problem.m, problem.n, problem.k
    shapes = [(m, n, k), (17, 24, 40), (1, 8, 8)]
    shapes.append((min(m, 300) + 13, min(n, 256) + 24, min(k, 512) + 8))
    shapes.append((max(1, m - 1), max(8, n - 8), max(8, k - 8)))
    if problem.m_range:
        shapes += [(x, n, k) for x in range_ms(*problem.m_range, random.Random(seed))]
    if problem.fused.gated:
        shapes = [(sm, ceil_div(sn, 16) * 16, sk) for sm, sn, sk in shapes]
    return list(dict.fromkeys(shapes))


def range_ms(lo: int, hi: int, rng: random.Random) -> list[int]:
    """M values a kernel serving lo..hi is checked at: both ends; the first M past a multiple of each tile height the
    families use (a last tile of rows holding one row); an M below one tile of 64 rows; a ragged M (not a multiple of
    8); one at random."""
    ms = [lo, hi]
    ms += [x for tile in (16, 64, 128, 192, 256) if (x := (lo - 1) // tile * tile + tile + 1) <= hi]
    if lo < 64:
        ms.append(rng.randint(lo, min(hi, 63)))
    ragged = [x for x in (rng.randint(lo, hi) for _ in range(8)) if x % 8]
    ms += ragged[:1] + [rng.randint(lo, hi)]
    return list(dict.fromkeys(ms))


def b_as_kn(b: torch.Tensor, b_layout: str) -> torch.Tensor:
    return b if b_layout == "kn" else b.t()


def reference(a: torch.Tensor, b_kn: torch.Tensor, bias: torch.Tensor | None, epilogue: Epilogue = NO_EPILOGUE,
              residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 result of the whole op, and what the model computes instead in the inputs' dtype (cuBLAS, the bias
    fused as F.linear does, then the epilogue's PyTorch ops), as fp64: a [S, M, K], b_kn [S or 1, K, N], bias
    [S or 1, N] or None, residual [S, M, N] or None."""
    ref = a.double() @ b_kn.double()
    if bias is not None:
        ref += bias.double()[:, None, :]
    if a.shape[0] == 1:  # cuBLAS as the user calls it: torch.matmul, or addmm with the bias fused
        cublas = (a[0] @ b_kn[0] if bias is None else torch.addmm(bias[0], a[0], b_kn[0]))[None]
    elif bias is None:
        cublas = a @ b_kn
    else:
        cublas = torch.baddbmm(bias[:, None, :].expand(a.shape[0], -1, -1), a, b_kn.expand(a.shape[0], -1, -1))
    return apply_epilogue(ref, epilogue, residual), compose(cublas, epilogue, residual).double()


class Checker:
    def __init__(self, launch: Launch, problem: Problem, *, deterministic: bool = True,
                 scrub: Callable[[], None] | None = None, seed: int = 0):
        self.launch, self.problem, self.deterministic = launch, problem, deterministic
        self.dtype, self.epilogue = problem.dtype, problem.fused
        self.scrub = scrub or (lambda: None)
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.seed = seed
        self.rel_err = self.cublas_rel_err = 0.0

    def buffers(self, m: int, n: int, k: int) -> tuple[GuardedStack, GuardedStack, GuardedStack, GuardedStack | None,
                                                       GuardedStack | None]:
        """A, B, C (the epilogue's columns), the bias and the residual (None where the problem has none)."""
        b = guarded(k, n, self.dtype) if self.problem.b_layout == "kn" else guarded(n, k, self.dtype)
        bias = guarded(1, n, self.dtype) if self.problem.bias else None
        r = guarded(m, n, self.dtype) if self.epilogue.residual else None
        return guarded(m, k, self.dtype), b, guarded(m, self.epilogue.out_cols(n), self.dtype), bias, r

    def b_as_kn(self, b: torch.Tensor) -> torch.Tensor:
        return b_as_kn(b, self.problem.b_layout)

    def run(self, a: GuardedStack, b: GuardedStack, c: GuardedStack, bias: GuardedStack | None = None,
            r: GuardedStack | None = None, garbage: bool = False) -> torch.Tensor:
        """Poison (or fill with finite garbage), scrub, launch once; return the output after the memory checks.

        A kernel that writes only where C holds the poison passes a poisoned launch; the garbage fill catches it."""
        inputs = [t for t in (a, b, bias, r) if t is not None]
        before = [t.tensor.clone() for t in inputs]
        if garbage:
            c.tensor.copy_(torch.rand(c.rows, c.cols, generator=self.gen, device=DEVICE) * 1000 - 500)
        else:
            c.poison()
        self.scrub()
        self.launch(a.tensor, b.tensor, c.tensor, c.rows, self.gemm_n(b), a.cols,
                    None if bias is None else bias.tensor[0], None if r is None else r.tensor)
        synchronize()
        shape = self._shape(c, a)
        if not all(t.guards_intact() for t in (*inputs, c)):
            raise CheckFailed(f"out-of-bounds write: a guard region next to an operand changed ({shape})")
        if not all(same_bits(t.tensor, old) for t, old in zip(inputs, before, strict=True)):
            raise CheckFailed(f"the kernel modified its inputs ({shape})")
        out = c.tensor.clone()
        if (first := int(c.poisoned()[0])) >= 0:
            raise CheckFailed(f"unwritten output: C[{first // c.cols},{first % c.cols}] still holds the poison "
                              f"({shape})")
        if not torch.isfinite(out).all():
            raise CheckFailed(f"NaN or Inf in the output ({shape})")
        return out

    def gemm_n(self, b: GuardedStack) -> int:
        """The GEMM's N (B's columns) of these buffers."""
        return b.cols if self.problem.b_layout == "kn" else b.rows

    def randomise(self, *tensors: GuardedStack | None, scale: float = 1.0) -> None:
        for t in tensors:
            if t is not None:
                t.tensor.copy_(torch.randn(t.rows, t.cols, generator=self.gen, device=DEVICE) * scale)

    def check_random(self, a: GuardedStack, b: GuardedStack, c: GuardedStack, bias: GuardedStack | None,
                     r: GuardedStack | None = None, scale: float | None = None) -> torch.Tensor:
        scale = input_std(self.problem) if scale is None else scale
        self.randomise(a, b, scale=scale)
        # a bias and a residual of the products' size: dropping either, or adding it after rounding, is plain in the
        # error
        self.randomise(bias, r, scale=scale * scale * a.cols ** 0.5)
        out = self.run(a, b, c, bias, r)
        self.verify(out, a.tensor, b.tensor, _row(bias), self._shape(c, a), residual=_whole(r))
        rerun = self.run(a, b, c, bias, r, garbage=True)
        if self.deterministic and not same_bits(rerun, out):
            raise CheckFailed(f"nondeterministic, or the output depends on what C held before the launch "
                              f"({self._shape(c, a)})")
        if not self.deterministic:
            self.verify(rerun, a.tensor, b.tensor, _row(bias), self._shape(c, a), residual=_whole(r))
        return out

    def check_in_place(self, a: GuardedStack, b: GuardedStack, c: GuardedStack, bias: GuardedStack | None,
                       r: GuardedStack) -> None:
        """A residual epilogue with R the output itself (C += A B + bias, as a model's residual stream): C starts as
        R's values and must end as the result on them."""
        self.randomise(a, b)
        self.randomise(bias, r, scale=a.cols ** 0.5)
        c.tensor.copy_(r.tensor)
        self.scrub()
        self.launch(a.tensor, b.tensor, c.tensor, c.rows, self.gemm_n(b), a.cols, _row(bias), c.tensor)
        synchronize()
        if not c.guards_intact():
            raise CheckFailed(f"out-of-bounds write: a guard region next to an operand changed (in place, "
                              f"{self._shape(c, a)})")
        self.verify(c.tensor.clone(), a.tensor, b.tensor, _row(bias), f"in place (R is C), {self._shape(c, a)}",
                    residual=r.tensor)

    def verify(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, shape: str,
               what: str = "wrong result", residual: torch.Tensor | None = None) -> None:
        """The error bounds against the fp64 reference, relative to cuBLAS's own error on the same inputs."""
        self.verify_batch(out[None], a[None], b[None], None if bias is None else bias[None], shape, [what],
                          None if residual is None else residual[None])

    def verify_batch(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                     shape: str, what: list[str], residual: torch.Tensor | None = None) -> None:
        """`verify` on S outputs at once, with one host synchronisation: out [S, M, N'], a [S, M, K], b [S, K, N]
        ([S, N, K] for nk), bias [S, N] or None and residual [S, M, N] or None, where S may be 1 for b and bias
        (shared); what[i] names output i in a finding. Each output passes or fails exactly as it would alone."""
        ref, cublas = reference(a, b if self.problem.b_layout == "kn" else b.transpose(-1, -2), bias,
                                self.epilogue, residual)
        out = out.double()
        finite = torch.isfinite(out).flatten(1).all(1)
        err, cub_err = _rel_fro(out, ref), _rel_fro(cublas, ref)
        diff, cub_diff = (out - ref).abs(), (cublas - ref).abs().flatten(1).amax(1)
        too_far = diff > ERR_FACTOR * cub_diff[:, None, None] + _ulp(ref, self.dtype)
        bad = ~finite | (err > ERR_FACTOR * cub_err + 1e-6) | too_far.flatten(1).any(1)
        flags, errs, cub_errs = torch.stack([bad.double(), err, cub_err]).tolist()  # the one synchronisation
        if any(flags):
            i = flags.index(1.0)
            if not finite[i]:
                raise CheckFailed(f"{what[i]}: NaN or Inf in the output ({shape})")
            where = too_far[i].nonzero()[0].tolist() if too_far[i].any() else "overall"
            raise CheckFailed(f"{what[i]}: relative error {errs[i]:.2e} vs cuBLAS {cub_errs[i]:.2e}, "
                              f"first bad element {where} ({shape})")
        self.rel_err, self.cublas_rel_err = max(self.rel_err, *errs), max(self.cublas_rel_err, *cub_errs)

    def sample_rows(self, m: int, outputs: int, samples: int = 64) -> torch.Tensor:
        """For each of `outputs` M-row outputs, its own random sample of row indices: [outputs, min(M, samples)]."""
        return torch.rand(outputs, m, generator=self.gen, device=DEVICE).argsort(dim=1)[:, :samples]

    def check_exact(self, a: GuardedStack, b: GuardedStack, c: GuardedStack, bias: GuardedStack | None,
                    r: GuardedStack | None, low: int) -> None:
        """Integer inputs from {low..1} (and such a bias and residual): every result the dtype holds exactly must come
        out exact."""
        for t in (a, b, bias, r):
            if t is not None:
                t.tensor.copy_(torch.randint(low, 2, (t.rows, t.cols), generator=self.gen, device=DEVICE))
        out, ref = self._run_integers(a, b, c, bias, r)
        bad = (ref.abs() <= EXACT_LIMIT[self.dtype]) & (out != ref)
        self._name_first(bad, out, ref, f"wrong result on integer inputs {{{low}..1}}", c, a)

    def check_rounding(self, a: GuardedStack, b: GuardedStack, c: GuardedStack, bias: GuardedStack | None,
                       r: GuardedStack | None) -> None:
        """Integer inputs in [-8, 8] and a bias (and residual) in quarters: every product and partial sum is exact in
        fp32, so each output must be the exact result rounded once to the dtype, bit for bit. The sums reach past the
        dtype's exact integers, so a sum rounded twice (before the bias or residual is added, or through fp16 on the
        way to bf16) shows."""
        for t in (a, b):
            t.tensor.copy_(torch.randint(-8, 9, (t.rows, t.cols), generator=self.gen, device=DEVICE))
        for t in (bias, r):
            if t is not None:
                t.tensor.copy_(torch.randint(-256, 257, (t.rows, t.cols), generator=self.gen, device=DEVICE) / 4)
        out, ref = self._run_integers(a, b, c, bias, r)
        rounded = ref.to(TORCH_DTYPE[self.dtype]).double()
        self._name_first(out != rounded, out, rounded, "wrong result on integer inputs {-8..8}, rounded once", c, a)

    def _run_integers(self, a, b, c, bias, r) -> tuple[torch.Tensor, torch.Tensor]:
        """The output on integer inputs, and its exact value (the epilogue's without activation, or relu)."""
        out = self.run(a, b, c, bias, r).double()
        ref = a.tensor.double() @ self.b_as_kn(b.tensor).double()
        if bias is not None:
            ref += bias.tensor[0].double()
        return out, apply_epilogue(ref, self.epilogue, _whole(r))

    def _name_first(self, bad: torch.Tensor, out: torch.Tensor, ref: torch.Tensor, what: str, c, a) -> None:
        if bad.any():
            r, col = bad.nonzero()[0].tolist()
            raise CheckFailed(f"{what}: C[{r},{col}] = {out[r, col].item():g}, expected {ref[r, col].item():g} "
                              f"({self._shape(c, a)})")

    def check_all(self, problem: Problem) -> None:
        """Raises CheckFailed with the first finding; returns quietly when every check passes."""
        for i, (m, n, k) in enumerate(edge_shapes(problem, self.seed)):
            bufs = self.buffers(m, n, k)
            self.check_random(*bufs)
            # exact checks on the target and the tiny ragged shape, in the same buffers, where exact results exist
            if i in (0, 1) and self.epilogue.exact:
                self.check_exact(*bufs, low=0)
                self.check_rounding(*bufs)
            if i in (0, 1) and self.epilogue.residual:
                self.check_in_place(*bufs)
            if i in (0, 1) and self.epilogue.activation != "none":  # sums of a few units: the activation's curve
                self.check_random(*bufs, scale=(ACT_STD / k ** 0.5) ** 0.5)
            if i == 1 and self.dtype == "bf16":
                self.check_random(*bufs, scale=RANGE_SCALE)
            del bufs
        target = edge_shapes(problem, self.seed)[0]
        overlaps = getattr(self.launch, "overlaps", None)
        if overlaps is not None and overlaps(*target):  # last, so that every other finding is named first
            from sandbox.overlap_check import check_overlapped

            bufs = self.buffers(*target)
            check_overlapped(self, *bufs, expected=self.check_random(*bufs))

    @staticmethod
    def _shape(c: GuardedStack, a: GuardedStack) -> str:
        return f"M={c.rows} N={c.cols} K={a.cols}"


def _row(t: GuardedStack | None) -> torch.Tensor | None:
    """A one-row operand (the bias) as a vector."""
    return None if t is None else t.tensor[0]


def _whole(t: GuardedStack | None) -> torch.Tensor | None:
    return None if t is None else t.tensor


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))


def _rel_fro(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per matrix of a batch [S, M, N]: ||x - ref|| / ||ref|| (Frobenius), on the device."""
    return torch.linalg.norm((x - ref).flatten(1), dim=1) / torch.linalg.norm(ref.flatten(1), dim=1).clamp_min(1e-30)


def _ulp(ref: torch.Tensor, dtype: str) -> torch.Tensor:
    """Spacing of the dtype's numbers at each reference value (subnormal spacing near zero)."""
    exp = torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** MIN_NORMAL_EXP[dtype])))
    return torch.pow(2.0, exp - MANTISSA_BITS[dtype])
