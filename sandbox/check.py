"""Correctness checks that a fast-but-wrong kernel cannot pass (GPU worker only).

Every candidate, before it is timed, on the target shape and on edge shapes:
- fresh random normal inputs, an fp64 reference, and cuBLAS's own error on the same inputs. Accepted when the
  candidate's relative Frobenius error is at most ERR_FACTOR x cuBLAS's (plus a tiny absolute slack) and its
  largest element error at most ERR_FACTOR x cuBLAS's largest plus one fp16 ulp of that element. Why 2x: with fp32
  accumulation the error is dominated by the final rounding to fp16, the same for any summation order, so a correct
  kernel lands at about 1.0x; accumulating in fp16, or dropping a K slice, lands far above 2x.
- exact checks: inputs from {0, 1} and {-1, 0, 1}, so every dot product is an integer; where it is representable
  in fp16 (|x| <= 2048) the output must equal it exactly. They reuse the random check's buffers, so a kernel
  that returns a result cached from a previous call (a device-side memo) is caught;
- the output poisoned with NaN before each launch (unwritten elements stay NaN), guard regions around inputs and
  output (out-of-bounds writes), inputs compared bit for bit afterwards (a kernel must not write its inputs),
  shared memory filled with NaN before each launch (reads of uninitialised shared memory),
- the same inputs launched twice must give identical bits unless the family declares itself nondeterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.records import Problem

ERR_FACTOR = 2.0
POISON = 0x7E00  # fp16 quiet NaN
GUARD = 0x7E55  # a NaN with a payload no arithmetic produces
EXACT_LIMIT = 2048  # largest integer range fp16 holds exactly

Launch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int], None]


class CheckFailed(Exception):
    """A correctness finding; its message is the reason recorded with the candidate."""


@dataclass
class Guarded:
    """A 2-D fp16 tensor inside a larger allocation whose margins hold a sentinel pattern."""

    rows: int
    cols: int

    def __post_init__(self) -> None:
        self.margin = 256 * self.cols + 4096  # a whole tile-row overrun stays inside the margin
        self.flat = torch.full((self.rows * self.cols + 2 * self.margin,), GUARD, dtype=torch.int16, device="cuda")
        self.tensor = self.flat[self.margin:self.margin + self.rows * self.cols].view(torch.float16)
        self.tensor = self.tensor.view(self.rows, self.cols)

    def guards_intact(self) -> bool:
        head, tail = self.flat[: self.margin], self.flat[self.margin + self.rows * self.cols:]
        return bool((head == GUARD).all() and (tail == GUARD).all())


def edge_shapes(problem: Problem) -> list[tuple[int, int, int]]:
    """The target, a tiny ragged shape, and shapes just off the target's tile multiples."""
    m, n, k = problem.m, problem.n, problem.k
    shapes = [(m, n, k), (17, 24, 40), (1, 8, 8)]
    shapes.append((min(m, 300) + 13, min(n, 256) + 24, min(k, 512) + 8))
    shapes.append((max(1, m - 1), max(8, n - 8), max(8, k - 8)))
    return list(dict.fromkeys(shapes))


