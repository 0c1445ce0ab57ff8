"""Fused epilogues (core/epilogue.py) on the CPU: their definition, the problem key, the sandbox's checks against a
CPU "kernel" that fuses correctly and against ones that cheat in the ways a fused kernel can, and every epilogue
rendered and compiled by every family for both archs."""

from __future__ import annotations

import pytest
import torch

from core.epilogue import (
    ACTIVATIONS,
    EPILOGUES,
    GATE_BLOCK,
    Epilogue,
    activate,
    compose,
    cuda_code,
    interleave_gate_up,
    reference,
    split_gate_up,
)
from core.plan import ceil_div
from core.records import Problem
from sandbox.build import compile_cuda
from sandbox.check import Checker, CheckFailed
from templates import get_family
from tests.gpu_reference import check_in_sandbox
from tests.test_check import replay


def test_gate_and_up_interleave_in_blocks_and_split_back():
    gate, up = torch.arange(32.0).view(2, 16), 100 + torch.arange(32.0).view(2, 16)
    merged = interleave_gate_up(gate, up)  # along the columns (a K x N B)
    assert merged.shape == (2, 32)
    assert merged[0, :GATE_BLOCK].tolist() == gate[0, :8].tolist()
    assert merged[0, GATE_BLOCK:2 * GATE_BLOCK].tolist() == up[0, :8].tolist()
    assert merged[1, 16:24].tolist() == gate[1, 8:].tolist()
    g, u = split_gate_up(merged)
    assert torch.equal(g, gate) and torch.equal(u, up)
    rows = interleave_gate_up(gate.t(), up.t(), dim=0)  # an N x K weight: rows
    assert torch.equal(rows, merged.t())
    with pytest.raises(ValueError, match="must match"):
        interleave_gate_up(gate, up[:, :8])


def test_reference_and_the_models_composition_agree_up_to_rounding():
    g = torch.Generator().manual_seed(0)
    y, r = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    for name in EPILOGUES:
        epi = Epilogue(name)
        exact = reference(y.double(), epi, r)
        model = compose(y.half(), epi, r.half()).double()
        assert exact.shape == model.shape == (8, epi.out_cols(32))
        assert torch.allclose(exact, model, rtol=2e-2, atol=2e-2), name
    assert torch.equal(reference(y, Epilogue("relu")), y.clamp_min(0))
    for name in ACTIVATIONS:  # the baseline's in-place activations compute the same
        x = y.clone()
        assert torch.equal(activate(x, name, inplace=True), activate(y, name)) and torch.equal(x, activate(y, name))
    gate, up = split_gate_up(y)
    assert torch.allclose(reference(y, Epilogue("silu_mul")), gate * torch.sigmoid(gate) * up)


def models_gated(y: torch.Tensor, activation: str) -> torch.Tensor:
    """What a model computes from separate gate and up outputs: act(gate), then the product, each rounded."""
    gate, up = split_gate_up(y)
    return activate(gate.contiguous(), activation) * up.contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_gated_composition_is_the_models_bit_for_bit_without_copying_the_halves(dtype):
    y = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    for name, act in (("silu_mul", "silu"), ("gelu_mul", "gelu_tanh")):
        out = compose(y, Epilogue(name))
        assert out.shape == (5, 3, 32) and out.is_contiguous() and out.dtype == dtype
        assert torch.equal(out, models_gated(y, act)), name


