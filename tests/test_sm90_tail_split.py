"""sm90_wgmma's tail split: a persistent grid's last, part-filled round of tiles cut along K, the ranges summed through
the workspace by the last CTA to arrive (docs/decisions.md `tail-split`)."""

from __future__ import annotations

import pytest

from core.device import H200
from core.plan import ceil_div
from core.records import Problem
from templates import get_family
from templates.sm90_wgmma.params import TAIL_FILL, TAIL_SUM, Sm90WgmmaParams, launched_tiles, tail_cut
from templates.sm90_wgmma.search import traced
from tests.gpu_reference import cases, check_kernel
from tests.helpers import builds_in_both_layouts

FAMILY = get_family("sm90_wgmma")
P3 = {"block_m": 128, "block_n": 256, "stages": 3, "persistent": True, "epilogue": "tma"}


def test_named_only_where_set_and_only_with_persistent_blocks_without_clusters():
    assert "tail_split" not in Sm90WgmmaParams(**P3).model_dump()  # ids and database rows as before
    p = Sm90WgmmaParams(**P3, tail_split=True)
    assert p.model_dump()["tail_split"] is True and Sm90WgmmaParams(**p.model_dump()) == p
    for bad in ({"persistent": False}, {"block_n": 128, "ping_pong": True}, {"block_n": 128, "cluster_m": 2},
                {"block_n": 128, "cluster_n": 2}):
        with pytest.raises(ValueError, match="tail_split"):
            Sm90WgmmaParams(**{**P3, **bad, "tail_split": True})


def test_the_launch_passes_partial_tiles_and_a_counter_per_cta():
    problem = Problem(7471, 4096, 4096, "nk")
    spec = FAMILY.launch({**P3, "tail_split": True}, problem)
    assert spec.grid == (H200.sms, 1, 1)
    assert (spec.workspace_bytes, spec.counters) == (H200.sms * 128 * 256 * 4, H200.sms)
    # the kernel's split fits it: rem x parts partial tiles, rem counters
    tiles = ceil_div(7471, 128) * ceil_div(4096, 256)
    parts, last = tail_cut(tiles, H200.sms, ceil_div(4096, 64))
    assert (tiles % H200.sms, parts) == (20, 4)  # 7 whole rounds, 20 tiles in 4 ranges of 16 k-tiles
    assert last == pytest.approx((16 + TAIL_FILL + 4 * TAIL_SUM) / 64)  # one short round
    assert tiles % H200.sms * parts * 128 * 256 * 4 <= spec.workspace_bytes
    plain = FAMILY.launch(P3, problem)
    assert (plain.workspace_bytes, plain.counters) == (0, 0)
    source = FAMILY.render({**P3, "tail_split": True}, problem)
    assert "constexpr bool TAIL = true" in source and "float* __restrict__ ws, u32* __restrict__ counters" in source
    assert "constexpr bool TAIL = false" in FAMILY.render(P3, problem)


@pytest.mark.parametrize("tiles,k_tiles,parts", [
    (1056, 64, 1),  # whole rounds
    (944, 64, 4), (560, 64, 4), (140, 64, 4),  # ranges of 16: shorter ones cost more sums than they save
    (140, 256, 8), (1120, 128, 2),  # long K: more ranges; at most as many ranges as the grid holds
    (944, 16, 1), (944, 7, 1),  # short K: the fill outweighs what a cut saves
    (624, 172, 1), (2048, 128, 1),  # more than half full: two ranges would not fit one round
    (512, 64, 1), (2500, 25, 1)])  # nearly full
def test_a_tail_tile_is_cut_into_the_ranges_that_end_the_round_soonest(tiles, k_tiles, parts):
    assert tail_cut(tiles, H200.sms, k_tiles)[0] == parts
    assert tiles % H200.sms * parts <= H200.sms  # one range a CTA: the workspace holds them


def test_a_residual_with_a_tail_split_is_loaded_after_the_sum_not_into_the_panels():
    p = Sm90WgmmaParams(**P3, tail_split=True)
    assert not p.residual_panels and Sm90WgmmaParams(**P3).residual_panels


@pytest.mark.parametrize("problem", [Problem(7471, 4096, 4096, "nk"), Problem(4437, 8192, 8192, "kn"),
                                     Problem(4437, 4096, 4096, "nk")], ids=lambda p: p.key)
