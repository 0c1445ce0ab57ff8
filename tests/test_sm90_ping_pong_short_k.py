"""sm90_wgmma's ping-pong-short-k rule: ping-pong 128 x 192 tiles with C staged a panel at a time, second in the
order where K is 16-25 k-tiles in the large class (docs/decisions.md `ping-pong-short-k`)."""

from __future__ import annotations

import pytest

from core.device import H200
from core.records import Problem
from templates.sm90_wgmma import search
from templates.sm90_wgmma.search import traced
from tests.gpu_reference import cases, check_kernel
from tests.helpers import builds_in_both_layouts

AFTER = {rule.name: rule.after for rule in search.RULES}


def _placed(problem: Problem) -> list[tuple[int, object]]:
    return [(i, p) for i, (name, p) in enumerate(traced(problem)) if name == "ping-pong-short-k"]


@pytest.mark.parametrize("problem", [Problem(3072, 8192, 1024, "kn"), Problem(3072, 8192, 1024, "nk"),
                                     Problem(3072, 4800, 1600, "nk"), Problem(6278, 12800, 1600, "kn"),
                                     Problem(16384, 1024, 1536, "nk", "bf16", True),
                                     Problem(4096, 4096, 1024, "nk", epilogue="gelu_tanh")], ids=lambda p: p.key)
def test_second_where_k_is_16_to_25_k_tiles_and_every_block_gets_two_tiles(problem):
    (at, p), = _placed(problem)
    assert at == AFTER["ping-pong-short-k"] == 1
    assert (p.block_m, p.block_n, p.consumers, p.stages) == (128, 192, 2, 4)
    assert p.ping_pong and p.c_panels and p.persistent and p.epilogue == "tma" and not p.swap_ab
    assert problem.tiles(128, 192) >= 2 * H200.sms


@pytest.mark.parametrize("problem", [
    Problem(4475, 32768, 2048, "nk"),  # 32 k-tiles: the cooperative 128 x 256 leads (measured)
    Problem(4096, 4096, 896, "nk"),  # 14 k-tiles: not measured with this tile
    Problem(1024, 4096, 1024, "kn"),  # 8 x 22 = 176 tiles: under two a block
    Problem(8192, 768, 1024, "nk"),  # N under the large class
    Problem(3072, 8192, 1024, "nk", epilogue="residual"),  # c_panels would load R into registers
    Problem(3072, 8192, 1024, "nk", epilogue="silu_mul"),
], ids=lambda p: p.key)
def test_none_outside_the_class(problem):
    assert _placed(problem) == []


# ragged M, N and K (the last k-tile 24 columns): 20 x 12 = 240 tiles, a block's two tiles or one
KINDS = {"short_k": ({"block_m": 128, "block_n": 192, "consumers": 2, "stages": 4, "persistent": True,
                      "ping_pong": True, "epilogue": "tma", "c_panels": True}, (2501, 2248, 1048))}


def test_the_setting_compiles_without_spills():
    params, mnk = KINDS["short_k"]
    builds_in_both_layouts("sm90_wgmma", params, mnk)


@pytest.mark.gpu
@pytest.mark.parametrize("params,problem", cases(KINDS))
def test_the_setting_is_exact_and_close_to_torch(params, problem):
    check_kernel("sm90_wgmma", params, problem)
