"""sm90_wgmma's mixed tail: a persistent grid's last tile-rows in 192-column tiles of a 256-column tiling, so that a
part-filled last round ends sooner (docs/decisions.md `mixed-tail`)."""

from __future__ import annotations

import pytest

from core.device import H200
from core.plan import ceil_div
from core.records import Problem
from templates import get_family
from templates.sm90_wgmma.params import MIXED_GAIN, NARROW_COST, Sm90WgmmaParams, mixed_rows
from templates.sm90_wgmma.search import traced
from tests.gpu_reference import cases, check_in_sandbox, check_kernel
from tests.helpers import clean_build

FAMILY = get_family("sm90_wgmma")
P3 = {"block_m": 128, "block_n": 256, "stages": 3, "persistent": True, "epilogue": "tma"}
MIXED = {**P3, "mixed_tail": True}


def test_named_only_where_set_and_only_with_persistent_whole_tile_tma_stores():
    assert "mixed_tail" not in Sm90WgmmaParams(**P3).model_dump()  # ids and database rows as before
    p = Sm90WgmmaParams(**MIXED)
    assert p.model_dump()["mixed_tail"] is True and Sm90WgmmaParams(**p.model_dump()) == p
    for bad in ({"persistent": False}, {"block_n": 192}, {"epilogue": "smem"}, {"c_panels": True},
                {"tail_split": True}, {"cluster_m": 2}, {"loader": "cp_async"},
                {"block_n": 128, "ping_pong": True}):
        with pytest.raises(ValueError, match="mixed_tail"):
            Sm90WgmmaParams(**{**MIXED, **bad})


@pytest.mark.parametrize("m,n,rows,busiest", [
    (4981, 4096, 6, 4 + NARROW_COST),  # 4 whole rounds of wide rows, then 132 narrow tiles: one round
    (2700, 4040, 6, 2 + NARROW_COST),  # 256 wide tiles, then 132 narrow
    (4981, 1096, 39, 2 * NARROW_COST),  # every row narrow: 234 tiles in two short rounds
    (2048, 4096, 0, 2),  # 124 of 132 in the last round: a narrow round would not end sooner
    (2048, 28672, 0, 14),  # one narrow row would end 0.2 sooner, but read B from DRAM a tile
    (1246, 3072, 0, 1),  # one round: nothing to save
    (4224, 4096, 0, 4),  # whole rounds
])
def test_the_kernel_cuts_the_rows_that_end_the_busiest_cta_soonest(m, n, rows, busiest):
    tiles_m, tiles_n, tiles_nn = ceil_div(m, 128), ceil_div(n, 256), ceil_div(n, 192)
    assert mixed_rows(tiles_m, tiles_n, tiles_nn, H200.sms) == (rows, pytest.approx(busiest))
    # none saves MIXED_GAIN of a tile over another count
    whole = ceil_div(tiles_m * tiles_n, H200.sms)
    assert busiest <= whole and (rows == 0 or busiest <= whole - MIXED_GAIN)


def test_the_closed_form_is_the_busiest_cta_of_round_robin_dealing():
    import random

    from templates.sm90_wgmma import params as P

    def dealt(tiles_m, tiles_n, tiles_nn, grid, rows):  # every unit to CTA unit % grid: wide ones, then narrow
        load = [0.0] * grid
        units = [1.0] * ((tiles_m - rows) * tiles_n) + [NARROW_COST] * (rows * tiles_nn)
        for u, cost in enumerate(units):
            load[u % grid] += cost
        return max(load)

    rng = random.Random(7)
    for _ in range(300):
        tiles_m, tiles_n, grid = rng.randint(1, 60), rng.randint(1, 40), rng.choice([8, 66, 114, 132])
        tiles_nn = ceil_div(tiles_n * 256 - rng.randint(0, 255), 192)
        rows, busiest = mixed_rows(tiles_m, tiles_n, tiles_nn, grid)
        whole = ceil_div(tiles_m * tiles_n, grid)
        times = {r: dealt(tiles_m, tiles_n, tiles_nn, grid, r) for r in range(P.NARROW_ROWS_MIN, tiles_m + 1)}
        better = [r for r, t in times.items() if t < whole - MIXED_GAIN - 1e-9]
        if not better:
            assert (rows, busiest) == (0, whole)
        else:
            least = min(times[r] for r in better)
            assert rows == min(r for r in better if abs(times[r] - least) < 1e-9)
            assert busiest == pytest.approx(least)