def test_the_epilogue_names_the_problem_and_its_output():
    p = Problem(16, 28672, 4096, "nk", "bf16", True, "silu_mul")
    assert p.key == "16_28672_4096:nk:bf16:bias:silu_mul" and p.out_n == 14336
    assert Problem(16, 4096, 4096).key == "16_4096_4096:kn:f16"  # no epilogue: the key it always had
    plain, res = Problem(16, 4096, 4096, "nk"), Problem(16, 4096, 4096, "nk", epilogue="residual")
    assert res.operand_bytes - plain.operand_bytes == 2 * 16 * 4096  # R is read
    with pytest.raises(ValueError, match="multiple of 16"):
        Problem(16, 24, 64, epilogue="gelu_mul")
    with pytest.raises(ValueError, match="unknown epilogue"):
        Problem(16, 64, 64, epilogue="swish")
    assert "gate(float g, float u)" in cuda_code(Epilogue("silu_mul"), "f16")
    # one to_f32 a dtype, for every family and the export's helper kernels
    assert "cvt.f32.f16" in cuda_code(Epilogue("none"), "f16") and "cvt" not in cuda_code(Epilogue("none"), "bf16")
    assert Epilogue("gelu_tanh").formula(True) == "gelu_tanh(A[M,K] * B + bias[N])"


def test_no_activation_divides_by_ieee_division():
    """Every activation's device code divides with __fdividef, never with `/` (IEEE fp32 division made each tile's
    epilogue up to 1.7x slower: decision `fast-divide`)."""
    import re

    for name in ACTIVATIONS:
        body = cuda_code(Epilogue(name), "f16").split("float act(float x) {", 1)[1].split("\n}", 1)[0]
        code = re.sub(r"//[^\n]*", "", body)
        assert "/" not in code, f"{name}: {code}"
    for name in ("silu", "gelu_tanh"):
        assert "__fdividef" in cuda_code(Epilogue(name), "bf16")


# ---- the checks on the CPU, with CPU "kernels" ----------------------------------------------------------------------
@pytest.fixture
def on_cpu(monkeypatch):
    from sandbox import check

    monkeypatch.setattr(check, "DEVICE", "cpu")


ACTS = {"relu": torch.relu, "silu": torch.nn.functional.silu,
        "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"), "gelu": torch.nn.functional.gelu,
        "relu2": lambda x: torch.relu(x).square()}


