"""Fused epilogues: what a kernel applies to A·B (+ bias) in fp32 before its one rounding, defined once.

- `none`: C = A·B (+ bias);
- `relu`, `silu`, `gelu_tanh`, `gelu`, `relu2`: C = act(A·B + bias), act as PyTorch's F.relu, F.silu,
  F.gelu(approximate="tanh"), F.gelu (the exact, erf GELU), relu squared;
- `silu_mul`, `gelu_mul` (gated: SwiGLU, GeGLU): B holds the gate and up projections of the same output columns,
  interleaved in blocks of GATE_BLOCK columns (GEMM columns 16g..16g+7 are gate columns 8g..8g+7, 16g+8..16g+15 the
  up columns 8g..8g+7; for an N x K weight, rows), so that one tile holds both; C has N / 2 columns,
  C = act(gate + bias_gate) * (up + bias_up), and gate and up never reach memory;
- `residual`: C = A·B + bias + R, R an M x N tensor of the output's dtype (R may be C itself: in place).

The kernels compute this in fp32 and round once (the CUDA text below is what every family renders); the model it
replaces runs a GEMM rounded to its dtype and then PyTorch's elementwise ops, each rounding again (`compose`): that
composition is the baseline the sandbox times against, and its error from the fp64 result (`reference`) sets the
bound a kernel must meet.

Standalone on purpose (no project imports; torch only inside the functions that take tensors): an export ships it
as `hgemm_epilogue.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

EPILOGUES = ("none", "relu", "silu", "gelu_tanh", "gelu", "relu2", "silu_mul", "gelu_mul", "residual")
ACTIVATIONS = ("relu", "silu", "gelu_tanh", "gelu", "relu2")
GATED = {"silu_mul": "silu", "gelu_mul": "gelu_tanh"}  # gated epilogue -> the activation of its gate
GATE_BLOCK = 8  # columns of gate, then of up, in each 16-column block of a gated B
GELU_C = 0.7978845608028654  # sqrt(2 / pi)
GELU_A = 0.044715
SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)


@dataclass(frozen=True)
class Epilogue:
    name: str = "none"

    def __post_init__(self) -> None:
        if self.name not in EPILOGUES:
            raise ValueError(f"unknown epilogue {self.name!r}: use one of {', '.join(EPILOGUES)}")

    @property
    def activation(self) -> str:
        """The activation applied (to the gate, where gated): none or one of ACTIVATIONS."""
        return GATED.get(self.name, self.name if self.name in ACTIVATIONS else "none")

    @property
    def gated(self) -> bool:
        return self.name in GATED

    @property
    def residual(self) -> bool:
        return self.name == "residual"

    @property
    def quadratic(self) -> bool:
        """C grows as the square of the sums (a gated product, relu squared): unit inputs at K in the thousands
        overflow fp16, so the checks and timings draw smaller inputs (sandbox/check.py input_std)."""
        return self.gated or self.activation == "relu2"

    def out_cols(self, n: int) -> int:
        """Columns of C for a GEMM of N columns."""
        return n // 2 if self.gated else n

    @property
    def exact(self) -> bool:
        """Integer inputs give results the dtype may hold exactly (no transcendental function in the way)."""
        return self.activation in ("none", "relu")

    def formula(self, bias: bool) -> str:
        """C's definition in one line, as kernel sources and export headers state it."""
        y = "A[M,K] * B" + (" + bias[N]" if bias else "")
        if self.residual:
            return f"{y} + R[M,N]"
        if self.gated:
            return f"{self.activation}(gate) * up of ({y}), gate and up interleaved in {GATE_BLOCK}-column blocks"
        return f"{self.activation}({y})" if self.activation != "none" else y

    @property
    def baseline(self) -> str:
        """What the model runs instead of the fused kernel, in words (the baseline a kernel is timed against)."""
        if self.gated:
            return f"cuBLAS x2 (gate, up) + {self.activation} + mul"
        if self.residual:
            return "cuBLAS + add"
        return f"cuBLAS + {self.activation}" if self.activation != "none" else "cuBLAS"

    def check_n(self, n: int) -> str | None:
        """Why a GEMM of N columns cannot take this epilogue, or None."""
        if self.gated and n % (2 * GATE_BLOCK):
            return (f"a gated epilogue ({self.name}) needs N a multiple of {2 * GATE_BLOCK} (blocks of {GATE_BLOCK} "
                    f"gate and {GATE_BLOCK} up columns), got N={n}")
        return None


# fp32 device code every family renders: act(x) and, for gated epilogues, gate(g, u).
_ACT_CUDA = {
    "none": "return x;",
    "relu": "return x > 0.f ? x : 0.f;",
    # __fdividef: within 2 ulp while the divisor is under 2^126; above it (silu at x under -87) it gives 0 where
    # silu's magnitude is under 1e-36 (fp16 rounds that to 0 as well). IEEE division made every tile's epilogue
    # up to 1.7x slower (decision `fast-divide`)
    "silu": "return __fdividef(x, 1.f + __expf(-x));",
    # tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) in (0, 1]: a few fp32 ulps over the whole range
    "gelu_tanh": (f"const float y = {GELU_C}f * (x + {GELU_A}f * x * x * x);\n"
                  "    const float e = __expf(-2.f * fabsf(y));\n"
                  "    const float t = copysignf(__fdividef(1.f - e, 1.f + e), y);\n"
                  "    return 0.5f * x * (1.f + t);"),
    "gelu": f"return 0.5f * x * (1.f + erff(x * {SQRT_HALF}f));",  # erff: within 2 fp32 ulps
    "relu2": "const float r = x > 0.f ? x : 0.f;\n    return r * r;",
}


