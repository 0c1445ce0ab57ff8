"""The naive family: one thread per output element. A correctness reference and the base that edited (LLM) or
adversarial test kernels launch with; the built-in search does not spend time on it."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from core.device import H200, DeviceFacts
from core.plan import ceil_div
from core.records import LaunchSpec, Problem
from templates.family import Family, Params


class NaiveParams(Params):
    block_x: Literal[8, 16, 32] = 16
    block_y: Literal[4, 8, 16, 32] = 16


class Naive(Family):
    name = "naive"
    arches = ("sm_90a", "sm_80")
    params_model = NaiveParams
    searched: ClassVar[bool] = False
    description = "one thread per output element, fp32 accumulation; slow but obviously right"

    def launch(self, params: dict[str, Any], problem: Problem, device: DeviceFacts = H200) -> LaunchSpec:
        p = self.parse(params, problem)
        grid = (ceil_div(problem.out_n, p.block_x), ceil_div(problem.m, p.block_y), 1)
        return LaunchSpec(grid, (p.block_x, p.block_y, 1), 0, overlap=device.overlaps)

    def space(self, problem: Problem, device: DeviceFacts = H200) -> list[dict[str, Any]]:
        return [{"block_x": 16, "block_y": 16}, {"block_x": 32, "block_y": 8}]
