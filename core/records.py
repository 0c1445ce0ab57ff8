"""Typed, immutable records passed between the pipeline's stages.

A failure is data in a record (with its log), never an exception that crosses a stage boundary.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal

from core.epilogue import Epilogue
from core.overlap import waits
from core.plan import ceil_div

B_LAYOUTS = ("kn", "nk")  # kn: B is K x N row-major (torch.matmul); nk: N x K row-major (nn.Linear weight)
DTYPES = ("f16", "bf16")  # inputs and output; accumulation is fp32 in both
INT32_MAX = 2**31 - 1  # kernels take M, N, K as 32-bit ints, and so do their element offsets in places


@dataclass(frozen=True)
class Problem:
    """C = epilogue(A[M,K] @ B (+ bias[N] when `bias`)), 16-bit inputs and output (`dtype`), fp32 accumulation;
    N is the GEMM's (B's columns); C has N columns, or N / 2 for a gated epilogue (core/epilogue.py).

    With `m_range` (lo, hi) the problem is every M from lo to hi (a bucket of M, or a range a shapes file gives);
    `m` is then the representative M it is searched and timed at, inside the range."""

    m: int
    n: int
    k: int
    b_layout: str = "kn"
    dtype: str = "f16"
    bias: bool = False
    epilogue: str = "none"
    m_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.m_range is not None:
            object.__setattr__(self, "m_range", tuple(self.m_range))  # from JSON: a list
            lo, hi = self.m_range
            if lo < 1:
                raise ValueError(f"M must be positive, got the range {self.mnk}")
            if lo > hi:
                raise ValueError(f"the M range {lo}-{hi} is empty (reversed): write it low-high, e.g. {hi}-{lo}")
            if not lo <= self.m <= hi:
                raise ValueError(f"the representative M={self.m} lies outside the range {lo}-{hi}")
        if min(self.m, self.n, self.k) < 1:
            raise ValueError(f"M, N and K must be positive, got {self.mnk}")
        if self.n % 8 or self.k % 8:
            raise ValueError(f"N and K must be multiples of 8 (16-byte rows), got {self.mnk}")
        m = self.m_span[1]
        for name, elements in (("A", m * self.k), ("B", self.k * self.n), ("C", m * self.n)):
            if elements > INT32_MAX:
                raise ValueError(f"{name} would have {elements:.3g} elements; the kernels index operands with 32-bit "
                                 f"ints, so each may have at most {INT32_MAX} (2^31 - 1)")
        if self.b_layout not in B_LAYOUTS:
            raise ValueError(f"unknown B layout {self.b_layout!r}: use one of {', '.join(B_LAYOUTS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if (why := Epilogue(self.epilogue).check_n(self.n)) is not None:
            raise ValueError(why)

    @property
    def fused(self) -> Epilogue:
        """The epilogue's definition (activation, gated, residual)."""
        return Epilogue(self.epilogue)

    @property
    def out_n(self) -> int:
        """Columns of C."""
        return self.fused.out_cols(self.n)

    @property
    def m_span(self) -> tuple[int, int]:
        """The M values the problem stands for: its range, or (m, m)."""
        return self.m_range or (self.m, self.m)

    @property
    def mnk(self) -> str:
        """M_N_K, with M written lo-hi where the problem is a range of M."""
        m = f"{self.m_range[0]}-{self.m_range[1]}" if self.m_range else str(self.m)
        return f"{m}_{self.n}_{self.k}"

    @property
    def key(self) -> str:
        """M_N_K:layout:dtype, then :bias where a bias is added and :EPILOGUE where one is fused: how shapes files and
        tables name a problem (M as lo-hi for a range; a problem of one M keeps the key it always had)."""
        return (f"{self.mnk}:{self.b_layout}:{self.dtype}" + (":bias" if self.bias else "")
                + (f":{self.epilogue}" if self.epilogue != "none" else ""))

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def operand_bytes(self) -> int:
        """A, B and C (and the bias, and R of a residual epilogue), each element 2 bytes."""
        residual = self.m * self.n if self.fused.residual else 0
        return 2 * (self.m * self.k + self.k * self.n + self.m * self.out_n + (self.n if self.bias else 0) + residual)

    def tiles(self, block_m: int, block_n: int) -> int:
        """C tiles of block_m x block_n that cover the M x N output."""
        return ceil_div(self.m, block_m) * ceil_div(self.n, block_n)


@dataclass(frozen=True)
class TextEdit:
    """One step of a patch: `search` occurs exactly once in the text as the earlier steps left it."""

    search: str
    replace: str


