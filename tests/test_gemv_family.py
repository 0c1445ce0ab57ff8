"""The gemv family (templates/gemv): its settings and launch rule, every epilogue rendered and compiled for both
arches without spills on the CPU; on the GPU, the sandbox's full checks."""

from __future__ import annotations

import pytest

from agent.proposers.context import families_for_prompt
from core.device import H200
from core.epilogue import EPILOGUES, Epilogue
from core.records import Problem
from sandbox.build import BASE_OPTIONS, compile_cuda
from templates import families_for_arch, get_family
from tests.gpu_reference import PAIRS, check_in_sandbox

FAM = get_family("gemv")


def test_it_takes_only_nk_is_searched_up_to_four_rows_and_not_shown_to_the_llm_yet():
    for arch in ("sm_90a", "sm_80"):
        assert FAM in families_for_arch(arch) and FAM not in families_for_prompt(arch)
    assert get_family("naive") in families_for_prompt("sm_80")
    assert FAM.space(Problem(1, 4096, 4096, "kn", "f16", False)) == []
    assert FAM.space(Problem(4, 4096, 4096, "nk", "f16", False))
    assert FAM.space(Problem(5, 4096, 4096, "nk", "f16", False)) == []  # measured slower than cuBLAS at M = 8
    with pytest.raises(ValueError, match="N x K"):
        FAM.parse({}, Problem(1, 4096, 4096, "kn", "f16", False))


