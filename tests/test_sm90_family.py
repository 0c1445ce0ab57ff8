"""The sm90_wgmma family on the CPU: its parameter space rejects the impossible, and every setting it proposes
renders and compiles for sm_90a without spills (no GPU needed: NVRTC only), for fp16 and bf16, with and without a
bias. On a GPU (marked `gpu`): every epilogue kind computes every (dtype, bias) pair right."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from core.device import H200
from core.records import Problem
from sandbox import driver
from sandbox.build import compile_cuda
from templates.sm90_wgmma import costs, kinds, search, splits
from templates.sm90_wgmma.params import Sm90WgmmaParams
from templates.sm90_wgmma.space import Sm90Wgmma
from tests.gpu_reference import PAIRS, cases, check_kernel

FAMILY = Sm90Wgmma()
AFTER = {rule.name: rule.after for rule in search.RULES}  # where each placed rule puts its settings
PROBLEMS = [Problem(128, 256, 64, "kn"), Problem(1000, 3000, 2000, "nk"), Problem(4096, 4096, 4096, "kn")]
# long K, few C tiles: space() proposes split-K (cluster + distributed shared memory) settings here
LONG_K = [Problem(64, 1024, 16384, "kn"), Problem(64, 1024, 16384, "nk"), Problem(256, 128, 16384, "kn"),
          Problem(256, 128, 16384, "nk")]
# skinny M, few C tiles: space() proposes K groups (fp32 partials through a workspace) here
SKINNY = [Problem(64, 4096, 16384, "kn"), Problem(16, 4096, 4096, "nk")]
# tiny M (<= 48): space() proposes swapped A and B roles here
TINY = [Problem(16, 4096, 4096, "kn"), Problem(16, 14336, 4096, "kn"), Problem(17, 24, 40, "nk")]
# M just past a multiple of 64: space() proposes swapped tiles of M's rows rounded to 16 here
PAST_64 = [Problem(205, 3000, 1024, "nk")]
PROBLEMS += LONG_K + SKINNY + TINY[1:] + PAST_64


def _settings() -> list[tuple[Problem, dict]]:
    return [(prob, p) for prob in PROBLEMS for p in FAMILY.space(prob)]


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.key)
def test_space_is_valid_and_sized(problem):
    space = FAMILY.space(problem)
    assert 8 <= len(space) <= 30
    assert len({repr(sorted(p.items())) for p in space}) == len(space), "duplicates"
    for p in space:
        FAMILY.parse(p, problem)
        spec = FAMILY.launch(p, problem)
        assert spec.block[0] == 128 * (p["consumers"] + 1) and spec.smem_bytes <= 227 * 1024
        assert spec.grid[0] >= 1


@pytest.mark.parametrize("problem,params", _settings(), ids=lambda x: x.key if isinstance(x, Problem) else
                         f"{x['block_m']}x{x['block_n']}c{x['consumers']}s{x['stages']}g{x['raster_group']}"
                         f"b{x['min_blocks']}{x['epilogue'][0]}{'P' if x['persistent'] else ''}k{x['split_k']}"
                         f"G{x['k_groups']}")
def test_every_setting_compiles_without_spills(problem, params):
    src = FAMILY.render(params, problem)
    assert "#include" not in src
    b = compile_cuda(src, "sm_90a", cache_dir=None)
    assert b.ok, b.log[-2000:]
    assert b.spill_bytes == 0 and b.stack_bytes == 0, b.log[-1500:]
    assert "serialized" not in b.log, "ptxas serialised the wgmma pipeline"
    p = Sm90WgmmaParams(**params)
    assert b.registers <= p.entry_regs
    if p.set_maxnreg:
        # setmaxnreg.inc blocks until the pool has the registers: the launch must allocate the whole entry cap.
        assert b.registers == p.entry_regs, b.log[-800:]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.f16\.f16", src)
    assert ("__cluster_dims__" in src) == (p.split_k > 1 or p.cluster_m > 1)


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_tma_launch_declares_valid_tensor_maps(layout):
    prob = Problem(1000, 3000, 2000, layout)
    params = {"block_m": 128, "block_n": 192 if layout == "kn" else 160, "loader": "tma"}
    spec = FAMILY.launch(params, prob)
    a, b = spec.tensor_maps
    assert (a.operand, a.dims, a.box) == ("A", (2000, 1000), (64, 128))
    # kn: B is K x N (MN-major), loaded as 64-column panels; nk: N x K, one box per stage
    assert (b.operand, b.dims, b.box) == (("B", (3000, 2000), (64, 64)) if layout == "kn"
                                         else ("B", (2000, 3000), (64, 160)))
    for t in spec.tensor_maps:
        driver.check_tiled(0x7F0000000000, t.dims, t.box, t.swizzle, t.strides)
    src = FAMILY.render(params, prob)
    assert src.count("__grid_constant__ TmaMap") == 2 and "cp.async.bulk.tensor.2d" in src
    # every tensor map the kernel takes is prefetched once, before the barriers are set up (the first copies wait less)
    tma_c = {**params, "epilogue": "tma", "block_n": 192}
    for p, maps in ((params, ("tm_a", "tm_b")), (tma_c, ("tm_a", "tm_b", "tm_c"))):
        body = FAMILY.render(p, prob).split("hgemm(", 1)[1]
        assert [m for m in ("tm_a", "tm_b", "tm_c") if f"prefetch_tensormap({m});" in body] == list(maps)
        assert body.index("prefetch_tensormap(tm_a)") < body.index("mbar_init(")
    cp = {**params, "loader": "cp_async"}
    assert FAMILY.launch(cp, prob).tensor_maps == () and "__grid_constant__" not in FAMILY.render(cp, prob)
    assert "prefetch_tensormap(tm_" not in FAMILY.render(cp, prob)


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_kn_b_is_one_copy_of_every_panel_where_n_is_a_multiple_of_64(cluster_m):
    """A view of B (K x N) with its 64-column panels as a third dimension 128 bytes apart: one copy per stage brings
    the B tile (or a multicast CTA's half), and the view's last address is the tensor's last byte."""
    prob = Problem(256, 4096, 1000, "kn")
    params = {"block_m": 64, "block_n": 256, "consumers": 1, "stages": 4, "cluster_m": cluster_m}
    _, b = FAMILY.launch(params, prob).tensor_maps
    assert (b.dims, b.box, b.strides) == ((64, 1000, 64), (64, 64, 4 // cluster_m), (8192, 128))
    driver.check_tiled(0x7F0000000000, b.dims, b.box, b.swizzle, b.strides)
    last = (b.dims[0] - 1) * 2 + sum((d - 1) * s for d, s in zip(b.dims[1:], b.strides, strict=True))
    assert last == prob.k * prob.n * 2 - 2
    src = FAMILY.render(params, prob)
    assert "cp.async.bulk.tensor.3d" in src and "N % 64 == 0" in src  # the kernel picks the copy the map was made for
    # N off 64: one 2-D copy per panel (a panel view would run past the last row)
    _, b = FAMILY.launch(params, Problem(256, 4040, 1000, "kn")).tensor_maps
    assert (b.dims, b.box, b.strides) == ((4040, 1000), (64, 64), ())


@pytest.mark.parametrize("persistent,stages", [(False, 4), (True, 3)])
def test_kn_b_panels_bring_a_tile_off_64_columns_as_whole_panels_from_any_16th_column(persistent, stages):
    """b_panels: a kn tile of 240 columns has a 256-column stage; a 4-D view (panels 128 B apart, tile starts 32 B
    apart) brings it in one copy where its panels end inside N, a plain map one panel a copy at the last column
    tile; the view's last address is B's last element, and the kernel compiles for sm_90a without spills."""
    prob = Problem(1246, 3072, 8192, "kn")
    params = {"block_m": 128, "block_n": 240, "consumers": 2, "stages": stages, "b_panels": True,
              "persistent": persistent}
    p = Sm90WgmmaParams(**params)
    assert p.b_columns == 256 and p.ring_bytes == stages * (128 + 256) * 64 * 2
    _, b4, b2 = FAMILY.launch(params, prob).tensor_maps
    assert (b4.dims, b4.box, b4.strides) == ((64, 8192, 4, (3072 - 256) // 16 + 1), (64, 64, 4, 1), (6144, 128, 32))
    assert (b2.operand, b2.dims, b2.box, b2.strides) == ("B", (3072, 8192), (64, 64), ())
    for t in (b4, b2):
        driver.check_tiled(0x7F0000000000, t.dims, t.box, t.swizzle, t.strides)
    last = (b4.dims[0] - 1) * 2 + sum((d - 1) * s for d, s in zip(b4.dims[1:], b4.strides, strict=True))
    assert last == prob.k * prob.n * 2 - 2
    src = FAMILY.render(params, prob)
    assert src.count("__grid_constant__ TmaMap") == 3 and "cp.async.bulk.tensor.4d" in src
    assert "prefetch_tensormap(tm_b2);" in src and "n0 + B_COLS <= N" in src
    b = compile_cuda(src, "sm_90a", cache_dir=None)
    assert b.ok and b.spill_bytes == 0, b.log[-1500:]
    assert "b_panels" not in Sm90WgmmaParams(block_n=256).model_dump()  # named only where true


@pytest.mark.parametrize("n", [8, 24, 200, 248])
def test_b_panels_under_a_stage_of_columns_take_every_tile_a_panel_a_copy_from_a_view_inside_b(n):
    """N under the stage's 256 columns (the sandbox's ragged shapes): every column tile is a last one, so the 4-D
    map is never read; it is still a valid view that ends inside B."""
    prob = Problem(17, n, 40, "kn")
    _, b4, b2 = FAMILY.launch({"block_m": 128, "block_n": 240, "consumers": 2, "stages": 4, "b_panels": True},
                              prob).tensor_maps
    assert b4.dims == (min(n, 64), 40, 1, 1) and b2.dims == (n, 40)
    for t in (b4, b2):
        driver.check_tiled(0x7F0000000000, t.dims, t.box, t.swizzle, t.strides)
    last = (b4.dims[0] - 1) * 2 + sum((d - 1) * s for d, s in zip(b4.dims[1:], b4.strides, strict=True))
    assert last < prob.k * prob.n * 2


def test_b_panels_launch_at_every_shape_the_sandbox_checks():
    from sandbox.check import edge_shapes

    params = {"block_m": 128, "block_n": 240, "consumers": 2, "stages": 4, "b_panels": True}
    target = Problem(1246, 3072, 8192, "kn")
    for m, n, k in edge_shapes(target):  # the target, ragged shapes of 8 and 24 columns, shapes off the tiles
        assert len(FAMILY.launch(params, Problem(m, n, k, "kn")).tensor_maps) == 3


@pytest.mark.parametrize("problem,cp_async", [
    (Problem(4096, 4096, 4096), 0),  # two consumer warpgroups, K whole: cp.async never won there
    (Problem(64, 16384, 4096), 2),  # one consumer warpgroup
    (Problem(512, 1024, 8192, "nk"), 2),  # split-K leaders
], ids=lambda x: x.key if isinstance(x, Problem) else str(x))
def test_space_leads_with_tma_and_keeps_cp_async_in_reach_where_it_wins(problem, cp_async):
    space = FAMILY.space(problem)
    assert space[0]["loader"] == "tma"
    assert [p["loader"] for p in space[:12]].count("cp_async") == cp_async


@pytest.mark.parametrize("problem,lead", [(Problem(16384, 512, 128), True), (Problem(4096, 4096, 4096), True),
                                          (Problem(1024, 1024, 1024), False), (Problem(64, 64, 64), False)],
                         ids=lambda x: x.key if isinstance(x, Problem) else str(x))
def test_persistent_tma_store_leads_only_beyond_one_wave(problem, lead):
    first = FAMILY.space(problem)[0]
    assert (first["persistent"] and first["epilogue"] == "tma") == lead


def test_a_fitted_best_guess_beyond_one_wave_leads_persistent_with_the_smem_epilogue_too():
    """3072_2304_768 nk: the best guess is 128 x 224 (two whole waves), whose columns are no whole 64-column panels
    for TMA stores; its persistent kind keeps the smem epilogue and follows the TMA-store leads. kn has no such
    widths (its persistent smem leads are swapped tiles), and a problem whose best guess takes TMA stores gets none."""
    def smem_leads(problem):
        return [i for i, p in enumerate(FAMILY.space(problem)[:4])
                if p["persistent"] and p["epilogue"] == "smem" and not p["swap_ab"]]
    space = FAMILY.space(Problem(3072, 2304, 768, "nk"))
    (i,) = smem_leads(Problem(3072, 2304, 768, "nk"))
    assert (space[i]["block_m"], space[i]["block_n"]) == (128, 224) and space[0]["epilogue"] == "tma"
    assert FAMILY.launch(space[i], Problem(3072, 2304, 768, "nk")).grid == (132, 1, 1)
    assert "PERSISTENT = true" in FAMILY.render(space[i], Problem(3072, 2304, 768, "nk"))
    assert smem_leads(Problem(3072, 2304, 768, "kn")) == [] == smem_leads(Problem(4096, 4096, 4096, "nk"))


def test_kn_transposes_b_by_descriptor_and_nk_does_not():
    kn = FAMILY.render({"block_n": 128}, Problem(256, 256, 256, "kn"))
    nk = FAMILY.render({"block_n": 128}, Problem(256, 256, 256, "nk"))
    assert "p, 1, 1, 0, 1;" in kn and "p, 1, 1, 0, 0;" in nk


@pytest.mark.parametrize("params,problem,message", [
    ({"block_m": 64, "consumers": 2}, Problem(256, 256, 256), "block_m=64 must split"),
    ({"block_n": 24}, Problem(256, 256, 256), "multiple of 16"),
    ({"block_n": 96}, Problem(256, 256, 256, "kn"), "multiple of 64"),
    ({"block_k": 32}, Problem(256, 256, 256), "block_k"),
    ({"block_n": 240, "b_panels": True}, Problem(256, 3072, 256, "nk"), "b_layout kn"),
    ({"block_n": 256, "b_panels": True}, Problem(256, 3072, 256, "kn"), "b_panels copies"),
    ({"block_n": 240, "b_panels": True, "loader": "cp_async"}, Problem(256, 3072, 256, "kn"), "b_panels copies"),
    ({"block_n": 240, "b_panels": True, "swap_ab": True, "epilogue": "smem"}, Problem(256, 3072, 256, "kn"),
     "b_panels copies|swap_ab"),
    ({"stages": 6}, Problem(256, 256, 256), "exceeds the sm_90 limit"),
    ({"block_m": 256, "block_n": 256, "stages": 3}, Problem(256, 256, 256), "accumulator registers"),
    ({"block_m": 192, "block_n": 256, "consumers": 3}, Problem(256, 256, 256), "one m64n256 wgmma needs"),
    ({"block_n": 128, "stages": 4, "min_blocks": 2}, Problem(256, 256, 256), "do not fit one SM"),
    ({"block_n": 128, "stages": 2, "min_blocks": 2}, Problem(256, 256, 256), "one m64n128 wgmma needs"),
    ({"consumers": 5}, Problem(256, 256, 256), "consumers"),
    ({"bogus": 1}, Problem(256, 256, 256), "bogus"),
    ({"split_k": 3}, Problem(256, 256, 256), "split_k"),
    ({"split_k": 16}, Problem(256, 256, 256), "split_k"),
    ({"split_k": 2, "persistent": True, "epilogue": "direct"}, Problem(256, 256, 256), "persistent blocks are not"),
    ({"block_m": 256, "block_n": 256, "consumers": 4, "stages": 2, "split_k": 2}, Problem(256, 256, 256),
     "split-K fp32 exchange tile"),
])
def test_impossible_settings_are_rejected_with_a_reason(params, problem, message):
    with pytest.raises(ValueError, match=message):
        FAMILY.parse(params, problem)


def test_persistent_launch_fills_the_sms_once():
    p = {"block_m": 128, "block_n": 256, "persistent": True, "epilogue": "direct"}
    assert FAMILY.launch(p, Problem(4096, 4096, 4096)).grid == (132, 1, 1)
    assert FAMILY.launch(p, Problem(256, 512, 64)).grid == (4, 1, 1)
    assert FAMILY.launch({**p, "persistent": False}, Problem(4096, 4096, 4096)).grid == (512, 1, 1)
    with pytest.raises(ValueError, match="C staging beside it"):  # persistent blocks cannot stage C in the ring
        FAMILY.parse({**p, "epilogue": "smem"}, Problem(4096, 4096, 4096))


@pytest.mark.parametrize("problem", LONG_K, ids=lambda p: p.key)
def test_long_k_few_tiles_gets_split_k_in_clusters(problem):
    space = FAMILY.space(problem)
    split = [p for p in space if p["split_k"] > 1]
    assert split and space[0]["split_k"] > 1, "split-K settings lead the list"
    for p in split:
        assert not p["persistent"]
        tiles = -(-problem.m // p["block_m"]) * -(-problem.n // p["block_n"])
        spec = FAMILY.launch(p, problem)
        parts = p["split_k"] * p["k_groups"]  # clusters of split_k blocks per C tile, k_groups of them
        assert spec.grid == (tiles * parts, 1, 1)
        assert spec.smem_bytes >= p["block_m"] * (p["block_n"] + 8) * 4  # the fp32 exchange tile
        assert -(-problem.k // 64) // parts >= (16 if p["k_groups"] == 1 else 8)
    src = FAMILY.render(split[0], problem)
    assert f"__cluster_dims__({split[0]['split_k']}, 1, 1)" in src and "mapa.shared::cluster" in src


@pytest.mark.parametrize("problem", SKINNY, ids=lambda p: p.key)
def test_skinny_few_tiles_gets_a_cluster_pair_then_k_groups_first(problem):
    space = [p for p in FAMILY.space(problem) if not p["swap_ab"]]
    # 64 tiles of 64 columns: two CTAs a tile, first as a split_k=2 cluster, then as 2 K groups
    pair = space[0]
    assert (pair["block_n"], pair["split_k"], pair["k_groups"]) == (64, 2, 1)
    assert FAMILY.launch(pair, problem).grid == (2 * -(-problem.n // 64), 1, 1)
    grouped = [p for p in space if p["k_groups"] > 1]
    assert grouped and space[1]["k_groups"] == 2 and space[1]["block_n"] == 64
    for p in grouped:
        assert not p["persistent"] and p["block_m"] == 64 and p["split_k"] in (1, 2)  # groups of CTAs or of pairs
        tiles = -(-problem.n // p["block_n"])
        spec = FAMILY.launch(p, problem)
        parts = p["split_k"] * p["k_groups"]
        assert spec.grid == (tiles * parts, 1, 1) and spec.grid[0] <= 132
        assert spec.workspace_bytes == p["k_groups"] * tiles * 64 * p["block_n"] * 4  # one fp32 tile per group
        assert spec.counters == tiles * p["split_k"]  # one a tile, for each CTA of a pair
        assert -(-problem.k // 64) // parts >= 8
    src = FAMILY.render(grouped[0], problem)
    assert "float* __restrict__ ws, u32* __restrict__ counters" in src and "atom.global.add" in src


@pytest.mark.parametrize("problem", [Problem(1024, 1024, 1024), Problem(128, 8192, 8192), Problem(16, 14336, 4096),
                                     Problem(64, 64, 64), Problem(256, 128, 16384)], ids=lambda p: p.key)
def test_wider_or_many_tile_problems_get_no_k_groups(problem):
    """Measured: on M = 128-1024 the fp32 partials cost more than the extra SMs bring."""
    space = [p for p in FAMILY.space(problem) if not p["swap_ab"]]
    assert all(p["k_groups"] == 1 for p in space)
    assert all(FAMILY.launch(p, problem).workspace_bytes == 0 for p in space)


@pytest.mark.parametrize("update,message", [
    ({"k_groups": 2, "persistent": True}, "persistent"),
    ({"k_groups": 2, "epilogue": "tma"}, "epilogue=tma"),
    ({"k_groups": 9}, "less than or equal to 8"),
])
def test_k_groups_rejects_what_it_cannot_do(update, message):
    with pytest.raises(ValueError, match=message):
        Sm90WgmmaParams(block_m=64, block_n=64, consumers=1, stages=4, **update)


def test_k_groups_with_clusters_count_one_arrival_per_cta_of_a_cluster():
    p = {"block_m": 64, "block_n": 128, "consumers": 1, "stages": 8, "split_k": 2, "k_groups": 4}
    spec = FAMILY.launch(p, Problem(64, 1024, 16384))
    assert spec.grid == (8 * 2 * 4, 1, 1) and spec.counters == 8 * 2
    assert spec.workspace_bytes == 4 * 8 * 64 * 128 * 4
    b = compile_cuda(FAMILY.render(p, Problem(64, 1024, 16384)), "sm_90a", cache_dir=None)
    assert b.ok and b.spill_bytes == 0 and b.stack_bytes == 0, b.log[-1500:]


@pytest.mark.parametrize("update,message", [
    ({"loader": "cp_async"}, "loader=tma"), ({"persistent": True, "k_groups": 2}, "persistent blocks are not"),
    ({"split_k": 2}, "split_k 1"), ({"block_n": 192}, "multiple of 128"),
])
def test_multicast_rejects_what_it_cannot_do(update, message):
    with pytest.raises(ValueError, match=message):
        Sm90WgmmaParams(**{"block_m": 128, "block_n": 128, "consumers": 2, "stages": 4, "cluster_m": 2, **update})


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_multicast_launches_whole_clusters_and_halves_the_b_box(layout):
    p = {"block_m": 128, "block_n": 128, "consumers": 2, "stages": 6, "cluster_m": 2}
    prob = Problem(333, 1000, 520, layout)
    spec = FAMILY.launch(p, prob)
    assert spec.grid == (2 * 2 * 8, 1, 1)  # 3 row tiles padded to 2 clusters of 2, 8 column tiles
    b_box = next(t.box for t in spec.tensor_maps if t.operand == "B")
    unpaired = next(t.box for t in FAMILY.launch({**p, "cluster_m": 1}, prob).tensor_maps if t.operand == "B")
    # nk: each CTA copies half the tile's rows; kn: whole 64-column panels, half of them each (in the kernel)
    assert (b_box, unpaired) == (((64, 64), (64, 64)) if layout == "kn" else ((64, 64), (64, 128)))
    src = FAMILY.render(p, prob)
    assert "__cluster_dims__(2, 1, 1)" in src and ".multicast::cluster" in src
    assert "mbarrier.arrive.release.cluster" not in src  # measured 2.7x slower than the CTA-scope arrival
    assert any(q["cluster_m"] == 2 for q in FAMILY.space(Problem(2048, 2048, 2048, layout)))


def test_persistent_pairs_launch_whole_clusters_that_fit_the_sms_at_once():
    p = {"block_m": 128, "block_n": 256, "consumers": 2, "stages": 3, "cluster_m": 2, "persistent": True,
         "epilogue": "tma"}
    assert FAMILY.launch(p, Problem(4096, 4096, 4096)).grid == (132, 1, 1)  # 66 pairs of 256 pairs of tiles
    assert FAMILY.launch(p, Problem(300, 512, 64)).grid == (8, 1, 1)  # 3 row tiles: 2 pairs (a CTA past M), 2 columns
    odd = replace(H200, sms=131)
    assert FAMILY.launch(p, Problem(4096, 4096, 4096), odd).grid == (130, 1, 1)
    src = FAMILY.render(p, Problem(4096, 4096, 4096))
    assert "__cluster_dims__(2, 1, 1)" in src and "constexpr bool PERSISTENT = true" in src


@pytest.mark.parametrize("update,message", [
    ({"loader": "cp_async"}, "loader=tma"), ({"split_k": 2}, "split_k 1"), ({"cluster_m": 2}, "one axis"),
    ({"cluster_n": 4, "persistent": True, "epilogue": "tma"}, "fewer clusters of 4 run at once"),
])
def test_multicast_along_n_rejects_what_it_cannot_do(update, message):
    with pytest.raises(ValueError, match=message):
        Sm90WgmmaParams(**{"block_m": 128, "block_n": 128, "consumers": 2, "stages": 4, "cluster_n": 2, **update})


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_multicast_along_n_launches_whole_clusters_and_shares_the_a_box(layout):
    p = {"block_m": 144, "block_n": 64, "consumers": 1, "stages": 8, "swap_ab": True, "epilogue": "smem",
         "cluster_n": 4}
    prob = Problem(414, 2472, 11744, layout)
    spec = FAMILY.launch(p, prob)
    assert spec.grid == (3 * 40, 1, 1)  # 39 column tiles padded to 10 clusters of 4, 3 row tiles
    boxes = {t.operand: t.box for t in spec.tensor_maps}
    assert boxes == {"A": (64, 36), "B": (64, 64)}  # each CTA a quarter of A's 144 rows, all of its B tile
    src = FAMILY.render(p, prob)
    assert "__cluster_dims__(4, 1, 1)" in src and ".multicast::cluster" in src
    persistent = {"block_m": 128, "block_n": 128, "consumers": 2, "stages": 5, "persistent": True,
                  "epilogue": "tma", "cluster_n": 2}
    assert FAMILY.launch(persistent, Problem(4096, 4096, 4096, layout)).grid == (132, 1, 1)  # 66 pairs
    assert FAMILY.launch(persistent, Problem(300, 520, 64, layout)).grid == (18, 1, 1)  # 5 column tiles padded to 6


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_long_k_under_a_wave_gets_one_cluster_of_4_along_n_after_the_leaders(layout):
    for problem, rows in ((Problem(414, 2472, 11744, layout), 144), (Problem(1607, 392, 11704, layout), 128)):
        space = FAMILY.space(problem)
        clustered = [i for i, p in enumerate(space) if p["cluster_n"] > 1]
        assert clustered == [AFTER["cluster-n"]]
        p = space[clustered[0]]
        assert (p["block_m"], p["block_n"], p["cluster_n"]) == (rows, 64, 4)
        assert 99 <= FAMILY.launch(p, problem).grid[0] <= 120  # one wave of clusters of 4
    # a shorter K, M padded far, N padded far, or many tiles: none
    for problem in (Problem(1024, 1536, 8960, layout), Problem(148, 3584, 18944, layout),
                    Problem(6147, 24, 12888, layout), Problem(4096, 4096, 16384, layout)):
        assert not any(p["cluster_n"] > 1 for p in FAMILY.space(problem)), problem.key


@pytest.mark.parametrize("problem", [Problem(4096, 4096, 4096), Problem(256, 4096, 4096), Problem(128, 8192, 8192),
                                     Problem(2048, 2048, 2048), Problem(1000, 3000, 2000)], ids=lambda p: p.key)
def test_other_problems_get_no_split_k(problem):
    """Neither long K with few tiles nor skinny (M <= 64, whose pairs the K-groups test covers)."""
    assert all(p["split_k"] == 1 for p in FAMILY.space(problem))


def test_split_k_launch_and_empty_k_ranges_are_allowed():
    p = {"block_m": 64, "block_n": 64, "consumers": 1, "split_k": 8}
    assert FAMILY.launch(p, Problem(64, 1024, 16384)).grid == (128, 1, 1)
    # K = 8: one k-tile, seven CTAs of each cluster get an empty range and contribute zeros; still a valid launch
    assert FAMILY.launch(p, Problem(1, 8, 8)).grid == (8, 1, 1)
    assert "__cluster_dims__" not in FAMILY.render({**p, "split_k": 1}, Problem(64, 1024, 16384))


@pytest.mark.parametrize("problem", TINY, ids=lambda p: p.key)
def test_tiny_m_gets_swapped_roles_first(problem):
    space = FAMILY.space(problem)
    swapped = [p for p in space if p["swap_ab"]]
    assert swapped and space[0]["swap_ab"]
    for p in swapped:
        assert p["block_m"] == -(-problem.m // 16) * 16 and p["block_n"] % 64 == 0
        assert p["consumers"] == 1 and p["epilogue"] == "smem" and p["cluster_m"] == 1
        spec = FAMILY.launch(p, problem)
        tiles = -(-problem.n // p["block_n"])
        assert spec.grid == (tiles * p["split_k"] * p["k_groups"], 1, 1)
        assert spec.grid[0] <= 132 * p["min_blocks"]  # more CTAs than SMs only where two fit an SM
    src = FAMILY.render(space[0], problem)
    assert f"m64n{space[0]['block_m']}k16" in src  # the wgmma N is the A tile's rows
    # kn: B's tile is wgmma's MN-major A operand (transpose bit a), the A tile K-major B; nk: neither transposed
    assert ("p, 1, 1, 1, 0;" if problem.b_layout == "kn" else "p, 1, 1, 0, 0;") in src


@pytest.mark.parametrize("problem", [Problem(1, 1024, 4096, "nk"), Problem(32, 1024, 4096, "kn")], ids=lambda p: p.key)
def test_tiny_m_few_tiles_split_k_as_far_as_k_allows(problem):
    """Decode's k/v projections: 16 tiles of 64 columns; K = 4096 holds 64 k-tiles, too few for 8 parts of at least
    MIN_K_TILES each, so the split takes 4 (rather than none)."""
    space = FAMILY.space(problem)
    assert space[0]["swap_ab"] and space[0]["split_k"] * space[0]["k_groups"] == 4
    parts = [p["split_k"] * p["k_groups"] for p in space if p["swap_ab"]]
    assert max(parts) == 4 and parts.count(4) >= 3  # a cluster of 4, 4 groups, pairs in 2 groups
    for p in space[:3]:
        b = compile_cuda(FAMILY.render(p, problem), "sm_90a", cache_dir=None)
        assert b.ok and b.spill_bytes == 0 and b.stack_bytes == 0, b.log[-1500:]


@pytest.mark.parametrize("problem", [Problem(64, 4096, 16384), Problem(49, 4096, 4096), Problem(1024, 1024, 1024)],
                         ids=lambda p: p.key)
def test_wider_problems_get_no_swapped_roles(problem):
    assert not any(p["swap_ab"] for p in FAMILY.space(problem))


@pytest.mark.parametrize("update,message", [
    ({"block_m": 16}, "need swap_ab"),
    ({"swap_ab": True, "block_n": 96}, "multiple of 64"),
    ({"swap_ab": True, "consumers": 2, "block_n": 64}, "block_n=64 \\(swap_ab\\) must split into consumers=2"),
    ({"block_m": 208}, "need swap_ab"),
    ({"swap_ab": True, "epilogue": "direct"}, "epilogue smem or tma"),
])
def test_swapped_roles_reject_what_they_cannot_do(update, message):
    with pytest.raises(ValueError, match=message):
        Sm90WgmmaParams(**{"block_m": 64, "block_n": 64, "consumers": 1, "stages": 4, "epilogue": "smem", **update})


PAST_64_ROWS = [(Problem(205, 50304, 1024, "kn"), 208), (Problem(222, 32000, 4096, "nk"), 224),
                (Problem(657, 9984, 3136, "kn"), 224)]


@pytest.mark.parametrize("problem,rows", PAST_64_ROWS, ids=lambda x: getattr(x, "key", x))
def test_m_past_a_multiple_of_64_gets_swapped_tiles_of_its_rows(problem, rows):
    space = FAMILY.space(problem)
    fitted = space[AFTER["swap-fit"]]
    assert fitted["swap_ab"] and fitted["block_m"] == rows and fitted["consumers"] == fitted["block_n"] // 64
    assert not any(p["swap_ab"] for p in space[:AFTER["swap-fit"]])
    assert -(-problem.m // rows) * rows - problem.m < 16  # padded by less than 16 rows (64-row tiles: 51-111)


def test_rows_off_128_byte_lines_weigh_by_the_rows_a_tile_loads_per_output():
    def factor(problem, **fields):
        return costs.odd_rows_factor(Sm90WgmmaParams(**{"consumers": 2, "stages": 4, **fields}), problem, H200)
    odd_nk, odd_kn = Problem(657, 9984, 3144, "nk"), Problem(657, 9984, 3144, "kn")
    assert costs.odd_rows(odd_nk) == (True, True) and costs.odd_rows(odd_kn) == (True, False)
    assert costs.odd_rows(Problem(657, 9984, 3136, "nk")) == (False, False)
    assert costs.odd_rows(Problem(1000, 3000, 3136, "kn")) == (False, True)  # kn: B's rows are N long
    assert costs.odd_rows(Problem(286, 8232, 40, "nk")) == (False, False)  # one k-tile: not counted
    wide, tall = {"block_m": 128, "block_n": 256}, {"block_m": 256, "block_n": 128}
    # nk: both operands' rows count, a pair's B rows once; kn 128 x 256: A's 128 rows a k-tile, within the free rate
    assert factor(odd_nk, **wide) > factor(odd_nk, **wide, cluster_m=2) == factor(odd_kn, **tall) > 1.1
    assert factor(odd_kn, **wide) == 1.0 == factor(Problem(657, 9984, 3136, "nk"), **wide)
    # few tiles leave the L2 to fewer SMs
    assert factor(Problem(128, 1024, 3144, "nk"), **wide) < factor(odd_nk, **wide)


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_rows_off_128_byte_lines_bring_wide_swapped_tiles_and_multicast_pairs(layout):
    # 657_9984_3144 (measured, session 12): kn 112 x 256 swapped 0.99x of cuBLAS (224 x 128: 0.86x); nk the same
    # tiles in multicast pairs 0.95x (the rules' first before: 0.78x)
    space = FAMILY.space(Problem(657, 9984, 3144, layout))
    fitted = space[AFTER["swap-fit"]]
    assert fitted["swap_ab"] and (fitted["block_m"], fitted["block_n"]) == (112, 256)
    assert fitted["cluster_m"] == (2 if layout == "nk" else 1)  # kn: B's rows (N = 9984) are on lines
    assert (space[0]["cluster_m"] == 2) == (layout == "nk")  # the pair of the best tile leads where it saves rows
    # rows on lines: no pairs in the first dozen, the swapped tiles as before
    aligned = FAMILY.space(Problem(657, 9984, 3136, layout))
    assert all(p["cluster_m"] == 1 for p in aligned[:AFTER["multicast-late"]])
    swapped = [p for p in aligned if p["swap_ab"]]
    assert swapped and all(p["block_n"] < 256 for p in swapped)


@pytest.mark.parametrize("problem", [Problem(6180, 3064, 6296, "nk"), Problem(2952, 1432, 1272, "kn"),
                                     Problem(767, 2608, 1976, "nk")], ids=lambda p: p.key)
def test_pairs_where_rows_are_off_lines_launch_and_compile(problem):
    pairs = [p for p in FAMILY.space(problem)[:8] if p["cluster_m"] == 2]
    assert pairs
    for p in pairs:
        spec = FAMILY.launch(p, problem)
        assert spec.grid[0] % 2 == 0
        b = compile_cuda(FAMILY.render(p, problem), "sm_90a", cache_dir=None)
        assert b.ok and b.spill_bytes == 0, b.log[-1500:]


def test_few_swapped_tiles_with_a_long_k_split_it_and_lead():
    # 414 rows: 2 x 20 tiles of 208 x 128 fill 40 SMs; 3 K groups fill 120 (measured 1.01x against 0.58-0.79x);
    # multicast pairs in K groups enter before them (test_long_k_few_tiles_get_multicast_pairs_in_k_groups), a
    # cluster along N among them (test_long_k_under_a_wave_gets_one_cluster_of_4_along_n_after_the_leaders)
    space = [p for p in FAMILY.space(Problem(414, 2472, 11744, "kn"))
             if not (p["cluster_m"] > 1 and p["k_groups"] > 1) and p["cluster_n"] == 1]
    lead = space[AFTER["swap-fit"]]
    assert lead["swap_ab"] and (lead["block_m"], lead["block_n"], lead["k_groups"]) == (208, 128, 3)
    following = space[AFTER["swap-fit"] + 1]
    assert following["swap_ab"] and following["split_k"] > 1  # then a cluster split
    unsplit = [i for i, p in enumerate(space) if p["swap_ab"] and p["split_k"] * p["k_groups"] == 1]
    assert unsplit and min(unsplit) >= AFTER["swap-fit-alternates"]
    # one tile of rows (M <= 256): the listed split-K settings, measured 1.2-1.4x there, keep their places
    for problem in (Problem(131, 400, 5632, "kn"), Problem(71, 3584, 3584, "nk")):
        assert not any(p["swap_ab"] and p["split_k"] * p["k_groups"] > 1 for p in FAMILY.space(problem))


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_long_k_few_tiles_get_multicast_pairs_in_k_groups(layout):
    # 512_1024_8192: 64 x 128 pairs in 2 groups (64 k-tiles a CTA) measured 0.99-1.00x, the rules' first eight 0.94x
    space = FAMILY.space(Problem(512, 1024, 8192, layout))
    pairs = [p for p in space[:AFTER["pair-groups"] + 2] if p["cluster_m"] == 2 and p["k_groups"] > 1]
    assert len(pairs) == 2 and space[AFTER["pair-groups"]] == pairs[0]
    assert (pairs[0]["block_m"], pairs[0]["block_n"], pairs[0]["k_groups"]) == (64, 128, 2)
    for p in pairs:
        spec = FAMILY.launch(p, Problem(512, 1024, 8192, layout))
        assert spec.grid[0] >= 0.75 * 132 and 8192 // 64 // p["k_groups"] >= splits.PAIR_MIN_K_TILES
        assert spec.workspace_bytes > 0 and "multicast::cluster" in FAMILY.render(p, Problem(512, 1024, 8192, layout))
    # short K a CTA (measured 0.35-0.92x against split-K clusters), M <= 128, or tiles that fill the SMs: none
    for problem in (Problem(1024, 128, 4096, layout), Problem(1372, 192, 6168, layout),
                    Problem(128, 8192, 8192, layout), Problem(4096, 4096, 4096, layout)):
        assert not any(p["cluster_m"] > 1 and p["k_groups"] > 1 for p in FAMILY.space(problem)), problem.key


def test_swapped_tiles_beyond_a_wave_lead_persistent_with_tma_stores_where_the_ring_keeps_4_stages():
    for problem, rows in ((Problem(205, 50304, 1024, "kn"), 208), (Problem(222, 32000, 4096, "kn"), 224)):
        space = FAMILY.space(problem)
        swapped = [(i, p) for i, p in enumerate(space) if p["swap_ab"] and p["block_m"] == rows]
        (i, lead), (j, alternate) = swapped[:2]
        # chunked TMA stores leave the ring 4-5 stages beside C (the smem epilogue's whole C tile: 3)
        assert (i, lead["persistent"], lead["epilogue"]) == (AFTER["swap-fit"], True, "tma")
        assert lead["stages"] >= 4
        assert (j, alternate["persistent"], alternate["epilogue"]) == (AFTER["swap-fit-alternates"], False, "smem")


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_m_fitted_swapped_tiles_that_fill_whole_waves_lead_where_the_listed_leave_a_thin_last_one(layout):
    # 4772_1600_6400: 247 tiles of 256 x 128 (1.9 waves of 132), 260 of 240 x 128 swapped (1.97) with 28 rows padded;
    # measured (session 16) 0.999x of cuBLAS against the persistent lead's 0.906x
    problem = Problem(4772, 1600, 6400, layout)
    p = FAMILY.space(problem)[AFTER["swap-fit"]]
    assert (p["block_m"], p["block_n"], p["swap_ab"], p["persistent"], p["epilogue"]) == (240, 128, True, True, "tma")
    assert p["stages"] >= 4 and 2 * 132 - 4 <= problem.tiles(240, 128) <= 2 * 132 < problem.tiles(128, 256)


NARROW = [Problem(534, 32, 1120, "nk"), Problem(310, 40, 928, "kn")]


@pytest.mark.parametrize("problem", NARROW, ids=lambda p: p.key)
def test_narrow_n_few_tiles_lead_with_swapped_16_and_32_row_tiles_split_in_pairs(problem):
    # 534_32_1120: 18 CTAs of the listed 64 x 16; swapped 16 x 64 in pairs, 68 (measured 0.97-1.03x of cuBLAS
    # against 0.83-0.89x)
    lead = FAMILY.space(problem)[:2]
    assert [(p["block_m"], p["block_n"], p["swap_ab"], p["split_k"]) for p in lead] == [(16, 64, True, 2),
                                                                                       (32, 64, True, 2)]
    for p in lead:
        assert FAMILY.launch(p, problem).grid[0] == -(-problem.m // p["block_m"]) * 2 <= 132
        b = compile_cuda(FAMILY.render(p, problem), "sm_90a", cache_dir=None)
        assert b.ok and b.spill_bytes == 0 and b.stack_bytes == 0, b.log[-1500:]


@pytest.mark.parametrize("problem", [Problem(534, 32, 640, "nk"), Problem(534, 96, 1120, "nk"),
                                     Problem(4096, 32, 4096, "kn"), Problem(3204, 8, 24, "nk")], ids=lambda p: p.key)
def test_no_narrow_splits_where_k_is_short_n_wide_or_16_row_tiles_fill_a_wave(problem):
    assert not any(p["swap_ab"] and p["block_m"] in kinds.NARROW_ROWS and p["split_k"] > 1
                   for p in FAMILY.space(problem))


@pytest.mark.parametrize("problem", [Problem(933, 6912, 16, "kn"), Problem(933, 6912, 16, "nk"),
                                     Problem(12288, 1024, 64, "kn"), Problem(16384, 512, 128, "nk")],
                         ids=lambda p: p.key)
def test_short_k_many_tiles_lead_with_ping_pong_consumers(problem):
    space = FAMILY.space(problem)
    assert [(p["block_m"], p["block_n"], p["epilogue"]) for p in space[:2]] == [(64, 256, "tma"), (128, 128, "tma")]
    assert all(p.get("ping_pong") and p["persistent"] and p["consumers"] == 2 for p in space[:2])
    assert sum(bool(p.get("ping_pong")) for p in space[:5]) == 3  # and the smem-staged one among the first five


@pytest.mark.parametrize("problem", [Problem(7214, 896, 896, "nk"), Problem(3072, 2304, 768, "kn"),
                                     Problem(3619, 160, 208, "nk"), Problem(512, 512, 128, "kn"),
                                     Problem(64, 4096, 64, "nk")], ids=lambda p: p.key)
def test_no_ping_pong_where_k_is_longer_or_a_block_would_get_one_tile(problem):
    assert not any(p.get("ping_pong") for p in FAMILY.space(problem))


def _tall(problem):
    """(place, rows) of the tall swapped tiles, placed as in the order without the tail split (which comes second
    where it applies: tests/test_sm90_tail_split.py)."""
    order = [p for p in FAMILY.space(problem) if not p.get("tail_split")]
    return [(i, p["block_m"]) for i, p in enumerate(order)
            if p["swap_ab"] and p["block_n"] == 256 and p["persistent"] and p["epilogue"] == "tma"
            and p["block_m"] in kinds.TALL_ROWS]


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_tall_swapped_persistent_tiles_enter_after_the_leads_where_they_beat_128_rows_waves(layout):
    # 4437 rows: 35 tiles of 128 (9 waves of 132 at 32 columns of tiles), 28 of 160 (7 waves), 24 of 192 (6)
    for problem in (Problem(4437, 8192, 8192, layout), Problem(7471, 4096, 4096, layout)):
        tall = _tall(problem)
        assert [i for i, _ in tall] == [AFTER["tall"], AFTER["tall"] + 1], problem.key
        assert {bm for _, bm in tall} == {160, 192}
        for p in [p for p in FAMILY.space(problem) if not p.get("tail_split")][AFTER["tall"]:AFTER["tall"] + 2]:
            assert Sm90WgmmaParams(**p).stages >= 3


@pytest.mark.parametrize("problem", [Problem(4096, 4096, 4096, "nk"), Problem(8192, 8192, 8192, "kn"),
                                     Problem(6278, 12800, 1600, "nk"), Problem(1024, 1024, 1024, "kn"),
                                     Problem(4437, 128, 8192, "nk")], ids=lambda p: p.key)
def test_no_tall_swapped_tiles_where_128_rows_fill_the_waves_as_well_or_one_wave_holds_them(problem):
    assert _tall(problem) == []


@pytest.mark.parametrize("problem", [Problem(256, 4096, 4096), Problem(4096, 4096, 4096, "nk"),
                                     Problem(252, 49152, 3072), Problem(1000, 1000, 1000)], ids=lambda p: p.key)
def test_m_near_a_multiple_of_64_gets_no_swapped_tiles(problem):
    assert not any(p["swap_ab"] for p in FAMILY.space(problem))


def test_swapped_tma_stores_stage_two_16_row_chunks_a_warpgroup_beside_a_4_stage_ring():
    # 160 x 256 persistent (cuBLAS's large-shape tiling): the ring of 4 stages and 2 x 16 x 256 halves of C fit
    p = Sm90WgmmaParams(block_m=160, block_n=256, consumers=2, stages=4, swap_ab=True, epilogue="tma",
                        persistent=True)
    assert p.smem_bytes == 4 * (160 + 256) * 128 + 2 * 16 * 256 * 2 + 16 * 4 + 1024
    c_map = FAMILY.launch(p.model_dump(), Problem(4096, 4096, 4096, "nk")).tensor_maps[-1]
    assert c_map.operand == "C" and c_map.box == (64, 16)
    # the kernel's chunk is the one the box and the shared-memory size count
    assert "constexpr int C_CHUNK = 16;" in FAMILY.render(p.model_dump(), Problem(4096, 4096, 4096, "nk"))
    # unswapped, each warpgroup stages its whole share of the tile
    unswapped = Sm90WgmmaParams(block_m=128, block_n=256, consumers=2, stages=3, epilogue="tma", persistent=True)
    assert unswapped.smem_bytes == 3 * (128 + 256) * 128 + 128 * 256 * 2 + 16 * 3 + 1024


def test_swapped_accumulators_are_the_transposed_tile():
    p = Sm90WgmmaParams(block_m=16, block_n=256, consumers=1, stages=4, swap_ab=True)
    assert (p.wgmma_m, p.wgmma_n) == (256, 16) and p.accumulators == 4 * 16 // 2


@pytest.mark.parametrize("m,rows", [(1, 8), (9, 16), (17, 24), (64, 64), (1000, 64)])
def test_a_box_is_m_rounded_to_8_where_m_fits_one_tile(m, rows):
    """The kernel expects a_box_rows(M) * 128 bytes of A a stage: the same rule as the host's tensor map."""
    for params in ({"block_m": 64, "block_n": 64, "consumers": 1}, {"block_m": 64, "block_n": 64, "consumers": 1,
                                                                     "swap_ab": True, "epilogue": "smem"}):
        spec = FAMILY.launch(params, Problem(m, 256, 256, "kn"))
        a_map = next(t for t in spec.tensor_maps if t.operand == "A")
        assert a_map.box == (64, rows)
    assert "M < BM ? (M + 7) & ~7 : BM" in FAMILY.render({"block_m": 64, "consumers": 1}, Problem(m, 256, 256))


# few C tiles at M > 64 with a long K: split-K leads; some tiles: split-K enters after the best unsplit guesses
FEW_TILES = [Problem(1024, 128, 4096, "kn"), Problem(1024, 128, 4096, "nk"), Problem(768, 256, 4096, "nk")]


@pytest.mark.parametrize("problem", FEW_TILES, ids=lambda p: p.key)
def test_few_tiles_at_any_m_get_split_k_first_in_two_tilings(problem):
    space = FAMILY.space(problem)
    assert space[0]["split_k"] > 1 and space[1]["split_k"] > 1
    tiling = [(p["block_m"], p["block_n"], p["split_k"], p["k_groups"]) for p in space[:2]]
    assert tiling[0] != tiling[1], "the two leaders are two tilings, not one tiling's two rings"
    for p in space:
        if p["split_k"] > 1 or p["k_groups"] > 1:
            tiles = -(-problem.m // p["block_m"]) * -(-problem.n // p["block_n"])
            assert FAMILY.launch(p, problem).grid == (tiles * p["split_k"] * p["k_groups"], 1, 1)
            assert -(-problem.k // 64) // (p["split_k"] * p["k_groups"]) >= 16


def test_split_pairs_in_k_groups_where_a_cluster_of_four_misses_a_wave():
    """512_1024_8192: 32 tiles of 128 x 128 split 4 ways are 32 clusters of 4, more than run at once (30); as cluster
    pairs in 2 K groups they fit one wave, and each CTA keeps 32 k-tiles to amortise the workspace sums. At K = 4096
    (16 k-tiles a CTA) the sums cost more than the wave brings: no K groups there."""
    for layout in ("kn", "nk"):  # the split-K settings; multicast pairs in K groups have a test of their own
        space = [p for p in FAMILY.space(Problem(512, 1024, 8192, layout)) if p["cluster_m"] == 1]
        first = space[0]
        assert (first["block_m"], first["block_n"], first["split_k"], first["k_groups"]) == (128, 128, 2, 2)
        assert space[1]["k_groups"] == 1 and space[1]["split_k"] == 4
        grouped = {(p["block_m"], p["block_n"], p["consumers"]) for p in space if p["k_groups"] > 1}
        assert grouped == {(128, 128, 2)}, "K groups for the cheapest such tile only"
        assert all(p["k_groups"] == 1 for p in FAMILY.space(Problem(512, 1024, 4096, layout)))


def test_some_tiles_get_split_k_after_the_best_unsplit_guesses():
    problem = Problem(2048, 256, 4096, "nk")  # 64 x 64 tiles fill 128 SMs unsplit; 128 x 128 tiles only 32
    space = FAMILY.space(problem)
    first_split = next(i for i, p in enumerate(space) if p["split_k"] > 1 or p["k_groups"] > 1)
    assert first_split == AFTER["split-k-some"] and all(p["split_k"] == 1 for p in space[:first_split])


def test_fitted_tiles_enter_where_listed_shapes_quantise_badly_and_nowhere_else():
    # 140 tiles of 128 x 128: a second wave of 8; 128 x 176 makes 105, one wave
    odd = FAMILY.space(Problem(4437, 512, 3584, "nk"))
    listed = {(bm, bn) for bm, bn, _ in costs.TILES}
    fitted = [p for p in odd if (p["block_m"], p["block_n"]) not in listed and not p["swap_ab"]]
    assert fitted and odd.index(fitted[0]) == AFTER["fitted"]
    assert all(p["block_n"] % 16 == 0 for p in fitted)
    for problem in (Problem(414, 2472, 11744, "kn"), Problem(4437, 512, 3584, "kn")):  # kn: 64-column panels
        assert all(FAMILY.parse(p, problem) for p in FAMILY.space(problem))
    for problem in (Problem(4096, 4096, 4096, "nk"), Problem(1000, 1000, 1000, "kn")):
        assert all((p["block_m"], p["block_n"]) in listed for p in FAMILY.space(problem) if not p["swap_ab"])


@pytest.mark.parametrize("params", [
    {"block_m": 128, "block_n": 176, "consumers": 2, "stages": 5},  # fitted tiles
    {"block_m": 256, "block_n": 80, "consumers": 2, "stages": 5},
    {"block_m": 128, "block_n": 64, "consumers": 2, "stages": 8, "split_k": 2, "k_groups": 2},  # groups at M > 64
    {"block_m": 128, "block_n": 64, "consumers": 2, "stages": 8, "k_groups": 4},
    {"block_m": 144, "block_n": 192, "consumers": 3, "stages": 4, "swap_ab": True, "epilogue": "smem"},  # M-fitted
    {"block_m": 80, "block_n": 128, "consumers": 2, "stages": 6, "swap_ab": True, "epilogue": "smem", "split_k": 2},
    {"block_m": 208, "block_n": 128, "consumers": 2, "stages": 5, "swap_ab": True, "epilogue": "smem", "k_groups": 3},
    {"block_m": 208, "block_n": 128, "consumers": 2, "stages": 3, "swap_ab": True, "epilogue": "smem",
     "persistent": True},
    # swapped TMA stores: tall tiles (160-192 rows by 256), persistent beside a 3-4 stage ring
    {"block_m": 192, "block_n": 256, "consumers": 2, "stages": 3, "swap_ab": True, "epilogue": "tma",
     "persistent": True},
    {"block_m": 208, "block_n": 128, "consumers": 1, "stages": 5, "swap_ab": True, "epilogue": "tma"},
    # ping-pong: a whole tile's accumulators a consumer (128 x 128, 64 x 256), its C area beside the ring
    {"block_m": 128, "block_n": 128, "consumers": 2, "stages": 4, "persistent": True, "ping_pong": True,
     "epilogue": "tma"},
    {"block_m": 64, "block_n": 256, "consumers": 2, "stages": 4, "persistent": True, "ping_pong": True,
     "epilogue": "tma"},
], ids=str)
def test_new_kinds_compile_without_spills(params):
    problem = Problem(1024, 128, 4096, "nk")
    b = compile_cuda(FAMILY.render(params, problem), "sm_90a", cache_dir=None)
    assert b.ok and b.spill_bytes == 0 and b.stack_bytes == 0, b.log[-1500:]


# Register-tight settings of each epilogue (smem with setmaxnreg, persistent TMA store, split-K + K groups at the
# 240-register cap, swapped with K groups), compiled for bf16 and with a bias: the bias loads and adds and the bf16
# conversions must not spill. (Measured: every setting space() proposes for PROBLEMS compiles without spills for each
# pair, within a register of fp16 without bias.)
TIGHT = [
    ({"block_m": 128, "block_n": 256, "consumers": 2, "stages": 4}, Problem(4096, 4096, 4096, "kn")),
    ({"block_m": 128, "block_n": 256, "consumers": 2, "stages": 3, "persistent": True, "epilogue": "tma"},
     Problem(4096, 4096, 4096, "nk")),
    ({"block_m": 64, "block_n": 128, "consumers": 1, "stages": 8, "split_k": 2, "k_groups": 4},
     Problem(64, 1024, 16384, "kn")),
    ({"block_m": 16, "block_n": 128, "consumers": 1, "stages": 8, "swap_ab": True, "epilogue": "smem", "k_groups": 4},
     Problem(16, 4096, 4096, "nk")),
    ({"block_m": 240, "block_n": 128, "consumers": 2, "stages": 4, "swap_ab": True, "epilogue": "smem"},
     Problem(233, 4096, 4096, "kn")),
    ({"block_m": 128, "block_n": 128, "consumers": 2, "stages": 4, "persistent": True, "ping_pong": True,
      "epilogue": "tma"}, Problem(4096, 4096, 1024, "kn")),
]


@pytest.mark.parametrize("dtype,bias", PAIRS[1:], ids=lambda x: str(x))
@pytest.mark.parametrize("params,problem", TIGHT, ids=lambda x: x.key if isinstance(x, Problem) else "")
def test_bf16_and_bias_compile_without_spills(params, problem, dtype, bias):
    problem = Problem(problem.m, problem.n, problem.k, problem.b_layout, dtype, bias)
    src = FAMILY.render(params, problem)
    b = compile_cuda(src, "sm_90a", cache_dir=None)
    assert b.ok, b.log[-2000:]
    assert b.spill_bytes == 0 and b.stack_bytes == 0, b.log[-1500:]
    assert "serialized" not in b.log, "ptxas serialised the wgmma pipeline"
    p = Sm90WgmmaParams(**params)
    assert b.registers <= p.entry_regs and (b.registers == p.entry_regs or not p.set_maxnreg)
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{dtype}\.{dtype} ", src)
    assert f"cvt.rn.{dtype}x2.f32" in src
    # the bias pointer follows K, before the tensor maps, as sandbox.driver.launch passes it
    assert ("int K, const unsigned short* __restrict__ bias, const __grid_constant__ TmaMap tm_a" in src) == bias
    start = src.index("\nhgemm(")
    assert ("bias" in src[start:src.index(") {", start)]) == bias  # no bias argument without a bias


# One setting of each epilogue kind, and of each loader, cluster and role choice that changes how C is stored, on
# problems with ragged M, N (a multiple of 8, not of block_n) and K (not of 64), for the GPU checks of every pair.
_PLAIN = {"block_m": 128, "block_n": 128, "consumers": 2, "stages": 4}
_PERSISTENT = {"block_m": 128, "block_n": 64, "consumers": 2, "stages": 4, "persistent": True}
_SWAPPED = {"block_m": 32, "block_n": 128, "consumers": 1, "stages": 8, "swap_ab": True, "epilogue": "smem"}
GPU_KINDS = {
    "smem": (_PLAIN, (333, 1000, 520)),
    "direct": ({**_PLAIN, "epilogue": "direct"}, (333, 1000, 520)),
    "tma_store": ({**_PLAIN, "epilogue": "tma"}, (333, 1000, 520)),
    # 144 tiles on 132 SMs: some blocks take two, the second while the first one's stores drain
    "persistent_tma_store": ({**_PERSISTENT, "epilogue": "tma"}, (1100, 1000, 520)),
    "persistent_direct": ({**_PERSISTENT, "epilogue": "direct"}, (1100, 1000, 520)),
    "persistent_smem": ({**_PERSISTENT, "epilogue": "smem"}, (1100, 1000, 520)),
    "cp_async": ({**_PLAIN, "loader": "cp_async"}, (333, 1000, 520)),
    "multicast": ({**_PLAIN, "stages": 6, "cluster_m": 2}, (333, 1000, 520)),
    # swapped roles in multicast pairs: the B tile (wgmma's A operand) shared by CTAs on adjacent rows of M
    # persistent pairs: 17 row tiles make 9 pairs (the last CTA's rows past M), 72 pairs of tiles on 66 clusters
    "persistent_multicast": ({**_PERSISTENT, "block_n": 128, "cluster_m": 2, "epilogue": "tma"}, (2100, 1000, 520)),
    "persistent_multicast_smem": ({**_PERSISTENT, "block_n": 128, "stages": 3, "cluster_m": 2, "epilogue": "smem"},
                                  (2100, 1000, 520)),
    # multicast along N: each CTA loads 1 / cluster_n of A's rows (36 of 144: a share inside a swizzle atom); 15
    # column tiles padded to 16, 9 to 10: a trailing CTA past N; M under one tile: shares past M zero-filled
    "multicast_n": ({**_SWAPPED, "block_m": 144, "block_n": 64, "stages": 8, "cluster_n": 4}, (414, 904, 520)),
    "multicast_n_plain": ({**_PLAIN, "cluster_n": 2}, (333, 1096, 520)),
    "multicast_n_short_m": ({**_PLAIN, "cluster_n": 2}, (100, 1096, 520)),
    "multicast_n_k_groups": ({**_SWAPPED, "block_m": 208, "consumers": 2, "stages": 5, "k_groups": 3,
                              "cluster_n": 2}, (414, 1096, 8200)),
    "persistent_multicast_n": ({**_PERSISTENT, "block_n": 128, "cluster_n": 2, "epilogue": "tma"}, (2100, 1096, 520)),
    "swapped_multicast": ({**_SWAPPED, "block_m": 112, "block_n": 256, "consumers": 2, "stages": 4, "cluster_m": 2},
                          (333, 1000, 520)),
    "split_k": ({"block_m": 64, "block_n": 128, "consumers": 1, "stages": 8, "split_k": 4}, (100, 264, 8200)),
    "k_groups": ({"block_m": 64, "block_n": 64, "consumers": 1, "stages": 8, "k_groups": 4}, (77, 200, 8200)),
    "split_k_k_groups": ({"block_m": 64, "block_n": 128, "consumers": 1, "stages": 8, "split_k": 2, "k_groups": 2},
                         (100, 264, 8200)),
    "swapped": (_SWAPPED, (17, 1000, 520)),
    "swapped_split_k": ({**_SWAPPED, "split_k": 2}, (17, 1000, 8200)),
    "swapped_k_groups": ({**_SWAPPED, "block_m": 48, "k_groups": 3}, (40, 1000, 8200)),
    # N narrower than the one m64 wgmma of columns (N past it zero-filled, C's columns past N not stored), 34 row
    # tiles of 16 in split pairs
    "swapped_narrow_split_k": ({**_SWAPPED, "block_m": 16, "block_n": 64, "split_k": 2}, (534, 40, 1000)),
    "swapped_cp_async": ({**_SWAPPED, "loader": "cp_async"}, (17, 264, 520)),
    # M-fitted swapped tiles: several consumers, each its 64-row share of the B tile (C's columns)
    "swapped_fitted": ({**_SWAPPED, "block_m": 208, "consumers": 2, "stages": 4}, (414, 1000, 520)),
    "swapped_fitted_persistent": ({**_SWAPPED, "block_m": 144, "block_n": 192, "consumers": 3, "stages": 3,
                                   "persistent": True}, (1100, 1000, 520)),
    # swapped TMA stores in 16-row chunks: 13 chunks a tile (odd: the last chunk on the first buffer), M and N
    # off the tile; persistent, the next tile's first chunk waits for both buffers
    "swapped_tma_store": ({**_SWAPPED, "block_m": 208, "consumers": 2, "stages": 4, "epilogue": "tma"},
                          (414, 1000, 520)),
    "swapped_persistent_tma_store": ({**_SWAPPED, "block_m": 160, "block_n": 256, "consumers": 2, "stages": 4,
                                      "persistent": True, "epilogue": "tma"}, (4100, 1496, 520)),
    "swapped_fitted_split_k": ({**_SWAPPED, "block_m": 80, "consumers": 2, "stages": 6, "split_k": 2},
                               (150, 1000, 8200)),
    "swapped_fitted_k_groups": ({**_SWAPPED, "block_m": 208, "consumers": 2, "stages": 5, "k_groups": 3},
                                (414, 1000, 8200)),
    # multicast pairs in K groups: each CTA of a pair sums its own C tile's groups; 3 row tiles, so the second
    # pair's trailing CTA lies past M and still loads its share of B
    "multicast_k_groups": ({**_PLAIN, "stages": 6, "cluster_m": 2, "k_groups": 3}, (333, 1000, 8200)),
    "swapped_multicast_k_groups": ({**_SWAPPED, "block_m": 144, "block_n": 128, "consumers": 2, "stages": 5,
                                    "cluster_m": 2, "k_groups": 3}, (414, 1000, 8200)),
    # ping-pong: 33 x 9 tiles on 132 blocks, 2-3 a block (the odd third on consumer 0), each consumer skipping the
    # other's 9 k-tiles (K off 64) in a 4-stage ring; 33 x 16 of 64 columns: 4 a block
    "ping_pong_tma_store": ({**_PERSISTENT, "block_n": 128, "ping_pong": True, "epilogue": "tma"}, (4100, 1096, 520)),
    "ping_pong_smem": ({**_PERSISTENT, "ping_pong": True, "epilogue": "smem"}, (4100, 1000, 520)),
    "ping_pong_direct": ({**_PERSISTENT, "block_m": 64, "block_n": 256, "ping_pong": True, "epilogue": "direct"},
                        (4100, 1096, 520)),
    "ping_pong_cp_async": ({**_PERSISTENT, "ping_pong": True, "epilogue": "smem", "loader": "cp_async"},
                          (4100, 1000, 520)),
    # tile orders: grouped along N (3 columns a group, the last group of 16 x 64-column tiles short), snaking
    "raster_n_snake": ({**_PLAIN, "raster_along": "n", "raster_group": 3, "raster_snake": True}, (333, 1000, 520)),
    "raster_n_snake_persistent": ({**_PERSISTENT, "raster_along": "n", "raster_group": 4, "raster_snake": True},
                                  (1000, 1096, 520)),
    "raster_m_snake_multicast": ({**_PERSISTENT, "block_n": 128, "cluster_m": 2, "raster_group": 2,
                                  "raster_snake": True},
                                 (1000, 1096, 520)),
    # C stored one 64-column panel at a time through two buffers: 3 panels a tile (the last on the first buffer),
    # persistent (the next tile's first panel waits for both), 4 stages; a one-tile block; ping-pong; 256 rows
    "c_panels_persistent": ({**_PERSISTENT, "block_n": 192, "epilogue": "tma", "c_panels": True},
                            (1000, 1096, 520)),
    "c_panels_one_tile": ({**_PLAIN, "block_n": 192, "epilogue": "tma", "c_panels": True}, (333, 1000, 520)),
    "c_panels_ping_pong": ({**_PERSISTENT, "block_n": 128, "ping_pong": True, "epilogue": "tma", "c_panels": True},
                           (4100, 1096, 520)),
    "c_panels_256_rows": ({**_PERSISTENT, "block_m": 256, "block_n": 128, "stages": 3, "epilogue": "tma",
                           "c_panels": True}, (1000, 1096, 520)),
}


def tile_order(params: dict, tiles_m: int, tiles_n: int) -> list[tuple[int, int]]:
    """The (tile-row, tile-column) of each tile index, by the rendered kernel's own tile_origin, compiled for the
    host with g++ and run."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    source = FAMILY.render(params, Problem(tiles_m * params["block_m"], tiles_n * params["block_n"], 64, "nk"))
    code = "\n".join(re.search(rf"^constexpr [a-z ]*\b{name} = .*$", source, re.M).group(0)
                     for name in ("BM", "BN", "GROUP", "RASTER_N", "SNAKE"))
    body = re.search(r"__device__ __forceinline__ void tile_origin\(.*?\n}", source, re.S).group(0)
    code += "\n" + body.replace("__device__ __forceinline__", "inline") + f"""
#include <cstdio>
int main() {{
    for (int t = 0; t < {tiles_m * tiles_n}; ++t) {{
        int m0, n0;
        tile_origin(t, {tiles_m}, {tiles_n}, m0, n0);
        std::printf("%d %d\\n", m0 / BM, n0 / BN);
    }}
}}
"""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "t.cpp").write_text(code)
        subprocess.run(["g++", "-std=c++17", "-o", f"{d}/t", f"{d}/t.cpp"], check=True)
        out = subprocess.run([f"{d}/t"], capture_output=True, text=True, check=True).stdout
    return [tuple(map(int, line.split())) for line in out.splitlines()]


@pytest.mark.parametrize("along", ["m", "n"])
@pytest.mark.parametrize("snake", [False, True])
def test_every_tile_order_visits_each_tile_once_in_groups(along, snake):
    base = {**_PLAIN, "raster_group": 3, "raster_along": along, "raster_snake": snake}
    order = tile_order(base, 7, 5)
    assert sorted(order) == [(m, n) for m in range(7) for n in range(5)]  # each tile once
    grouped = 0 if along == "m" else 1
    first = [t[grouped] // 3 for t in order]
    assert first == sorted(first)  # groups of 3 tile-rows (columns) one after another, the last one short
    walk = [t[1 - grouped] for t in order[:3 * (5 if along == "m" else 7)]]
    assert walk == sorted(walk)  # the first group walks forward across the other dimension
    second = [t[1 - grouped] for t in order[3 * (5 if along == "m" else 7):6 * (5 if along == "m" else 7)]]
    assert second == sorted(second, reverse=snake)  # the second forward again, or back where snaking
    if along == "m" and not snake:  # today's order, as the template had it before the fields existed
        assert order[:4] == [(0, 0), (1, 0), (2, 0), (0, 1)] and order[-2:] == [(6, 3), (6, 4)]


def test_the_tile_order_fields_are_written_only_where_set():
    plain = Sm90WgmmaParams(**_PERSISTENT)
    assert not {"raster_along", "raster_snake"} & set(plain.model_dump())  # ids and database rows as before
    p = Sm90WgmmaParams(**{**_PERSISTENT, "raster_along": "n", "raster_snake": True})
    assert p.model_dump()["raster_along"] == "n" and p.model_dump()["raster_snake"] is True
    assert Sm90WgmmaParams(**p.model_dump()) == p
    for arch in ("sm_90a",):
        assert compile_cuda(FAMILY.render(p.model_dump(), Problem(1000, 1096, 520, "nk")), arch).ok


@pytest.mark.parametrize("update, panels", [
    ({"epilogue": "tma"}, True), ({"epilogue": "tma", "persistent": False}, True),
    ({"epilogue": "tma", "block_n": 128, "ping_pong": True}, True), ({"epilogue": "smem"}, False),
    ({**_SWAPPED, "epilogue": "tma"}, False)])
def test_a_residual_comes_by_tma_into_the_c_panels_where_whole_tiles_are_stored_by_tma(update, panels):
    """R's tensor map has C's dims and boxes and follows C's; the kernel takes it as its last map and adds R from
    the panels (ldmatrix) instead of loading it into registers after the mainloop."""
    problem = Problem(1000, 1096, 520, "nk", "f16", True, "residual")
    p = Sm90WgmmaParams(**{**_PERSISTENT, **update})
    assert p.residual_panels is panels
    maps = FAMILY.launch(p.model_dump(), problem).tensor_maps
    source = FAMILY.render(p.model_dump(), problem)
    assert ("TmaMap tm_r" in source) is panels
    assert ("R_PANELS = RESIDUAL && true" in source) is panels  # ldmatrix + add, not add_residual's loads
    if panels:
        assert [m.operand for m in maps] == ["A", "B", "C", "R"]
        assert (maps[3].dims, maps[3].box, maps[3].swizzle) == (maps[2].dims, maps[2].box, maps[2].swizzle)
    else:
        assert "R" not in [m.operand for m in maps]
    plain = FAMILY.launch(p.model_dump(), replace(problem, epilogue="none")).tensor_maps
    assert "R" not in [m.operand for m in plain]
    assert "TmaMap tm_r" not in FAMILY.render(p.model_dump(), replace(problem, epilogue="none"))
    assert compile_cuda(source, "sm_90a").ok


def test_c_panels_stage_two_64_column_panels_a_warpgroup_so_a_persistent_128x256_keeps_4_stages():
    base = {"block_m": 128, "block_n": 256, "stages": 4, "persistent": True, "epilogue": "tma"}
    with pytest.raises(ValueError, match="shared memory"):
        Sm90WgmmaParams(**base)  # the whole tile's staging beside a 4-stage ring does not fit
    p = Sm90WgmmaParams(**base, c_panels=True)
    assert p.smem_bytes == 4 * 384 * 128 + 2 * 128 * 128 + 16 * 4 + 1024
    assert "c_panels" not in Sm90WgmmaParams(**{**base, "stages": 3}).model_dump()  # named only where set
    for bad in ({"epilogue": "smem"}, {**_SWAPPED, "epilogue": "tma"}):
        with pytest.raises(ValueError, match="c_panels"):
            Sm90WgmmaParams(**{**base, **bad, "c_panels": True})
    residual = Problem(1000, 1096, 520, "nk", "f16", False, "residual")
    assert not p.residual_panels and [m.operand for m in FAMILY.launch(p.model_dump(), residual).tensor_maps] == \
        ["A", "B", "C"]  # R by the register path: the panels hold one 64-column panel, not the tile
    for problem in (Problem(1000, 1096, 520, "nk"), residual, Problem(1000, 1024, 520, "kn", "bf16", True,
                                                                       "silu_mul")):
        source = FAMILY.render(p.model_dump(), problem)
        assert "C_PANELS = true" in source and compile_cuda(source, "sm_90a").ok


def test_ping_pong_consumers_take_whole_tiles_and_reject_what_they_cannot_do():
    pp = {**_PERSISTENT, "block_n": 128, "ping_pong": True, "epilogue": "tma"}
    p = Sm90WgmmaParams(**pp)
    # each consumer a whole 128 x 128 tile of accumulators and a C area of its own; its TMA stores cover all its rows
    assert p.accumulators == 128 and p.smem_bytes == 4 * 256 * 128 + 2 * 128 * 128 * 2 + 16 * 5 + 1024
    spec = FAMILY.launch(pp, Problem(4100, 1096, 520, "nk"))
    assert spec.tensor_maps[-1].box == (64, 128) and spec.grid == (132, 1, 1)
    # the field is written only where set: every other setting keeps the dict (and candidate id) it had before
    assert "ping_pong" not in Sm90WgmmaParams(**_PERSISTENT).model_dump() and p.model_dump()["ping_pong"] is True
    assert Sm90WgmmaParams(**p.model_dump()) == p
    for update in ({"persistent": False}, {"consumers": 1}, {"swap_ab": True, "epilogue": "smem"},
                   {"cluster_m": 2}):
        with pytest.raises(ValueError, match="ping_pong"):
            Sm90WgmmaParams(**{**pp, **update})
    with pytest.raises(ValueError, match="accumulator registers"):  # a whole 128 x 256 tile a consumer
        Sm90WgmmaParams(**{**pp, "block_n": 256, "stages": 2})


def test_gpu_kinds_are_valid_settings():
    for params, mnk in GPU_KINDS.values():
        for layout in ("kn", "nk"):
            FAMILY.launch(params, Problem(*mnk, layout, "bf16", True))


@pytest.mark.gpu
@pytest.mark.parametrize("params,problem", cases(GPU_KINDS))
def test_every_epilogue_kind_is_exact_and_close_to_torch(params, problem):
    check_kernel("sm90_wgmma", params, problem)


# kn only: tiles off 64 columns in whole B panels; at N = 1000 the last column tile (n0 960 at 240, 880 at 176) is
# brought one panel a copy by the plain map, the others by the 4-D view
B_PANEL_KINDS = {
    "b_panels_240": ({"block_m": 128, "block_n": 240, "consumers": 2, "stages": 4, "b_panels": True}, (333, 1000, 520)),
    "b_panels_176": ({"block_m": 128, "block_n": 176, "consumers": 2, "stages": 4, "b_panels": True}, (333, 1000, 520)),
    "b_panels_small_n": ({"block_m": 128, "block_n": 240, "consumers": 2, "stages": 4, "b_panels": True},
                         (333, 200, 520)),
    "b_panels_persistent": ({"block_m": 128, "block_n": 240, "consumers": 2, "stages": 3, "b_panels": True,
                             "persistent": True}, (1100, 1000, 520)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("params,problem", [c for c in cases(B_PANEL_KINDS) if "-kn-" in c.id])
def test_b_panels_tiles_are_exact_and_close_to_torch(params, problem):
    check_kernel("sm90_wgmma", params, problem)


def test_b_panel_kinds_are_valid_settings():
    for params, mnk in B_PANEL_KINDS.values():
        spec = FAMILY.launch(params, Problem(*mnk, "kn", "bf16", True))
        assert [t.operand for t in spec.tensor_maps] == ["A", "B", "B"]


@pytest.mark.parametrize("group, wave", [(3, 4), (3, 11), (8, 16), (1, 5)])
def test_the_byte_model_reads_the_panels_of_the_kernels_own_tile_order(group, wave):
    from templates.sm90_wgmma.costs import wave_bytes

    tiles_m, tiles_n = 13, 7
    order = tile_order({**_PLAIN, "raster_group": group}, tiles_m, tiles_n)
    expect = 0
    for w0 in range(0, len(order), wave):
        part = order[w0:w0 + wave]
        expect += len({m for m, _ in part}) * 1000 + len({n for _, n in part}) * 1
    assert wave_bytes(tiles_m, tiles_n, group, wave, 1000, 1) == expect


def test_a_waves_panels_stay_in_l2_for_the_next_only_where_they_fit():
    from templates.sm90_wgmma.costs import wave_bytes

    # 4 tile-rows x 8 tile-columns in one group, waves of 4 tiles: each wave is the 4 rows and one column
    streamed = 8 * (4 * 10 + 1)  # every wave reads its 4 A panels again
    assert wave_bytes(4, 8, 4, 4, 10, 1) == streamed
    assert wave_bytes(4, 8, 4, 4, 10, 1, reuse_bytes=40) == streamed  # a wave's 41 bytes do not fit: k-slices stream
    assert wave_bytes(4, 8, 4, 4, 10, 1, reuse_bytes=41) == 4 * 10 + 8  # they fit: A's panels are read once
    assert wave_bytes(4, 8, 4, 4, 10, 1, reuse_bytes=10 ** 6) == 4 * 10 + 8