class Checker:
    def __init__(self, launch: Launch, b_layout: str, *, deterministic: bool = True,
                 scrub: Callable[[], None] | None = None, seed: int = 0):
        self.launch, self.b_layout, self.deterministic = launch, b_layout, deterministic
        self.scrub = scrub or (lambda: None)
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.rel_err = self.cublas_rel_err = 0.0

    def buffers(self, m: int, n: int, k: int) -> tuple[Guarded, Guarded, Guarded]:
        b = Guarded(k, n) if self.b_layout == "kn" else Guarded(n, k)
        return Guarded(m, k), b, Guarded(m, n)

    def b_as_kn(self, b: torch.Tensor) -> torch.Tensor:
        return b if self.b_layout == "kn" else b.t()

    def run(self, a: Guarded, b: Guarded, c: Guarded, garbage: bool = False) -> torch.Tensor:
        """Poison (or fill with finite garbage), scrub, launch once; return the output after the memory checks.

        A kernel that writes only where C holds the poison passes a poisoned launch; the garbage fill catches it."""
        a_before, b_before = a.tensor.clone(), b.tensor.clone()
        if garbage:
            c.tensor.copy_(torch.rand(c.rows, c.cols, generator=self.gen, device="cuda") * 1000 - 500)
        else:
            c.tensor.view(torch.int16).fill_(POISON)
        self.scrub()
        self.launch(a.tensor, b.tensor, c.tensor, c.rows, c.cols, a.cols)
        torch.cuda.synchronize()  # a CUDA fault surfaces here, as an exception the worker reports
        if not (c.guards_intact() and a.guards_intact() and b.guards_intact()):
            raise CheckFailed(f"out-of-bounds write: a guard region next to an operand changed ({self._shape(c, a)})")
        if not (_same_bits(a.tensor, a_before) and _same_bits(b.tensor, b_before)):
            raise CheckFailed(f"the kernel modified its inputs ({self._shape(c, a)})")
        out = c.tensor.clone()
        bits = out.view(torch.int16)
        if (bits == POISON).any():
            r, col = (bits == POISON).nonzero()[0].tolist()
            raise CheckFailed(f"unwritten output: C[{r},{col}] still holds the poison ({self._shape(c, a)})")
        if not torch.isfinite(out).all():
            raise CheckFailed(f"NaN or Inf in the output ({self._shape(c, a)})")
        return out

    def randomise(self, *tensors: Guarded) -> None:
        for t in tensors:
            t.tensor.copy_(torch.randn(t.rows, t.cols, generator=self.gen, device="cuda"))

    def check_random(self, a: Guarded, b: Guarded, c: Guarded) -> torch.Tensor:
        self.randomise(a, b)
        out = self.run(a, b, c)
        self.verify(out, a, b, self._shape(c, a))
        rerun = self.run(a, b, c, garbage=True)
        if self.deterministic and not _same_bits(rerun, out):
            raise CheckFailed(f"nondeterministic, or the output depends on what C held before the launch "
                              f"({self._shape(c, a)})")
        if not self.deterministic:
            self.verify(rerun, a, b, self._shape(c, a))
        return out

    def verify(self, out: torch.Tensor, a: Guarded, b: Guarded, shape: str, what: str = "wrong result") -> None:
        """The error bound against the fp64 reference, relative to cuBLAS's own error on the same inputs."""
        ref = a.tensor.double() @ self.b_as_kn(b.tensor).double()
        cublas = (a.tensor @ self.b_as_kn(b.tensor)).double()
        err, cub_err = _rel_fro(out.double(), ref), _rel_fro(cublas, ref)
        diff, cub_diff = (out.double() - ref).abs(), (cublas - ref).abs()
        ulp = _fp16_ulp(ref)
        too_far = diff > ERR_FACTOR * cub_diff.max() + ulp
        if not torch.isfinite(out).all():
            raise CheckFailed(f"{what}: NaN or Inf in the output ({shape})")
        if err > ERR_FACTOR * cub_err + 1e-6 or too_far.any():
            where = too_far.nonzero()[0].tolist() if too_far.any() else "overall"
            raise CheckFailed(f"{what}: relative error {err:.2e} vs cuBLAS {cub_err:.2e}, "
                              f"first bad element {where} ({shape})")
        self.rel_err, self.cublas_rel_err = max(self.rel_err, err), max(self.cublas_rel_err, cub_err)

    def check_exact(self, a: Guarded, b: Guarded, c: Guarded, low: int) -> None:
        for t in (a, b):
            t.tensor.copy_(torch.randint(low, 2, (t.rows, t.cols), generator=self.gen, device="cuda"))
        out = self.run(a, b, c).double()
        ref = a.tensor.double() @ self.b_as_kn(b.tensor).double()
        exact = ref.abs() <= EXACT_LIMIT
        bad = exact & (out != ref)
        if bad.any():
            r, col = bad.nonzero()[0].tolist()
            raise CheckFailed(f"wrong result on integer inputs {{{low}..1}}: C[{r},{col}] = {out[r, col].item():g}, "
                              f"exact {ref[r, col].item():g} ({self._shape(c, a)})")

    def check_all(self, problem: Problem) -> None:
        """Raises CheckFailed with the first finding; returns quietly when every check passes."""
        for i, (m, n, k) in enumerate(edge_shapes(problem)):
            bufs = self.buffers(m, n, k)
            self.check_random(*bufs)
            if i in (0, 1):  # exact checks on the target and the tiny ragged shape, in the same buffers
                self.check_exact(*bufs, low=0)
                self.check_exact(*bufs, low=-1)
            del bufs

    @staticmethod
    def _shape(c: Guarded, a: Guarded) -> str:
        return f"M={c.rows} N={c.cols} K={a.cols}"


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return bool(torch.equal(x.view(torch.int16), y.view(torch.int16)))


def _rel_fro(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.norm(x - ref) / torch.linalg.norm(ref).clamp_min(1e-30))


def _fp16_ulp(ref: torch.Tensor) -> torch.Tensor:
    """Spacing of fp16 numbers at each reference value (subnormal spacing near zero)."""
    exp = torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -14)))
    return torch.pow(2.0, exp - 10)