@pytest.mark.parametrize("m,m_tile", [(1, 1), (2, 2), (3, 4), (4, 4)])
def test_a_block_takes_m_rounded_up_to_a_power_of_two(m, m_tile):
    p = Problem(m, 4608, 3584, "nk", "bf16", True)
    space = FAM.space(p)
    assert space and all(s["m_tile"] == m_tile for s in space)
    for s in space:
        spec = FAM.launch(s, p, H200)
        columns, m_blocks = -(-p.n // (s["warps"] * s["rows"])), -(-m // s["m_tile"])
        assert spec.grid == (columns * m_blocks, 1, 1)  # a block per column group and m_tile rows of A
        assert spec.block == (32 * s["warps"], 1, 1) and spec.smem_bytes == 0 and spec.overlap


@pytest.mark.parametrize("m,m_tile,m_blocks", [(1, 8, 1), (8, 8, 1), (64, 8, 8), (11, 4, 3)])
def test_a_setting_may_name_its_rows_of_a_block_and_takes_more_blocks_beyond(m, m_tile, m_blocks):
    p = Problem(m, 4608, 3584, "nk", "bf16", True)
    s = {"warps": 4, "rows": 2, "unroll": 2, "m_tile": m_tile}
    assert FAM.launch(s, p, H200).grid == (-(-4608 // 8) * m_blocks, 1, 1)


def test_a_gated_problem_launches_over_its_output_columns_and_caps_the_registers():
    p = Problem(1, 28672, 4096, "nk", "f16", False, "silu_mul")
    s = FAM.space(p)[0]
    assert FAM.launch(s, p).grid[0] * s["warps"] * s["rows"] == p.out_n == 14336
    with pytest.raises(ValueError, match="registers"):
        FAM.parse({"rows": 4, "unroll": 4, "m_tile": 8}, p)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("dtype,bias", PAIRS, ids=lambda x: str(x))
def test_every_epilogue_compiles_without_spills_with_its_norm_variant(arch, epilogue, dtype, bias, tmp_path):
    """M 1 and 4; the norm variant (built for one row of A a block) also at 4 rows, which the template handles."""
    for m in (1, 4):
        p = Problem(m, 256, 1032, "nk", dtype, bias, epilogue)
        settings = FAM.space(p)
        assert len(settings) >= 3
        for params in settings[:3]:
            source = FAM.render(params, p)
            assert "griddepcontrol.wait" in source
            chunks = params["m_tile"] * 1032 // 8
            norm = ("-DHGEMM_NORM", f"-DHGEMM_NORM_CHUNKS={chunks}")
            assert FAM.norm_options(params, p) == (norm if m == 1 else None)
            builds = [compile_cuda(source, arch, options=(*BASE_OPTIONS, *options), cache_dir=tmp_path)
                      for options in ((), norm)]
            for build, smem in zip(builds, (0, 2 * (params["m_tile"] + 1) * 1032 + 4 * params["m_tile"] *
                                            params["warps"]), strict=True):
                assert build.ok and build.spill_bytes == 0 and build.smem_static == smem, build.log


K_SPLITS = ({"warps": 16, "rows": 1, "unroll": 1, "k_split": 16}, {"warps": 8, "rows": 2, "unroll": 2, "k_split": 4},
            {"warps": 8, "rows": 1, "unroll": 2, "k_split": 2})


def test_k_split_warps_share_their_columns_and_must_divide_the_block():
    p = Problem(1, 28672, 4096, "nk", "f16", False, "silu_mul")
    for s in K_SPLITS:
        assert FAM.launch(s, p).grid == (-(-14336 // (s["warps"] // s["k_split"] * s["rows"])), 1, 1)
    with pytest.raises(ValueError, match="divide"):
        FAM.parse({"warps": 4, "k_split": 8}, p)
    assert all("k_split" not in s for s in FAM.space(p))  # measured, not searched (decisions `gemv-k-split`)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "residual"])
def test_k_split_settings_compile_without_spills_with_their_norm_variant(arch, epilogue, tmp_path):
    p = Problem(1, 272, 1032, "nk", "bf16", True, epilogue)
    for params in K_SPLITS:
        source = FAM.render({**params, "m_tile": 1}, p)
        assert "ksum[" in source and "ksum[" not in FAM.render({"m_tile": 1}, p)
        for options in ((), FAM.norm_options({**params, "m_tile": 1}, p)):
            build = compile_cuda(source, arch, options=(*BASE_OPTIONS, *options), cache_dir=tmp_path)
            assert build.ok and build.spill_bytes == 0, build.log


def test_a_norm_variant_is_built_for_one_row_of_a_a_block_where_it_fits_shared_memory():
    assert FAM.norm_options({"m_tile": 1}, Problem(1, 4096, 8192, "nk")) is not None  # 16 KB of A and of the weight
    assert FAM.norm_options({"m_tile": 1}, Problem(1, 4096, 14336, "nk")) is None  # 28 KB each
    assert FAM.norm_options({"m_tile": 2}, Problem(2, 4096, 1024, "nk")) is None  # 1.23-1.28x the two kernels' time


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "residual", "gelu_tanh"])
@pytest.mark.parametrize("dtype,bias", PAIRS, ids=lambda x: str(x))
@pytest.mark.parametrize("m,n,k", [(1, 264, 1032), (5, 512, 4096), (11, 136, 328)])
def test_the_sandbox_accepts_its_kernels(epilogue, dtype, bias, m, n, k):
    n += 8 if Epilogue(epilogue).check_n(n) else 0  # a gated epilogue's N: whole 16-column gate/up blocks
    p = Problem(m, n, k, "nk", dtype, bias, epilogue)
    m_tile = min(8, 1 << (m - 1).bit_length())
    for params in FAM.space(Problem(1, n, k, "nk", dtype, bias, epilogue))[:3]:
        check_in_sandbox("gemv", {**params, "m_tile": m_tile}, p)


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "residual"])
@pytest.mark.parametrize("m,n,k,m_tile", [(1, 264, 1032, 1), (3, 520, 4096, 4), (1, 136, 328, 1)])
def test_the_sandbox_accepts_its_k_split_kernels(epilogue, m, n, k, m_tile):
    """Column groups past N (whose warps still take part in the block's sums) and K not a multiple of a step."""
    n += 8 if Epilogue(epilogue).check_n(n) else 0
    p = Problem(m, n, k, "nk", "f16", True, epilogue)
    for params in K_SPLITS[1:] if m_tile > 1 else K_SPLITS:
        check_in_sandbox("gemv", {**params, "m_tile": m_tile}, p)
