"""The sm80_mma family on a CPU-only machine: its space compiles without spills (fp16 and bf16, with and without a
bias), bad settings are refused, launches cover the output. On a GPU (marked `gpu`): every epilogue kind computes
every (dtype, bias) pair right."""

from __future__ import annotations

import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from core.device import ARCH_LIMITS
from core.records import Problem
from templates.sm80_mma.space import Sm80Mma, Sm80MmaParams
from tests.gpu_reference import PAIRS, cases, check_kernel

FAMILY = Sm80Mma()
PROBLEMS = [
    Problem(64, 64, 64, "kn"),
    Problem(1000, 3000, 2000, "nk"),
    Problem(4096, 4096, 4096, "kn"),
    Problem(64, 1024, 16384, "nk"),
]


def _compile(source: str, arch: str) -> str:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "hgemm.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}", "--ptxas-options=-v", "-std=c++17"])
    except Exception as e:
        raise AssertionError(f"{arch}: {e}\n{nvrtc.getProgramLog(prog)}") from None
    return nvrtc.getProgramLog(prog)


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:
        return False
    return True


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.key)
def test_space_is_valid_and_ordered(problem: Problem) -> None:
    settings = FAMILY.space(problem)
    assert 10 <= len(settings) <= 40
    assert len({str(sorted(s.items())) for s in settings}) == len(settings), "duplicate settings"
    for s in settings:
        FAMILY.parse(s, problem)


def test_space_prefers_big_tiles_for_big_problems_and_small_for_small() -> None:
    big = FAMILY.space(Problem(4096, 4096, 4096, "kn"))[0]
    small = FAMILY.space(Problem(64, 1024, 16384, "nk"))[0]
    assert big["block_m"] * big["block_n"] >= 128 * 128
    assert small["block_m"] <= 64


@pytest.mark.skipif(not _nvrtc_available(), reason="libnvrtc not available")
def test_space_compiles_without_spills_for_both_arches() -> None:
    sources = {FAMILY.render(s, p) for p in PROBLEMS for s in FAMILY.space(p)}  # source depends on params + layout
    jobs = [(src, arch) for src in sorted(sources) for arch in FAMILY.arches]
    # Processes, not threads: the NVRTC binding holds the GIL while it compiles.
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        logs = list(pool.map(_compile, *zip(*jobs, strict=True)))
    for (src, arch), log in zip(jobs, logs, strict=True):
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill", log)]
        assert spills and not any(spills), f"{arch} spills:\n{log}\n{src[:600]}"