# One element of a dtype (an operand, a bias or a residual value) -> fp32, exactly.
_TO_F32_CUDA = {
    "bf16": "return __uint_as_float((unsigned int)h << 16);  // a bf16 is the upper half of the fp32 of the same value",
    "f16": 'float f;\n    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));\n    return f;',
}


def element_code(dtype: str) -> str:
    """to_f32(h): one element of the dtype ("f16" or "bf16") to fp32, exactly (every family's and the export's
    helper kernels')."""
    return "__device__ __forceinline__ float to_f32(unsigned short h) {\n    " + _TO_F32_CUDA[dtype] + "\n}\n"


def cuda_code(epilogue: Epilogue, dtype: str) -> str:
    """The device functions a template calls: to_f32(h) (element_code); then on each fp32 sum (bias and residual
    already added) act(x), and gate(g, u) = act(g) * u (called where gated)."""
    return ("// One element of the dtype to fp32, exactly; the fused epilogue's activation on fp32 values, and a\n"
            "// gated epilogue's gate value times its up value (core/epilogue.py defines them for every family).\n"
            + element_code(dtype) +
            "__device__ __forceinline__ float act(float x) {\n    " + _ACT_CUDA[epilogue.activation] + "\n}\n"
            "__device__ __forceinline__ float gate(float g, float u) { return act(g) * u; }\n")


# ---- the same math on torch tensors (the checks, the baselines, the export's fallback) -----------------------------
def activate(x, name: str, inplace: bool = False):
    """The activation `name` (ACTIVATIONS, or "none") on a tensor, as PyTorch computes it; in place where asked."""
    import torch
    import torch.nn.functional as F

    if name == "relu":
        return F.relu(x, inplace=inplace)
    if name == "silu":
        return F.silu(x, inplace=inplace)
    if name == "relu2":  # relu, then its square (transformers' ReLUSquaredActivation)
        return F.relu(x, inplace=True).square_() if inplace else torch.square(F.relu(x))
    if name in ("gelu_tanh", "gelu"):
        approximate = "tanh" if name == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_(x, approximate=approximate) if inplace else F.gelu(x, approximate=approximate)
    return x


def split_gate_up(y, dim: int = -1):
    """(gate, up) of a gated GEMM's output (or of a merged weight along `dim`): views' copies, each half the size."""
    dim = dim % y.dim()
    size = y.shape[dim]
    blocks = y.unflatten(dim, (size // (2 * GATE_BLOCK), 2, GATE_BLOCK))
    gate, up = blocks.select(dim + 1, 0), blocks.select(dim + 1, 1)
    return gate.flatten(dim, dim + 1), up.flatten(dim, dim + 1)


def interleave_gate_up(gate, up, dim: int = -1):
    """The gated B (or bias) of `gate` and `up` along `dim` (each N / 2 long there): blocks of GATE_BLOCK of each in
    turn. For nn.Linear weights (N x K) dim=0; for a K x N B dim=-1."""
    import torch

    dim = dim % gate.dim()
    size = gate.shape[dim]
    if gate.shape != up.shape or size % GATE_BLOCK:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must match, {size} a multiple of "
                         f"{GATE_BLOCK} along dim {dim}")
    g = gate.unflatten(dim, (size // GATE_BLOCK, GATE_BLOCK))
    u = up.unflatten(dim, (size // GATE_BLOCK, GATE_BLOCK))
    return torch.stack((g, u), dim=dim + 1).flatten(dim, dim + 2)


def reference(y, epilogue: Epilogue, residual=None):
    """The epilogue applied to y = A·B + bias in y's precision (fp64 for the reference): C's values unrounded."""
    if epilogue.residual:
        return y + residual.to(y.dtype)
    if epilogue.gated:
        return gated_compose(y, epilogue.activation)
    return activate(y, epilogue.activation)


def compose(y, epilogue: Epilogue, residual=None):
    """What a model runs after an unfused GEMM whose output y is in the model's dtype: PyTorch's elementwise ops in
    that dtype, each rounding (residual: y + R; gated: act(gate) * up of y's de-interleaved halves, `gated_compose`)."""
    if epilogue.residual:
        return y + residual
    if epilogue.gated:
        return gated_compose(y, epilogue.activation)
    return activate(y, epilogue.activation)


def gated_compose(y, activation: str):
    """act(gate) * up of a gated GEMM's output y (gate and up interleaved in blocks of GATE_BLOCK columns), rounding
    to y's dtype after the activation and after the product, as a model's two ops do (in fp64 for the reference);
    on strided views of the two halves, with no copy of either."""
    blocks = y.unflatten(-1, (y.shape[-1] // (2 * GATE_BLOCK), 2, GATE_BLOCK))
    return (activate(blocks.select(-2, 0), activation) * blocks.select(-2, 1)).flatten(-2)
