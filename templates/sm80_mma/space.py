"""Parameter space, launch rule and search seeds of the sm80_mma family (cp.async + ldmatrix + mma.sync HGEMM)."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from core.device import ARCH_LIMITS, H200, DeviceFacts
from core.plan import LaunchPlan, ceil_div
from core.records import LaunchSpec, Problem
from templates.family import Family, Params

LIMITS = ARCH_LIMITS["sm_80"]  # what every setting must fit: the smaller of the two arches it runs on
# Registers beyond accumulators, fragments and copy state (indices, loop state). With the 2-per-copied-chunk term
# below it separated every spilling setting of a 912-setting ptxas sweep (NVRTC 13, sm_90a) from the rest.
REG_OVERHEAD = 24

TileSize = Literal[16, 32, 64, 128, 256]


class Sm80MmaParams(Params):
    block_m: TileSize = Field(128, description="rows of C per thread block")
    block_n: TileSize = Field(128, description="columns of C per thread block")
    block_k: Literal[16, 32, 64] = Field(64, description="K slice per pipeline stage")
    warps_m: Literal[1, 2, 4, 8] = Field(2, description="warps along M; warp tile is block_m / warps_m")
    warps_n: Literal[1, 2, 4, 8] = Field(2, description="warps along N; warp tile is block_n / warps_n")
    warps_k: Literal[1, 2, 4] = Field(1, description="warp groups splitting each stage's K slice (intra-block "
                                      "split-K, reduced in shared memory): more warps for few, long output tiles")
    stages: int = Field(3, ge=2, le=8, description="depth of the cp.async shared-memory ring")
    raster_group: int = Field(8, ge=1, le=64, description="tile-rows a block group walks before moving across N")
    min_blocks: Literal[1, 2, 3, 4] = Field(1, description="__launch_bounds__ minimum blocks per SM (caps registers)")
    smem_epilogue: bool = Field(True, description="stage C in shared memory for 16-byte coalesced stores")

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n * self.warps_k

    @property
    def smem_bytes(self) -> int:
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * 2
        c_tile = self.block_m * (self.block_n + 8) * 2 if self.smem_epilogue else 0
        partials = (self.warps_k - 1) * self.block_m * self.block_n * 4
        return max(ring, c_tile, partials)

    @property
    def register_estimate(self) -> int:
        mi, ni = self.block_m // self.warps_m // 16, self.block_n // self.warps_n // 8
        per_pass = 8 * self.threads  # elements one pass of 16-byte copies moves
        chunks = ceil_div(self.block_m * self.block_k, per_pass) + ceil_div(self.block_n * self.block_k, per_pass)
        return 4 * mi * ni + 4 * mi + 2 * ni + 2 * chunks + REG_OVERHEAD

    @property
    def register_cap(self) -> int:
        return min(255, LIMITS.regs_per_sm // (self.threads * self.min_blocks) // 8 * 8)

    @model_validator(mode="after")
    def _feasible(self) -> Sm80MmaParams:
        wm, wn = self.block_m // self.warps_m, self.block_n // self.warps_n
        if wm < 16 or wm % 16:
            raise ValueError(f"warp tile M = block_m/warps_m = {self.block_m}/{self.warps_m} must be a multiple of 16")
        if wn < 16 or wn % 16:
            raise ValueError(f"warp tile N = block_n/warps_n = {self.block_n}/{self.warps_n} must be a multiple of 16 "
                             "(one ldmatrix.x4 feeds two n8 mma tiles)")
        if self.block_k // 16 % self.warps_k:
            raise ValueError(f"block_k={self.block_k} holds {self.block_k // 16} k16 steps: they cannot be split "
                             f"among warps_k={self.warps_k} groups")
        if self.threads > 1024:
            raise ValueError(f"warps_m*warps_n*warps_k*32 = {self.threads} threads exceeds 1024 per block")
        if self.smem_bytes > LIMITS.smem_per_block:
            raise ValueError(f"shared memory {self.smem_bytes} B (stages*(block_m+block_n)*block_k*2, or the "
                             f"warps_k partial tiles) exceeds the sm_80 limit of {LIMITS.smem_per_block} B per block")
        if self.min_blocks * (self.smem_bytes + LIMITS.smem_reserved_per_block) > LIMITS.smem_per_sm:
            raise ValueError(f"min_blocks={self.min_blocks} blocks of {self.smem_bytes} B shared memory do not fit "
                             f"one SM ({LIMITS.smem_per_sm} B)")
        if self.register_estimate > self.register_cap:
            raise ValueError(f"about {self.register_estimate} registers per thread (warp tile {wm}x{wn}) exceed "
                             f"the cap of {self.register_cap} for {self.threads} threads x min_blocks="
                             f"{self.min_blocks}: it would spill; use a smaller warp tile or more warps")
        return self


# (block_m, block_n, warps_m, warps_n): the tile shapes worth trying, from large to small.
TILES = [
    (128, 256, 2, 4), (256, 128, 4, 2), (128, 128, 2, 2), (128, 128, 4, 2), (128, 128, 2, 4),
    (64, 256, 1, 4), (256, 64, 4, 1), (128, 64, 2, 2), (64, 128, 2, 2), (64, 128, 1, 4), (128, 64, 4, 1),
    (64, 64, 2, 2), (64, 64, 1, 2), (32, 128, 1, 4), (128, 32, 4, 1), (32, 64, 1, 2), (64, 32, 2, 1),
    (32, 32, 1, 2), (16, 128, 1, 4), (16, 64, 1, 4), (16, 64, 1, 2), (16, 32, 1, 2), (32, 16, 2, 1),
]
# (block_k, stages) in order of preference: block_k 64 first (docs/decisions.md `sm80-pipelines`); deeper rings hide
# more latency where few warps are resident, and the 2-stage ones are for K so short that a deeper ring holds nothing.
PIPELINES = [(64, 3), (64, 4), (32, 4), (32, 5), (64, 6), (32, 3), (64, 2), (32, 2)]


def launch_plan(p: Sm80MmaParams, problem: Problem, device: DeviceFacts) -> LaunchPlan:
    """One CTA a C tile, no clusters."""
    return LaunchPlan(tiles=problem.tiles(p.block_m, p.block_n), tile_ctas=1, cluster=1, min_blocks=p.min_blocks,
                      persistent=False, smem_bytes=p.smem_bytes, threads=p.threads, device=device)


def _blocks_per_sm(plan: LaunchPlan, p: Sm80MmaParams) -> int:
    """Blocks an SM holds at once by shared memory, threads and the registers ptxas is expected to give a thread."""
    by_regs = plan.device.limits.regs_per_sm // (p.threads * min(p.register_cap, p.register_estimate + 16))
    return max(1, min(by_regs, plan.resident))


def _cost(p: Sm80MmaParams, problem: Problem, device: DeviceFacts) -> float:
    """Relative time: waves of resident blocks times the work of a wave, inflated by the tile's memory traffic."""
    plan = launch_plan(p, problem, device)
    tiles = plan.tiles
    resident = _blocks_per_sm(plan, p)
    waves = ceil_div(tiles, device.sms * resident)
    per_sm = min(resident, ceil_div(tiles, device.sms))
    traffic = 1 + 48 / p.block_m + 48 / p.block_n
    # Few warps per SM cannot hide mma and shared-memory latency; K groups pay a reduction and thinner mma runs.
    latency = 1 + 4 / (per_sm * p.threads // 32)
    split = 1 + 0.25 * (p.warps_k - 1)
    return waves * per_sm * p.block_m * p.block_n * traffic * latency * split


class Sm80Mma(Family):
    name: ClassVar[str] = "sm80_mma"
    arches: ClassVar[tuple[str, ...]] = ("sm_90a", "sm_80")
    params_model: ClassVar[type[Params]] = Sm80MmaParams
    # mma.sync on Hopper reaches about half of sm90_wgmma on compute-bound problems (docs/decisions.md
    # `tensor-share`); on sm_80 no other family runs, so no prior depends on its share there
    tensor_share: ClassVar[dict[str, float]] = {"sm_90a": 0.4, "sm_80": 0.85}
    description: ClassVar[str] = (
        "Ampere-style HGEMM: STAGES-deep cp.async ring into XOR-swizzled shared memory, ldmatrix fragments, "
        "mma.sync m16n8k16 with fp32 accumulators, optional intra-block split-K (warps_k), grouped rasterisation, "
        "optional shared-memory epilogue. "
        "Portable to sm_80 and sm_90a; no wgmma/TMA, so it tops out well below cuBLAS on Hopper."
    )

    def derived(self, params: Params) -> dict[str, Any]:
        assert isinstance(params, Sm80MmaParams)
        return {"threads": params.threads, "smem_bytes": params.smem_bytes}

    def launch(self, params: dict[str, Any], problem: Problem, device: DeviceFacts = H200) -> LaunchSpec:
        p = self.parse(params, problem)
        assert isinstance(p, Sm80MmaParams)
        return LaunchSpec(grid=(launch_plan(p, problem, device).ctas, 1, 1), block=(p.threads, 1, 1),
                          smem_bytes=p.smem_bytes, overlap=device.overlaps)

    def space(self, problem: Problem, device: DeviceFacts = H200) -> list[dict[str, Any]]:
        shapes: list[tuple[float, list[Sm80MmaParams]]] = []
        for (bm, bn, wm, wn), wk in itertools.product(TILES, (1, 2, 4)):
            variants = []
            for bk, stages in PIPELINES:
                if stages > max(2, ceil_div(problem.k, bk) + 1):
                    continue  # a ring deeper than K only costs occupancy
                params = _valid(block_m=bm, block_n=bn, block_k=bk, warps_m=wm, warps_n=wn, warps_k=wk, stages=stages)
                if params:
                    variants.append(params)
            if variants:
                shapes.append((_cost(variants[0], problem, device), variants))
        shapes.sort(key=lambda item: item[0])
        # The best shapes get more pipeline variants; the rest keep the search broad.
        picked = [p for rank, (_, v) in enumerate(shapes[:10]) for p in v[: 3 if rank < 3 else 2 if rank < 6 else 1]]
        best = picked[0]
        tiles_m, tiles_n = ceil_div(problem.m, best.block_m), ceil_div(problem.n, best.block_n)
        # Group sizes only differ in effect below the number of tile-rows, and not at all in a single row or column.
        groups = {min(g, tiles_m) for g in (4, 16, 1)} - {min(best.raster_group, tiles_m)} if tiles_n > 1 else set()
        extra = [_valid(**{**best.model_dump(), "raster_group": g}) for g in sorted(groups, reverse=True)]
        extra.append(_valid(**{**best.model_dump(), "smem_epilogue": False}))
        for p in picked[:3]:
            # Only a min_blocks that lowers the register cap below 255 changes the code ptxas emits.
            capped = (_valid(**{**p.model_dump(), "min_blocks": mb}) for mb in (2, 3, 4) if p.threads * mb > 256)
            extra.append(next((c for c in capped if c), None))
        unique = {p.model_dump_json(): p.model_dump() for p in reversed(picked + [e for e in extra if e])}
        return list(reversed(unique.values()))[:40]


def _valid(**params: Any) -> Sm80MmaParams | None:
    try:
        return Sm80MmaParams(**params)
    except ValueError:
        return None