def test_source_is_self_contained() -> None:
    src = FAMILY.render({}, Problem(17, 24, 40, "nk"))
    assert "#include" not in src
    assert re.search(r'extern "C" __global__ void __launch_bounds__\(THREADS, MIN_BLOCKS\)\s+hgemm\(', src)
    assert "constexpr bool B_KN = false;" in src
    assert "constexpr bool B_KN = true;" in FAMILY.render({}, Problem(17, 24, 40, "kn"))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"block_m": 64, "warps_m": 8}, "warp tile M"),
        ({"block_n": 32, "warps_n": 4}, "warp tile N"),
        ({"block_m": 256, "block_n": 256, "warps_m": 8, "warps_n": 8}, "exceeds 1024"),
        ({"block_m": 256, "block_n": 256, "block_k": 64, "stages": 4, "warps_m": 4, "warps_n": 4}, "shared memory"),
        ({"block_m": 128, "block_n": 256, "warps_m": 2, "warps_n": 2}, "registers"),
        ({"block_m": 128, "block_n": 256, "block_k": 32, "warps_m": 2, "warps_n": 4, "stages": 2, "min_blocks": 2},
         "registers"),
        ({"block_m": 128, "block_n": 128, "block_k": 64, "stages": 4, "min_blocks": 2}, "do not fit one SM"),
        ({"block_k": 32, "warps_k": 4}, "cannot be split"),
        ({"block_m": 128, "block_n": 128, "block_k": 64, "warps_k": 4, "stages": 2}, "partial tiles"),
        ({"block_m": 96}, "block_m"),
        ({"stages": 1}, "stages"),
        ({"raster_group": 0}, "raster_group"),
        ({"tile": 128}, "tile"),
    ],
)
def test_bad_settings_are_rejected_with_a_message(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FAMILY.parse(params, Problem(4096, 4096, 4096, "kn"))


def test_shared_memory_budget_is_the_ampere_one() -> None:
    p = Sm80MmaParams(block_m=128, block_n=256, block_k=64, warps_m=2, warps_n=4, stages=3)
    assert p.smem_bytes == 3 * (128 + 256) * 64 * 2 <= ARCH_LIMITS["sm_80"].smem_per_block
    assert FAMILY.derived(p) == {"threads": 256, "smem_bytes": p.smem_bytes}


def test_k_groups_multiply_threads_and_reserve_shared_memory_for_partials() -> None:
    p = Sm80MmaParams(block_m=32, block_n=64, block_k=64, warps_m=1, warps_n=2, warps_k=4, stages=3)
    assert p.threads == 256
    assert p.smem_bytes == max(3 * (32 + 64) * 64 * 2, 3 * 32 * 64 * 4)
    spec = FAMILY.launch(p.model_dump(), Problem(64, 1024, 16384, "nk"))
    assert spec.block == (256, 1, 1) and spec.smem_bytes == p.smem_bytes


def _tile_of(pid: int, tiles_m: int, tiles_n: int, group: int) -> tuple[int, int]:
    """The kernel's grouped rasterisation, transcribed."""
    per_group = group * tiles_n
    first_m = (pid // per_group) * group
    rows = min(tiles_m - first_m, group)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@pytest.mark.parametrize("mnk", ["1_8_8", "17_24_40", "1000_3000_2000", "257_136_520", "4096_4096_4096"])
def test_launch_grid_covers_the_output_exactly_once(mnk: str) -> None:
    m, n, k = map(int, mnk.split("_"))
    problem = Problem(m, n, k, "kn")
    for params in FAMILY.space(problem)[:8] + [{"raster_group": 3}, {"raster_group": 1}, {"raster_group": 64}]:
        p = FAMILY.parse(params, problem)
        spec = FAMILY.launch(params, problem)
        assert spec.block == (p.threads, 1, 1) and spec.smem_bytes == p.smem_bytes
        tiles_m, tiles_n = -(-m // p.block_m), -(-n // p.block_n)
        tiles = [_tile_of(pid, tiles_m, tiles_n, p.raster_group) for pid in range(spec.grid[0])]
        assert sorted(tiles) == [(i, j) for i in range(tiles_m) for j in range(tiles_n)]
        assert spec.grid[1:] == (1, 1)


# Each epilogue (shared-memory staged or direct), without and with K groups (the bias added once, to group 0's sums).
KINDS = {
    "smem": ({"block_m": 128, "block_n": 128, "warps_m": 2, "warps_n": 2}, (333, 1000, 520)),
    "direct": ({"block_m": 128, "block_n": 128, "warps_m": 2, "warps_n": 2, "smem_epilogue": False}, (333, 1000, 520)),
    "k_groups_smem": ({"block_m": 32, "block_n": 64, "warps_m": 1, "warps_n": 2, "warps_k": 4}, (77, 200, 2056)),
    "k_groups_direct": ({"block_m": 32, "block_n": 64, "warps_m": 1, "warps_n": 2, "warps_k": 4,
                         "smem_epilogue": False}, (77, 200, 2056)),
}


@pytest.mark.skipif(not _nvrtc_available(), reason="libnvrtc not available")
@pytest.mark.parametrize("dtype,bias", PAIRS[1:], ids=lambda x: str(x))
def test_bf16_and_bias_compile_without_spills_for_both_arches(dtype: str, bias: bool) -> None:
    jobs = []
    for params, mnk in KINDS.values():
        src = FAMILY.render(params, Problem(*mnk, "kn", dtype, bias))
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32" in src
        assert f"cvt.rn.{dtype}x2.f32" in src
        assert ("int M, int N, int K, const unsigned short* __restrict__ bias)" in src) == bias
        jobs += [(src, arch) for arch in FAMILY.arches]
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        logs = list(pool.map(_compile, *zip(*jobs, strict=True)))
    for (src, arch), log in zip(jobs, logs, strict=True):
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill", log)]
        assert spills and not any(spills), f"{arch} spills:\n{log}\n{src[:600]}"


def test_gpu_kinds_are_valid_settings() -> None:
    for params, mnk in KINDS.values():
        for layout in ("kn", "nk"):
            FAMILY.launch(params, Problem(*mnk, layout, "bf16", True))


@pytest.mark.gpu
@pytest.mark.parametrize("params,problem", cases(KINDS))
def test_every_epilogue_kind_is_exact_and_close_to_torch(params: dict, problem: Problem) -> None:
    check_kernel("sm80_mma", params, problem)