def test_a_part_filled_last_round_gets_one_tail_split_setting_second(problem):
    order = traced(problem)
    names = [name for name, _ in order]
    assert names.count("tail-split") == 1 and names.index("tail-split") == 1
    p = order[1][1]
    assert p.tail_split and p.persistent
    tiles = ceil_div(problem.m, p.block_m) * ceil_div(problem.n, p.block_n)
    assert tail_cut(tiles, H200.sms, ceil_div(problem.k, 64))[0] > 1  # a part-filled last round a cut shortens


@pytest.mark.parametrize("problem", [Problem(4981, 4096, 11008, "nk"), Problem(8192, 8192, 8192, "kn")],
                         ids=lambda p: p.key)
def test_the_tall_swapped_tile_gets_its_own_tail_split_third_where_the_cut_shortens_its_rounds(problem):
    # 4981 rows: 26 x 16 tiles of 192 x 256, 3.15 rounds of 132: the last 20 tiles cut along K
    order = traced(problem)
    names = [name for name, _ in order]
    assert names.count("tail-split-tall") == 1 and names.index("tail-split-tall") == 2
    p = order[2][1]
    assert p.tail_split and p.swap_ab and (p.block_m, p.block_n) == (192, 256) and p.persistent
    tiles = ceil_div(problem.m, p.block_m) * ceil_div(problem.n, p.block_n)
    assert tail_cut(tiles, H200.sms, ceil_div(problem.k, 64))[0] > 1


@pytest.mark.parametrize("problem", [Problem(4437, 8192, 8192, "nk"), Problem(7471, 4096, 4096, "nk"),
                                     Problem(4224, 4096, 4096, "nk")], ids=lambda p: p.key)
def test_no_tall_tail_split_where_its_last_round_is_whole_or_more_than_half_full(problem):
    # 4437 and 7471 rows: 24 x 32 and 39 x 16 tiles of 192 x 256, 5.8 and 4.7 rounds: a cut does not shorten them
    assert "tail-split-tall" not in [name for name, _ in traced(problem)]


@pytest.mark.parametrize("problem", [Problem(4224, 4096, 4096, "nk"), Problem(7471, 4096, 256, "nk"),
                                     Problem(64, 4096, 4096, "nk"), Problem(4096, 4096, 4096, "nk")],
                         ids=lambda p: p.key)
def test_whole_rounds_short_k_or_small_problems_get_none(problem):
    assert "tail-split" not in [name for name, _ in traced(problem)]


# GPU kinds on 132 SMs, K of 49 k-tiles (the last one 24 columns): a round and a quarter of tiles (165: 33 in 4 ranges
# of 12-13 k-tiles), every store path, swapped tiles; a last round of 48 tiles in 2 ranges
TAIL_KINDS = {
    "tail_of_4_parts_tma": ({**P3, "tail_split": True}, (4100, 1096, 3096)),
    "tail_of_2_parts_tma": ({**P3, "tail_split": True}, (4548, 1096, 3096)),
    "tail_smem": ({**P3, "epilogue": "smem", "tail_split": True}, (4100, 1096, 3096)),
    "tail_direct": ({"block_m": 128, "block_n": 128, "stages": 4, "persistent": True, "epilogue": "direct",
                     "tail_split": True}, (4100, 1096, 3096)),
    "tail_swapped": ({"block_m": 208, "block_n": 128, "consumers": 2, "stages": 3, "swap_ab": True,
                      "persistent": True, "epilogue": "smem", "tail_split": True}, (4100, 1096, 3096)),
}


def test_every_kind_cuts_its_last_round():
    for params, mnk in TAIL_KINDS.values():
        tiles = launched_tiles(Sm90WgmmaParams(**params), Problem(*mnk, "nk"))
        assert tail_cut(tiles, H200.sms, ceil_div(mnk[2], 64))[0] > 1, params


@pytest.mark.parametrize("kind", list(TAIL_KINDS))
def test_every_kind_compiles_without_spills(kind):
    params, mnk = TAIL_KINDS[kind]
    builds_in_both_layouts("sm90_wgmma", params, mnk)


@pytest.mark.gpu
@pytest.mark.parametrize("params,problem", cases(TAIL_KINDS))
def test_every_tail_kind_is_exact_and_close_to_torch(params, problem):
    check_kernel("sm90_wgmma", params, problem)