@dataclass(frozen=True)
class Patch:
    """Where a patched template came from: the text the edits were applied to (a family's template, named by the
    family, or an edited candidate's, named by its id) and the edits, in order."""

    base: str
    edits: tuple[TextEdit, ...]

    def to_json(self) -> str:
        return json.dumps({"base": self.base, "edits": [[e.search, e.replace] for e in self.edits]})

    @classmethod
    def from_json(cls, text: str) -> Patch:
        d = json.loads(text)
        return cls(d["base"], tuple(TextEdit(s, r) for s, r in d["edits"]))


@dataclass(frozen=True)
class Candidate:
    """One kernel proposal: a template family, its parameters, and optionally an edited template source."""

    problem: Problem
    family: str
    params: dict[str, Any]
    origin: str = "builtin"  # which proposer made it; part of the bandit arm
    rationale: str = ""
    template_override: str | None = None  # an edited template (from an LLM) replacing the family's own
    patch: Patch | None = None  # how template_override was made, where it is a patch; provenance, not content

    @property
    def id(self) -> str:
        """Content id: the same proposal for the same problem always gets the same id. What is compiled decides it,
        not how the text was made: patches from different bases that yield the same template share an id (the
        first one proposed is the one recorded), as do a patch and a whole-template edit with the same result."""
        blob = json.dumps(
            [self.problem.key, self.family, self.params, self.template_override], sort_keys=True
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def arm(self) -> str:
        return f"{self.origin}:{self.family}"

    @property
    def kind(self) -> str:
        """params (the family's own template), patch (search/replace edits of a template) or edit (a whole one)."""
        return "params" if self.template_override is None else "patch" if self.patch else "edit"


@dataclass(frozen=True)
class TensorMapSpec:
    """A TMA tensor map the host encodes for each launch over operand A, B, C or the residual R (packed fp16, rows
    contiguous) and passes by value after the fixed arguments (and the bias and R pointers)."""

    operand: Literal["A", "B", "C", "R"]
    dims: tuple[int, ...]  # elements per dimension, innermost first
    box: tuple[int, ...]  # the tile one TMA copy moves, innermost first
    swizzle: int = 128  # bytes: 0, 32, 64 or 128
    # byte strides of dims[1:], in any order (a view such as B's 64-column panels as a third dimension); empty: the
    # packed tensor (rows contiguous). The family keeps every address such a view reaches inside the operand.
    strides: tuple[int, ...] = ()


@dataclass(frozen=True)
class LaunchSpec:
    """How the trusted host side launches a rendered kernel (never supplied by a proposer)."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    kernel_name: str = "hgemm"
    tensor_maps: tuple[TensorMapSpec, ...] = ()
    # > 0 (either): the kernel takes two more pointers, a scratch buffer of at least workspace_bytes (split-K partial
    # tiles) and a zeroed array of at least `counters` 32-bit counters that it leaves zeroed; sandbox.driver keeps
    # one of each per GPU
    workspace_bytes: int = 0
    counters: int = 0
    # True: the kernel waits for the kernel ahead of it before touching its operands (core/overlap.py), so it may be
    # launched overlapped with it; the sandbox checks that it does, and the export launches it so
    overlap: bool = False


@dataclass(frozen=True)
class BuildResult:
    candidate_id: str
    ok: bool
    arch: str
    source: str
    cubin: bytes | None = None
    log: str = ""
    registers: int | None = None
    smem_static: int | None = None
    spill_bytes: int | None = None
    stack_bytes: int | None = None
    compile_s: float = 0.0
    cached: bool = False
    error: str = ""


class Status(StrEnum):
    OK = "ok"
    INVALID = "invalid"  # parameters rejected by the family's space before compiling
    COMPILE_ERROR = "compile_error"
    WRONG = "wrong"  # ran, but failed a correctness check
    FAULT = "fault"  # CUDA error (illegal address, trap, ...) or worker crash
    TIMEOUT = "timeout"
    SKIPPED = "skipped"  # compile-only runs


@dataclass(frozen=True)
class Timing:
    """Device time per launch in microseconds: median and spread (min..max of graph replays), and the kernels' own
    duration per launch as CUPTI reports it for one replay (no launch gaps; warm timings only)."""

    median_us: float
    min_us: float
    max_us: float
    launches: int
    cupti_us: float | None = None

    def cupti_ratio(self, ours: Timing | None) -> float | None:
        """This timing's CUPTI kernel duration over `ours`' (cuBLAS's over a candidate's: the CUPTI speed-up); None
        where either has none."""
        return self.cupti_us / ours.cupti_us if ours and self.cupti_us and ours.cupti_us else None

    @property
    def spread(self) -> float:
        return (self.max_us - self.min_us) / self.median_us if self.median_us > 0 else math.inf


@dataclass(frozen=True)
class EvalResult:
    candidate_id: str
    status: Status
    reason: str = ""
    warm: Timing | None = None
    cold: Timing | None = None
    cublas_warm: Timing | None = None
    cublas_cold: Timing | None = None
    # the re-check of a candidate whose warm time looked too good next to its cold one: each launch on new inputs
    fresh: Timing | None = None
    cublas_fresh: Timing | None = None
    # the figure that ranks past the first screen (re-measurements, bench): every operand of every launch refilled
    # just before it, so that no launch can reuse earlier work
    honest: Timing | None = None
    cublas_honest: Timing | None = None
    max_rel_err: float | None = None
    cublas_rel_err: float | None = None
    device: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def ranked(self) -> tuple[Timing | None, Timing | None]:
        """The candidate's and cuBLAS's timings that rank it: honest where measured, else warm (the first screen)."""
        return (self.honest, self.cublas_honest) if self.honest else (self.warm, self.cublas_warm)

    @property
    def time_us(self) -> float:
        """The score: honest device time where measured, else warm; inf for anything that failed."""
        ours = self.ranked[0]
        return ours.median_us if self.status is Status.OK and ours else math.inf

    @property
    def cold_over_warm(self) -> float | None:
        """How much slower the candidate ran with a cold L2 than a warm one (cuBLAS's own is beside it)."""
        return self.cold.median_us / self.warm.median_us if self.cold and self.warm and self.warm.median_us else None

    @property
    def speedup(self) -> float | None:
        """t_cuBLAS / t_candidate, measured in the same process (honest where measured, else warm)."""
        ours, theirs = self.ranked
        if self.status is not Status.OK or not ours or not theirs:
            return None
        return theirs.median_us / ours.median_us

    def to_json(self) -> str:
        d = asdict(self)
        d["status"] = self.status.value
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> EvalResult:
        d = json.loads(text)
        d["status"] = Status(d["status"])
        for key in ("warm", "cold", "cublas_warm", "cublas_cold", "fresh", "cublas_fresh", "honest", "cublas_honest"):
            if d.get(key):
                d[key] = Timing(**d[key])
        return cls(**d)


@dataclass(frozen=True)
class EvalJob:
    """What the agent sends a GPU worker: a compiled candidate and how to launch it (by family name)."""

    candidate_id: str
    problem: Problem
    family: str
    params: dict[str, Any]
    cubin: bytes
    timeout_s: float = 5.0  # slack beyond the expected time of each GPU phase before the worker is killed
    time_it: bool = True
    seed: int | None = None  # None: the worker draws fresh random inputs each time
    honest: bool = False  # also time it honestly (sandbox/timed.py), the figure that then ranks it
    honest_only: bool = False  # a re-measurement: the honest timing alone (warm and cold are the first screen's)
    overlap: bool = False  # its source waits for the kernel ahead (core/overlap.waits): checked launched overlapped

    @classmethod
    def built(cls, cid: str, problem: Problem, family: str, params: dict[str, Any], build: BuildResult,
              **options: Any) -> EvalJob:
        """The job for a built candidate: its cubin, checked launched overlapped where its source waits."""
        return cls(cid, problem, family, params, build.cubin, overlap=waits(build.source), **options)


@dataclass(frozen=True)
class BaselineJob:
    """Time cuBLAS alone for a problem (shapes where no kernel beat it)."""

    problem: Problem
    timeout_s: float = 5.0
    candidate_id: str = "cublas"
    honest: bool = False


@dataclass(frozen=True)
class ProfileResult:
    """Nsight Compute's view of one candidate: named metrics (percentages, µs) and a one-line verdict."""

    ok: bool
    metrics: dict[str, float] = field(default_factory=dict)
    summary: str = ""  # e.g. "L2 hit 62%, DRAM 85% busy, SM 40%: memory-bound; top stalls long_scoreboard 41%"
    error: str = ""


@dataclass(frozen=True)
class ProposalFate:
    """What became of one proposal in a model's reply: accepted as candidate `candidate_id`, a duplicate of
    candidate `candidate_id` (already tried or queued), or refused before compiling for `reason`."""

    kind: str  # params, edit or patch
    family: str
    outcome: Literal["accepted", "duplicate", "refused"]
    base: str | None = None  # a patch's base: a family name or a candidate id
    candidate_id: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class ModelCall:
    """One request to a model for one problem: its tokens, what its prompt left out to fit the prompt budget, and
    what became of each proposal in the reply (or why the reply or the request failed)."""

    problem_key: str
    purpose: Literal["propose", "resend"]  # resend: the previous reply could not be used and was sent back
    prompt_tokens: int
    completion_tokens: int
    tokens_estimated: bool = False
    left_out: tuple[str, ...] = ()
    proposals: tuple[ProposalFate, ...] = ()
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelCall:
        d = json.loads(text)
        return cls(**{**d, "left_out": tuple(d["left_out"]),
                      "proposals": tuple(ProposalFate(**f) for f in d["proposals"])})
