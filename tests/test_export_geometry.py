"""agent.export.geometry: a kernel's launch written for every M of a range (checked against the family's rule at
each M), launches the op could not rebuild refused, and the M intervals each exported problem serves."""

from __future__ import annotations

import dataclasses

import pytest

from agent.export.geometry import GeometryError, launch_table, resolve
from core.device import H200
from core.records import LaunchSpec, Problem, TensorMapSpec
from templates import get_family

BUCKET = Problem(81, 1024, 4096, "nk", m_range=(65, 96))


def rebuilt(table: dict, m: int) -> tuple:
    """The launch at M as the op rebuilds it from the table (the segment holding M, M in the marked dims)."""
    seg = [s for s in table["segments"] if s["m"] <= m][-1]
    maps = [(tuple(m if i in t["m_dims"] else d for i, d in enumerate(t["dims"])), tuple(box))
            for t, box in zip(table["tensor_maps"], seg["boxes"], strict=True)]
    return tuple(seg["grid"]), maps


@pytest.mark.parametrize("params", [
    {"block_m": 16, "block_n": 128, "consumers": 2, "swap_ab": True, "stages": 6},
    {"block_m": 128, "block_n": 128, "persistent": True, "epilogue": "tma", "stages": 4},
    {"block_m": 64, "block_n": 128, "consumers": 1, "k_groups": 4, "stages": 6},
    {"block_m": 128, "block_n": 256, "persistent": True, "epilogue": "tma", "stages": 3, "mixed_tail": True},
])
def test_the_table_is_the_rule_at_every_m(params):
    family = get_family("sm90_wgmma")
    problem = dataclasses.replace(BUCKET, m=300, m_range=(1, 600))
    table = launch_table(family, params, problem, H200)
    assert table["m_range"] == [1, 600] and table["segments"][0]["m"] == 1
    for m in range(1, 601):
        spec = family.launch(params, Problem(m, 1024, 4096, "nk"), H200)
        assert rebuilt(table, m) == (spec.grid, [(t.dims, t.box) for t in spec.tensor_maps]), m
        assert spec.workspace_bytes <= table["workspace_bytes"] and spec.counters <= table["counters"]
    assert len(table["segments"]) < 600 / 8  # grids and boxes change only at tile and 8-row steps
    assert table["tensor_maps"][0]["m_dims"] == [1] and table["tensor_maps"][1]["m_dims"] == []  # A's rows; not B


def test_a_gemv_bucket_launches_by_the_rule_at_each_m():
    family = get_family("gemv")
    problem = Problem(4, 28672, 4096, "nk", "f16", False, "silu_mul", m_range=(3, 4))
    params = family.space(problem, H200)[0]
    table = launch_table(family, params, problem, H200)
    assert table["tensor_maps"] == [] and table["workspace_bytes"] == 0 and table["overlap"]
    for m in (3, 4):
        assert rebuilt(table, m) == (family.launch(params, Problem(m, 28672, 4096, "nk", "f16", False, "silu_mul"),
                                                   H200).grid, [])


def test_a_single_m_keeps_one_segment():
    table = launch_table(get_family("sm80_mma"), {}, Problem(100, 256, 512), H200)
    assert table["m_range"] == [100, 100] and len(table["segments"]) == 1 and table["tensor_maps"] == []


class Varying:
    """A stand-in family whose launch changes with M in a way the op does not rebuild."""

    def __init__(self, what: str):
        self.what = what

    def launch(self, params, problem, device):
        m = problem.m
        block = (256 if self.what == "block" and m > 70 else 128, 1, 1)
        dims = (m, 512) if self.what == "inner" else (512, 2048 if self.what == "dims" and m > 70 else 1024)
        return LaunchSpec((m, 1, 1), block, 0, tensor_maps=(TensorMapSpec("A", dims, (64, 8)),))


@pytest.mark.parametrize("what, match", [("block", "block, shared memory"), ("dims", "beyond the dimensions"),
                                         ("inner", "inner dimension of a packed tensor")])
def test_a_launch_the_op_cannot_rebuild_is_refused(what, match):
    with pytest.raises(GeometryError, match=match):
        launch_table(Varying(what), {}, BUCKET, H200)


@pytest.mark.parametrize("problem", [Problem(4096, 4096, 4096, "nk"), Problem(2048, 2048, 4096, "kn", "f16", False,
                                                                              "residual")])
def test_a_dimension_equal_to_m_by_chance_is_not_taken_for_m(problem):
    """K = M (A's map) or N = M (C's and R's): only the dimension that follows M is M's; a square problem's TMA
    kernel was refused as 'M as an inner dimension' and exported as cuBLAS."""
    params = {"block_m": 128, "block_n": 256, "stages": 3, "persistent": True, "epilogue": "tma"}
    table = launch_table(get_family("sm90_wgmma"), params, problem, H200)
    assert {t["operand"]: t["m_dims"] for t in table["tensor_maps"]} == \
        {"A": [1], "B": [], "C": [1], **({"R": [1]} if problem.fused.residual else {})}


def test_narrower_claims_win_where_they_overlap():
    claims = [("1-16", (1, 16)), ("9-16", (9, 16)), ("12", (12, 12)), ("17-24", (17, 24)), ("again-17-24", (17, 24))]
    assert resolve(claims) == {"12": [(12, 12)], "9-16": [(9, 11), (13, 16)], "1-16": [(1, 8)],
                               "17-24": [(17, 24)], "again-17-24": []}
