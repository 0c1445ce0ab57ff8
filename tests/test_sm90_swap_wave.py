"""sm90_wgmma's swap-wave rule: swapped tiles of 192 columns (three consumers) with M-fitted rows, where their rounds
fill the SMs better than the first four settings (docs/decisions.md `swap-wave`)."""

from __future__ import annotations

import pytest

from core.device import H200
from core.records import Problem
from templates.sm90_wgmma import search
from templates.sm90_wgmma.search import traced
from tests.gpu_reference import cases, check_kernel
from tests.helpers import builds_in_both_layouts

AFTER = {rule.name: rule.after for rule in search.RULES}


def _wave(problem: Problem) -> list[tuple[int, object]]:
    return [(i, p) for i, (name, p) in enumerate(traced(problem)) if name == "swap-wave"]


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_one_wave_of_120_wide_tiles_gets_128_tiles_of_160_by_192_third(layout):
    # 1246 rows: 10 x 12 = 120 tiles of 128 x 256 leave 12 of 132 SMs idle; 8 x 16 = 128 of 160 x 192 are 6% smaller
    problem = Problem(1246, 3072, 8192, layout)
    (at, p), = _wave(problem)
    assert at == AFTER["swap-wave"]
    assert (p.block_m, p.block_n, p.consumers, p.swap_ab, p.epilogue) == (160, 192, 3, True, "tma")
    assert not p.persistent and p.stages == 5
    assert problem.tiles(p.block_m, p.block_n) == 128 <= H200.sms


def test_beyond_a_wave_the_setting_is_persistent():
    # 2074 x 4096: 12 x 22 = 264 tiles of 176 x 192 are two whole rounds; 192 x 128 tiles take 2.7
    (_, p), = _wave(Problem(2074, 4096, 4096, "kn"))
    assert (p.block_m, p.block_n, p.persistent, p.epilogue) == (176, 192, True, "tma")


@pytest.mark.parametrize("problem", [Problem(4096, 4096, 4096, "nk"), Problem(8192, 8192, 8192, "kn"),
                                     Problem(8019, 8192, 8192, "kn"), Problem(1024, 4096, 4096, "kn"),
                                     Problem(4981, 4096, 11008, "nk"), Problem(64, 4096, 4096, "kn"),
                                     Problem(1246, 128, 8192, "kn")], ids=lambda p: p.key)
def test_none_where_the_first_four_fill_the_rounds_as_well_or_n_is_narrow(problem):
    # 8019 rows: 176 x 192 take 15 rounds against 16 of 128 x 256, but the tail split's cut round is ahead
    assert _wave(problem) == []


# the rule's kinds with a ragged M, N and K (the last k-tile 24 columns): one wave of 56 tiles and a persistent grid
# of 14 x 11 = 154 tiles (a round and a sixth)
WAVE_KINDS = {
    "one_wave": ({"block_m": 160, "block_n": 192, "consumers": 3, "stages": 5, "swap_ab": True, "epilogue": "tma"},
                 (1110, 1352, 1496)),
    "persistent": ({"block_m": 176, "block_n": 192, "consumers": 3, "stages": 4, "swap_ab": True,
                    "epilogue": "tma", "persistent": True}, (2434, 2072, 1496)),
}


@pytest.mark.parametrize("kind", list(WAVE_KINDS))
def test_every_kind_compiles_without_spills(kind):
    params, mnk = WAVE_KINDS[kind]
    builds_in_both_layouts("sm90_wgmma", params, mnk)


@pytest.mark.gpu
@pytest.mark.parametrize("params,problem", cases(WAVE_KINDS))
def test_every_wave_kind_is_exact_and_close_to_torch(params, problem):
    check_kernel("sm90_wgmma", params, problem)
