"""What every kernel template family provides: a typed parameter space, a Jinja source and a launch rule.

A family is trusted host code (parameter checks, launch geometry); the Jinja template is device code, the only
part a proposer may edit. Every kernel takes the same arguments, whatever the family:

    extern "C" __global__ void hgemm(const unsigned short* A, const unsigned short* B,
                                     unsigned short* C, int M, int N, int K[, const unsigned short* bias])

A is M x K row-major; B is K x N row-major (layout "kn") or N x K row-major ("nk"); C is M x N row-major;
elements are 16-bit patterns of the problem's dtype (fp16 or bf16), accumulated in fp32. Where the problem has a
bias, `bias` (N elements of the same dtype) follows K and C = A B + bias, the bias added in fp32 before the one
rounding to the output dtype. Where it fuses an epilogue (core/epilogue.py), the kernel applies it in fp32 before
that rounding: a residual epilogue takes `R` (M x N, the dtype's; it may be C itself) after the bias (or K), and a
gated one writes C with N / 2 columns (row stride N / 2). Tensor maps, then workspace and counters, come after
these (the launch rule says which). M >= 1 is arbitrary, N and K are multiples of 8; A, B, C, the bias and R start
16-byte aligned (kernels move them in 16-byte chunks). Templates see the problem's `b_layout`, `dtype`, `bias` and
its epilogue (Family.problem_variables).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, ValidationError

from core.device import H200, DeviceFacts
from core.epilogue import EPILOGUES, Epilogue, cuda_code
from core.overlap import OVERLAP_CUDA
from core.records import LaunchSpec, Problem
from core.source import source_problem
from core.validation import validation_message

# a sandboxed environment: an edited template from an LLM is untrusted text, and must not reach Python
_ENV = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


@functools.lru_cache(maxsize=32)
def _compiled(text: str) -> jinja2.Template:
    """A template's text compiled once: compiling is nearly all of a render's time, which every candidate and every
    compile started ahead would otherwise pay again, between the GPU's evaluations."""
    return _ENV.from_string(text)


@functools.lru_cache(maxsize=16)
def _read(path: Path) -> str:
    return path.read_text()


class Params(BaseModel):
    """Base of every family's parameter model: frozen, no unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Family(ABC):
    name: ClassVar[str]
    arches: ClassVar[tuple[str, ...]]  # NVRTC targets it compiles for, e.g. ("sm_90a", "sm_80")
    params_model: ClassVar[type[Params]]
    template_file: ClassVar[str] = "kernel.cu.j2"
    description: ClassVar[str] = ""
    searched: ClassVar[bool] = True  # False: the built-in search skips it (reference and base families)
    prompted: ClassVar[bool] = True  # False: not shown to the LLM proposer either (not yet checked on a GPU)
    deterministic: ClassVar[bool] = True  # False only for families that reduce with atomics in any order
    # The share of a device's dense tensor rate the family's kernels reach on large problems, by the arch they run
    # as (the bandit's roofline prior, agent.proposers.builtin.roofline_priors); without one: no such prior.
    tensor_share: ClassVar[dict[str, float]] = {}

    @property
    def folder(self) -> Path:
        return Path(__file__).parent / self.name

    def template_source(self) -> str:
        return _read(self.folder / self.template_file)

    def parse(self, params: dict[str, Any], problem: Problem) -> Params:
        """Validate parameters for a problem; raises ValueError naming what is impossible."""
        self.check_problem(problem)
        try:
            p = self.params_model(**params)
        except ValidationError as e:
            raise ValueError(validation_message(e)) from None
        self.check_for_problem(p, problem)
        return p

    supports: ClassVar[tuple[tuple[str, bool], ...]] = (("f16", False), ("f16", True), ("bf16", False),
                                                         ("bf16", True))  # (dtype, bias) the template handles
    epilogues: ClassVar[tuple[str, ...]] = EPILOGUES  # the fused epilogues the template renders

    def check_for_problem(self, params: Params, problem: Problem) -> None:  # noqa: B027 - optional hook
        """Reject combinations that are fine in general but not for this problem."""

    def check_problem(self, problem: Problem) -> None:
        """ValueError where the template cannot compute this problem's dtype or bias at all."""
        if (problem.dtype, problem.bias) not in self.supports:
            what = problem.dtype + (" with a bias" if problem.bias else "")
            raise ValueError(f"family {self.name} does not handle {what} yet")
        if problem.epilogue not in self.epilogues:
            raise ValueError(f"family {self.name} does not fuse the {problem.epilogue} epilogue")

    def render(self, params: dict[str, Any], problem: Problem, template: str | None = None) -> str:
        """The kernel source for these parameters and this problem, from the family's template or an edited one;
        ValueError says what is wrong (invalid parameters, a template that does not render in Jinja's sandbox, a
        source that reads host files or lacks the entry point)."""
        p = self.parse(params, problem)
        try:
            text = _compiled(template if template is not None else self.template_source())
            source = text.render(**p.model_dump(), **self.derived(p), **self.problem_variables(problem),
                                 overlap_code=OVERLAP_CUDA)
        except Exception as e:  # syntax, undefined names, sandbox refusals, errors in template expressions
            raise ValueError(f"the template does not render: {type(e).__name__}: {e}") from None
        if (why := source_problem(source)) is not None:
            raise ValueError(why)
        return source

    @staticmethod
    def problem_variables(problem: Problem) -> dict[str, Any]:
        """What a template knows of the problem beyond its parameters (M, N, K are kernel arguments): the layout, the
        dtype, the bias and the fused epilogue (its activation, whether gated or residual, the device functions
        act() / gate() that compute it, and C's definition for the source's header)."""
        epi = Epilogue(problem.epilogue)
        return {"b_layout": problem.b_layout, "dtype": problem.dtype, "bias": problem.bias,
                "activation": epi.activation, "gated": epi.gated, "residual": epi.residual,
                "epilogue_code": cuda_code(epi, problem.dtype), "epilogue_formula": epi.formula(problem.bias)}

    def norm_options(self, params: dict[str, Any], problem: Problem) -> tuple[str, ...] | None:
        """The compiler options that build this setting's kernel with an RMSNorm of A's rows ahead of the GEMM (the
        variant hgemm::norm_linear runs, agent/export/writer.py), or None where the family's template has none or not
        for this problem."""
        return None

    def derived(self, params: Params) -> dict[str, Any]:
        """Extra template variables computed from the parameters (threads, warp counts, ...)."""
        return {}

    @abstractmethod
    def launch(self, params: dict[str, Any], problem: Problem, device: DeviceFacts = H200) -> LaunchSpec:
        """Grid, block and dynamic shared memory for these parameters, this problem's M, N, K and this GPU."""

    @abstractmethod
    def space(self, problem: Problem, device: DeviceFacts = H200) -> list[dict[str, Any]]:
        """The valid parameter settings worth trying for this problem on this GPU, best guesses first."""

    def describe_space(self) -> dict[str, Any]:
        """The parameter schema, as a prompt shows it."""
        return self.params_model.model_json_schema()