def fused(problem: Problem, cheat: str = ""):
    """launch(A, B, C, M, N, K, bias, R) computing the fused epilogue as a correct kernel does (fp32, one rounding),
    or with one cheat."""
    epi, dt = problem.fused, torch.float16 if problem.dtype == "f16" else torch.bfloat16

    def act(x):
        if cheat == "coarse_activation":  # a cheap polynomial in place of the activation
            return x * (0.5 + x / 4).clamp(0, 1)
        if cheat == "quick_gelu":  # x sigmoid(1.702 x): within ~0.02 of tanh-GELU, only where |x| is a few units
            return x * torch.sigmoid(1.702 * x)
        return ACTS[epi.activation](x) if epi.activation != "none" else x

    def launch(a, b, c, m, n, k, bias=None, residual=None):
        y = a.float() @ (b.float() if problem.b_layout == "kn" else b.float().t())
        if cheat == "activation_before_bias":
            y = act(y) + bias.float()
        elif bias is not None:
            y = y + bias.float()
        if epi.residual:
            r = residual.float()
            y = y + {"residual_twice": 2 * r, "residual_wrong_row": r.roll(1, 0)}.get(cheat, r)
        if epi.gated:
            gate, up = split_gate_up(y)
            out = act(up) * gate if cheat == "gate_up_swapped" else act(gate) * up
        elif cheat != "activation_before_bias":
            out = act(y)
        else:
            out = y
        if cheat == "last_tile_skipped" and m > 16:
            out = out[: (m - 1) // 16 * 16]
        c[: out.shape[0]].copy_(out.to(dt))

    return launch


EPILOGUE_PROBLEMS = [Problem(40, 64, 64, "nk", "f16", True, name) for name in EPILOGUES if name != "none"] + [
    Problem(40, 32, 64, "kn", "bf16", False, "gelu_mul"), Problem(40, 64, 64, "kn", "bf16", False, "residual"),
    # fp16 quadratic epilogues at a long K: act(gate) * up and relu(x)^2 of unit inputs would pass 65504; the checks'
    # inputs keep them in range
    Problem(300, 64, 4096, "nk", "f16", False, "silu_mul"), Problem(300, 64, 8192, "nk", "f16", False, "relu2")]


@pytest.mark.parametrize("problem", EPILOGUE_PROBLEMS, ids=lambda p: p.key)
def test_a_correct_fused_kernel_passes_every_check(on_cpu, problem):
    Checker(fused(problem), problem, seed=3).check_all(problem)


@pytest.mark.parametrize("epilogue, cheat, found", [
    ("silu", "activation_before_bias", "wrong result"),
    ("relu", "activation_before_bias", "wrong result"),
    ("silu_mul", "gate_up_swapped", "wrong result"),
    ("residual", "residual_twice", "wrong result"),
    ("residual", "residual_wrong_row", "wrong result"),
    ("gelu_tanh", "coarse_activation", "wrong result"),
    ("silu", "coarse_activation", "wrong result"),
    ("gelu_tanh", "quick_gelu", "wrong result"),
    ("gelu", "quick_gelu", "wrong result"),
    ("gelu", "coarse_activation", "wrong result"),
    ("silu_mul", "last_tile_skipped", "unwritten output"),
    ("residual", "last_tile_skipped", "unwritten output"),
])
def test_each_cheat_of_a_fused_epilogue_is_named(on_cpu, epilogue, cheat, found):
    problem = Problem(40, 64, 64, "nk", "f16", True, epilogue)
    with pytest.raises(CheckFailed, match=found):
        Checker(fused(problem, cheat), problem, seed=3).check_all(problem)


def test_a_residual_kernel_that_cannot_run_in_place_is_named(on_cpu):
    problem = Problem(40, 64, 64, "nk", "f16", False, "residual")
    correct = fused(problem)

    def out_of_place_only(a, b, c, m, n, k, bias=None, residual=None):
        if residual is not None and residual.data_ptr() == c.data_ptr():
            c.zero_()  # clobbers R before reading it
        correct(a, b, c, m, n, k, bias, residual)

    with pytest.raises(CheckFailed, match="in place"):
        Checker(out_of_place_only, problem, seed=3).check_all(problem)


@pytest.mark.parametrize("mode", ["warm", "cold", "fresh"])
@pytest.mark.parametrize("epilogue", ["residual", "silu_mul"])
@pytest.mark.parametrize("n", [64, 1280])  # 1280: more column blocks than a verification samples
def test_timed_outputs_of_a_fused_epilogue_are_verified(on_cpu, mode, epilogue, n):
    from sandbox.timed import TimedBuffers

    problem = Problem(24, n, 64, "nk", "f16", True, epilogue)

    def timed(cheat=""):
        buffers = TimedBuffers(problem, fused(problem, cheat), 4, mode, Checker(fused(problem), problem, seed=2))
        subject = buffers.subject()
        subject.overhead = None if mode == "cold" else subject.overhead  # no L2 to flush on the CPU
        for _ in range(2):
            replay(buffers, subject)

    timed()
    with pytest.raises(CheckFailed, match="left a wrong result"):
        timed("gate_up_swapped" if epilogue == "silu_mul" else "residual_twice")


def test_the_baseline_is_the_models_composition(on_cpu):
    from sandbox.timed import Baseline

    g = torch.Generator().manual_seed(5)
    for layout in ("kn", "nk"):
        p = Problem(8, 32, 64, layout, "f16", True, "silu_mul")
        a = torch.randn(8, 64, generator=g).half()
        gate_w, up_w = torch.randn(16, 64, generator=g).half(), torch.randn(16, 64, generator=g).half()
        gate_b, up_b = torch.randn(16, generator=g).half(), torch.randn(16, generator=g).half()
        w = interleave_gate_up(gate_w, up_w, dim=0)
        b = w if layout == "nk" else w.t().contiguous()
        c = torch.empty(8, 16).half()
        Baseline(p)(a, b, c, 8, 32, 64, interleave_gate_up(gate_b, up_b))
        model = torch.nn.functional.silu(torch.nn.functional.linear(a.float(), gate_w.float(), gate_b.float()))
        model = model * torch.nn.functional.linear(a.float(), up_w.float(), up_b.float())
        assert torch.allclose(c.float(), model, rtol=1e-2, atol=1e-2)


# ---- every epilogue renders and compiles in every family ----------------------------------------------------------
def _builds(family: str, arch: str, settings: int) -> list[str]:
    failed = []
    fam = get_family(family)
    for name in EPILOGUES:
        for problem in (Problem(16, 4096, 4096, "nk", "bf16", True, name), Problem(2048, 1024, 512, "kn", "f16",
                                                                                  False, name)):
            for params in fam.space(problem)[:settings]:
                build = compile_cuda(fam.render(params, problem), arch)
                if not build.ok:
                    failed.append(f"{problem.key} {params}: {build.error}")
    return failed


@pytest.mark.parametrize("family, arch, settings", [("sm90_wgmma", "sm_90a", 2), ("sm80_mma", "sm_90a", 1),
                                                    ("sm80_mma", "sm_80", 1), ("naive", "sm_80", 1)])
def test_every_epilogue_compiles(family, arch, settings):
    assert _builds(family, arch, settings) == []


def test_gated_settings_keep_whole_tiles():
    fam = get_family("sm90_wgmma")
    for mnk in ((1, 28672, 4096), (2048, 28672, 4096), (64, 37888, 3584)):
        settings = fam.space(Problem(*mnk, "nk", "f16", False, "silu_mul"))
        assert settings and all(s["split_k"] == 1 and s["k_groups"] == 1 for s in settings)
        assert all(not (s["epilogue"] == "tma" and (s["swap_ab"] or s["block_n"] % 128)) for s in settings)
    split = {"block_m": 128, "block_n": 128, "consumers": 2, "split_k": 2}
    fam.parse(split, Problem(64, 37888, 3584, "nk", "f16"))
    with pytest.raises(ValueError, match="gated"):
        fam.parse(split, Problem(64, 37888, 3584, "nk", "f16", False, "silu_mul"))


# ---- GPU: each family's kernels of every store path, with every epilogue, through the sandbox's own checks --------
FULL = ("silu_mul", "residual")  # every kind; the other epilogues on the kinds below
SOME_KINDS = {"smem", "direct", "tma_store", "persistent_tma_store", "swapped", "split_k", "k_groups",
              "ping_pong_tma_store", "swapped_tma_store"}


def gpu_cases() -> list:
    from tests.test_sm80_family import KINDS as SM80_KINDS
    from tests.test_sm90_family import GPU_KINDS as SM90_KINDS

    out = []
    for family, kinds in (("sm90_wgmma", SM90_KINDS), ("sm80_mma", SM80_KINDS), ("naive", {"naive": (
            {"block_x": 16, "block_y": 16}, (77, 200, 264))})):
        for i, (kind, (params, (m, n, k))) in enumerate(kinds.items()):
            for j, name in enumerate(e for e in EPILOGUES if e != "none"):
                if name not in FULL and family == "sm90_wgmma" and kind not in SOME_KINDS:
                    continue
                epi = Epilogue(name)
                layout, (dtype, bias) = ("kn", "nk")[(i + j) % 2], (("f16", False), ("bf16", True))[(i + j) // 2 % 2]
                problem = Problem(m, ceil_div(n, 16) * 16 if epi.gated else n, k, layout, dtype, bias, name)
                try:
                    get_family(family).parse(params, problem)
                except ValueError:
                    continue  # a setting the epilogue cannot take (gated: split-K, swapped TMA stores)
                out.append(pytest.param(family, params, problem, id=f"{family}-{kind}-{problem.key}"))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("family, params, problem", gpu_cases())
def test_every_store_path_fuses_every_epilogue_on_the_gpu(family, params, problem):
    arch = "sm_90a" if torch.cuda.get_device_capability() >= (9, 0) else "sm_80"
    if arch not in get_family(family).arches:
        pytest.skip(f"{family} does not run on {arch}")
    check_in_sandbox(family, params, problem)
