"""The gemv family: memory-bound problems with few rows of A and B given N x K (decode's projections, lm_head). Each
warp streams whole weight rows along K; many small blocks, no tensor cores, no partial sums in memory.

Searched where M is at most SEARCH_M (docs/decisions.md `gemv`: on the H200 it beat cuBLAS by 1.08-1.63x at M = 1
and 1.16x at M = 4, and lost at M = 8); not shown to the LLM yet.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from core.device import H200, DeviceFacts
from core.plan import ceil_div
from core.records import LaunchSpec, Problem
from templates.family import Family, Params

SEARCH_M = 4  # the most rows of A the search proposes it for (docs/decisions.md `gemv`)
# the most bytes of A's rows and the norm's weight a norm variant's block holds (docs/decisions.md `norm-variant`)
NORM_SMEM = 32 * 1024
NORM_M_TILE = 1  # the most rows of A a block with a norm variant has (docs/decisions.md `norm-variant`)


class GemvParams(Params):
    warps: Literal[2, 4, 8, 16] = Field(4, description="warps per block, each group of k_split its own columns of C")
    rows: Literal[1, 2, 4] = Field(2, description="columns of C per warp (gated: each its gate and up weight rows)")
    unroll: Literal[1, 2, 4] = Field(2, description="16-byte chunks of each weight row a lane has in flight")
    m_tile: Literal[1, 2, 4, 8] = Field(1, description="rows of A per block (blocks along y cover the rest)")
    k_split: Literal[1, 2, 4, 8, 16] = Field(1, description="warps that share their columns, each summing a slice of "
                                             "K's steps, their sums added through shared memory (measured, not "
                                             "searched: docs/decisions.md `gemv-k-split`)")

    @property
    def weight_registers(self) -> int:
        """32-bit registers a thread holds weight chunks in (gated: twice), the family's register driver."""
        return 4 * self.unroll * self.rows


class Gemv(Family):
    name = "gemv"
    arches = ("sm_90a", "sm_80")
    params_model = GemvParams
    prompted: ClassVar[bool] = False  # the LLM's prompt does not show it yet
    # CUDA cores, not tensor cores: fp32 FMAs plus a conversion an element, about half the fp32 rate, which is 1/15
    # of the dense tensor rate on both arches (docs/decisions.md `gemv`); memory-bound wherever it is searched
    tensor_share: ClassVar[dict[str, float]] = {"sm_90a": 0.03, "sm_80": 0.03}
    description = ("a warp per few columns of C streaming their weight rows along K (B given N x K), fp32 sums "
                   "reduced by shuffles: for M up to a few rows, where the weight's bytes are the time")

    def check_for_problem(self, params: Params, problem: Problem) -> None:
        if problem.b_layout != "nk":
            raise ValueError("gemv streams weight rows: B must be given N x K (nk)")
        assert isinstance(params, GemvParams)
        if params.warps % params.k_split:
            raise ValueError(f"k_split={params.k_split} must divide warps={params.warps}")
        kinds = 2 if problem.fused.gated else 1
        if params.weight_registers * kinds + params.rows * kinds * params.m_tile > 128:
            raise ValueError(f"rows={params.rows} x unroll={params.unroll} weight chunks and rows x m_tile="
                             f"{params.m_tile} sums would not fit the registers (128 a thread for them)")

    def norm_options(self, params: dict[str, Any], problem: Problem) -> tuple[str, ...] | None:
        """-DHGEMM_NORM with the block's rows of A and the norm's weight in shared memory ((m_tile + 1) x K elements),
        for settings of one row of A a block (NORM_M_TILE) where they fit NORM_SMEM."""
        p = self.parse(params, problem)
        assert isinstance(p, GemvParams)
        chunks = p.m_tile * problem.k // 8
        fits = p.m_tile <= NORM_M_TILE and 2 * (p.m_tile + 1) * problem.k <= NORM_SMEM
        return ("-DHGEMM_NORM", f"-DHGEMM_NORM_CHUNKS={chunks}") if fits else None

    def launch(self, params: dict[str, Any], problem: Problem, device: DeviceFacts = H200) -> LaunchSpec:
        p = self.parse(params, problem)
        assert isinstance(p, GemvParams)
        # one dimension, the blocks of a column group's rows of A adjacent (the kernel splits the index); a block
        # covers warps / k_split warps' columns
        grid = (ceil_div(problem.out_n, p.warps // p.k_split * p.rows) * ceil_div(problem.m, p.m_tile), 1, 1)
        return LaunchSpec(grid, (32 * p.warps, 1, 1), 0, overlap=device.overlaps)

    def space(self, problem: Problem, device: DeviceFacts = H200) -> list[dict[str, Any]]:
        """Settings for M's rows in one block (M rounded up to a power of two), the one measured best on most decode
        problems first (docs/decisions.md `gemv-order`); none for kn or M over SEARCH_M (a setting may still name an
        m_tile up to 8; more rows take more blocks along y, each streaming B again)."""
        if problem.b_layout != "nk" or problem.m > SEARCH_M:
            return []
        m_tile = 1 << (problem.m - 1).bit_length()
        out = []
        for warps, rows, unroll in ((4, 1, 4), (4, 2, 2), (8, 2, 2), (4, 4, 1), (8, 1, 2), (2, 2, 4), (4, 2, 1),
                                    (4, 2, 4)):
            setting = {"warps": warps, "rows": rows, "unroll": unroll, "m_tile": m_tile}
            try:
                self.parse(setting, problem)
            except ValueError:
                continue
            out.append(setting)
        return out