def test_the_render_has_the_narrow_wgmma_only_with_a_mixed_tail():
    problem = Problem(4981, 4096, 11008, "kn")
    source = FAMILY.render(MIXED, problem)
    assert "constexpr bool MIXED = true" in source and "m64n192k16" in source
    plain = FAMILY.render(P3, problem)
    assert "constexpr bool MIXED = false" in plain and "m64n192k16" not in plain
    mixed, plain = FAMILY.launch(MIXED, problem), FAMILY.launch(P3, problem)
    assert mixed.grid == plain.grid and len(mixed.tensor_maps) == len(plain.tensor_maps) + 1  # tm_b2: narrow B


def test_a_gated_epilogue_takes_the_setting_without_it():
    problem = Problem(4981, 8192, 4096, "nk", epilogue="silu_mul")
    with pytest.raises(ValueError, match="mixed_tail"):
        FAMILY.check_for_problem(Sm90WgmmaParams(**MIXED), problem)
    assert not any(s.get("mixed_tail") for s in FAMILY.space(problem))


@pytest.mark.parametrize("problem", [Problem(4981, 4096, 11008, "nk"), Problem(4981, 4096, 11008, "kn"),
                                     Problem(3000, 5000, 4096, "kn")], ids=lambda p: p.key)
def test_a_more_than_half_filled_last_round_gets_one_mixed_tail_setting(problem):
    order = traced(problem)
    names = [name for name, _ in order]
    assert names.count("mixed-tail") == 1 and names.index("mixed-tail") <= 6
    assert order[names.index("mixed-tail")][1].mixed_tail


@pytest.mark.parametrize("problem", [Problem(4224, 4096, 4096, "nk"), Problem(2048, 4096, 4096, "nk"),
                                     Problem(64, 4096, 4096, "nk"), Problem(8192, 8192, 8192, "nk"),
                                     Problem(1024, 128, 4096, "kn")],
                         ids=lambda p: p.key)
def test_whole_or_nearly_whole_rounds_or_one_round_get_none(problem):
    assert "mixed-tail" not in [name for name, _ in traced(problem)]


# GPU kinds on 132 SMs, K of 49 k-tiles (the last one 24 columns): wide and narrow rows with M and N ragged (the last
# row 12 rows, the last narrow tile 8 columns, N not a multiple of 64), and every row narrow
MIXED_KINDS = {
    "wide_and_narrow": (MIXED, (2700, 4040, 3096)),
    "all_narrow": (MIXED, (4981, 1096, 3096)),
}


def test_every_kind_cuts_narrow_rows():
    for _, (m, n, _k) in MIXED_KINDS.values():
        assert mixed_rows(ceil_div(m, 128), ceil_div(n, 256), ceil_div(n, 192), H200.sms)[0] > 0, (m, n)


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("epilogue", ["none", "residual"])
def test_every_kind_compiles_without_spills(layout, epilogue):
    clean_build("sm90_wgmma", MIXED, Problem(2700, 4040, 3096, layout, "bf16", True, epilogue))


@pytest.mark.gpu
@pytest.mark.parametrize("params,problem", cases(MIXED_KINDS))
def test_every_mixed_kind_is_exact_and_close_to_torch(params, problem):
    check_kernel("sm90_wgmma", params, problem)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_a_residual_with_a_mixed_tail_passes_the_sandbox(layout):
    check_in_sandbox("sm90_wgmma", MIXED, Problem(2700, 4040, 3096, layout, "f16", True, "residual"))
