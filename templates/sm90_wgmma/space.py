"""The sm90_wgmma family: its template, the variables the template derives, and the trusted launch rule.

The parameter model is in params.py, the search order in search.py. With TMA the launch rule declares the tensor maps
the host encodes; with K groups, the workspace and arrival counters the host passes after them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from core.device import H200, DeviceFacts
from core.plan import ceil_div
from core.records import LaunchSpec, Problem, TensorMapSpec
from templates.family import Family, Params
from templates.sm90_wgmma.params import (
    MIXED_GAIN,
    NARROW_COST,
    NARROW_ROWS_MIN,
    SWAP_C_CHUNK,
    TAIL_FILL,
    TAIL_MIN_K,
    TAIL_PARTS,
    TAIL_SUM,
    Sm90WgmmaParams,
    launch_plan,
    with_update,
)
from templates.sm90_wgmma.search import seeds


class Sm90Wgmma(Family):
    name: ClassVar[str] = "sm90_wgmma"
    arches: ClassVar[tuple[str, ...]] = ("sm_90a",)
    params_model: ClassVar[type[Params]] = Sm90WgmmaParams
    # with sm80_mma's 0.4 (docs/decisions.md `tensor-share`)
    tensor_share: ClassVar[dict[str, float]] = {"sm_90a": 0.85}
    description: ClassVar[str] = (
        "Hopper HGEMM: a producer warpgroup streams A/B tiles with TMA (host-encoded tensor maps) or cp.async "
        "into a STAGES-deep ring of 128-byte-swizzled shared memory (mbarrier full/empty handshake); 1-4 consumer "
        "warpgroups issue wgmma.mma_async m64nNk16 from shared-memory descriptors (B MN-major via the transpose "
        "bit for kn), setmaxnreg moves registers to the consumers; grouped rasterisation; persistent blocks (two "
        "consumers splitting each tile's rows, or ping-pong: each owning whole tiles in turn); "
        "direct, smem-staged or TMA-store (stmatrix) epilogue; split-K in thread-block clusters (fp32 partial "
        "tiles summed through distributed shared memory) and in K groups (partials through a global workspace, "
        "summed by the last CTA to arrive), and so the part-filled last round of persistent tiles (tail split); "
        "clusters of 2 CTAs sharing each B tile, or of 2-4 sharing each A tile, by "
        "TMA multicast; swapped A and B roles (C^T = B^T A^T, so A's rows are not padded to 64 wgmma rows: tiny M, "
        "or 205 rows in one tile of 208)."
    )

    def derived(self, params: Params) -> dict[str, Any]:
        assert isinstance(params, Sm90WgmmaParams)
        return {"threads": params.threads, "smem_bytes": params.smem_bytes, "set_maxnreg": params.set_maxnreg,
                "producer_regs": params.producer_regs, "consumer_regs": params.consumer_regs,
                "wgmma_n": params.wgmma_n, "c_chunk": SWAP_C_CHUNK,
                "residual_panels": params.residual_panels, "tail_parts_max": TAIL_PARTS, "tail_min_k": TAIL_MIN_K,
                "tail_fill": TAIL_FILL, "tail_sum": TAIL_SUM, "narrow_cost": NARROW_COST, "mixed_gain": MIXED_GAIN,
                "narrow_rows_min": NARROW_ROWS_MIN, "narrow_n": params.narrow_n}

    def check_for_problem(self, params: Params, problem: Problem) -> None:
        assert isinstance(params, Sm90WgmmaParams)
        if problem.b_layout == "kn" and params.block_n % 64 and not params.b_panels:
            raise ValueError(f"block_n={params.block_n}: with B in kn layout (MN-major for wgmma) block_n must be "
                             "a multiple of 64, the width of a 128-byte swizzle panel, or b_panels=True")
        if params.b_panels and problem.b_layout != "kn":
            raise ValueError(f"b_panels copies whole 64-column panels of a kn B: it needs b_layout kn (not "
                             f"{problem.b_layout})")
        if problem.fused.gated and (why := gated_problem(params)):
            raise ValueError(f"a gated epilogue ({problem.epilogue}): {why}")

    def launch(self, params: dict[str, Any], problem: Problem, device: DeviceFacts = H200) -> LaunchSpec:
        p = self.parse(params, problem)
        assert isinstance(p, Sm90WgmmaParams)
        # split-K: the kernel's __cluster_dims__(split_k, 1, 1) groups consecutive blocks, one cluster per tile and K
        # group; k_groups > 1 adds the workspace (the groups' fp32 partial tiles) and one arrival counter per CTA of
        # a tile's cluster, tail_split a partial tile and a counter per CTA; persistent: as many blocks
        # as the SMs hold at once, in whole multicast clusters
        plan = launch_plan(p, problem, device)
        tiles = plan.tiles
        grouped = p.k_groups > 1
        maps: tuple[TensorMapSpec, ...] = ()
        if p.loader == "tma":  # boxes land as 128-byte rows (64 fp16), swizzled like the cp.async copies
            k, n = problem.k, problem.n
            b_maps: tuple[TensorMapSpec, ...] = ()
            if problem.b_layout == "nk":
                b_map = TensorMapSpec("B", (k, n), (p.block_k, p.block_n // p.cluster_m))
            elif p.b_panels:  # a tile's panels (128 B apart) from any 16th column (32 B apart), as far as they fit
                panels = p.b_columns // 64  # in N; the last column tile: one copy a panel of the second, plain map
                # where N is under a stage's columns every tile is a last one and the view, never read, is B's first
                # columns (so that it still lies inside B)
                view = (64, k, panels, (n - p.b_columns) // 16 + 1) if n >= p.b_columns else (min(n, 64), k, 1, 1)
                b_map = TensorMapSpec("B", view, (64, p.block_k, panels, 1), strides=(n * 2, 128, 32))
                b_maps = (TensorMapSpec("B", (n, k), (64, p.block_k)),)
            elif n % 64 == 0:  # 64-column panels as a third dimension 128 B apart: one copy per stage (and CTA)
                b_map = TensorMapSpec("B", (64, k, n // 64), (64, p.block_k, p.block_n // 64 // p.cluster_m),
                                      strides=(n * 2, 128))
            else:  # one copy per panel: a panel view would read past the last row's end
                b_map = TensorMapSpec("B", (n, k), (64, p.block_k))
            # where M fits one tile, the A box is only M rounded up to 8 rows (the kernel's a_box_rows); with
            # multicast along N each CTA's share of the tile's rows
            a_rows = p.block_m // p.cluster_n if p.cluster_n > 1 else min(p.block_m, ceil_div(problem.m, 8) * 8)
            if p.mixed_tail:  # a narrow tile's B: its narrow_n rows (nk) or panels (kn; one copy a panel: tm_b)
                b_maps = ((TensorMapSpec("B", (k, n), (p.block_k, p.narrow_n)),) if problem.b_layout == "nk" else
                          (TensorMapSpec("B", (64, k, n // 64), (64, p.block_k, p.narrow_n // 64),
                                         strides=(n * 2, 128)),)
                          if n % 64 == 0 else (b_map,))
            maps = (TensorMapSpec("A", (k, problem.m), (p.block_k, a_rows)), b_map, *b_maps)
        if p.epilogue == "tma":  # each consumer warpgroup stores its rows as 64-column panels (swapped: 16-row chunks)
            c_rows = SWAP_C_CHUNK if p.swap_ab else p.block_m // p.row_owners
            maps += (TensorMapSpec("C", (problem.out_n, problem.m), (64, c_rows)),)
            if problem.fused.residual and p.residual_panels:  # R comes into the same panels the same way
                maps += (TensorMapSpec("R", (problem.out_n, problem.m), (64, c_rows)),)
        # tail split: one partial tile a CTA of the grid (one range a CTA), a counter a tail tile (fewer than the grid)
        workspace, counters = ((p.k_groups * tiles * p.block_m * p.block_n * 4, tiles * p.split_k) if grouped else
                               (plan.ctas * p.block_m * p.block_n * 4, plan.ctas) if p.tail_split
                               else (0, 0))
        return LaunchSpec(grid=(plan.ctas, 1, 1), block=(p.threads, 1, 1), smem_bytes=p.smem_bytes, tensor_maps=maps,
                          workspace_bytes=workspace, counters=counters, overlap=device.overlaps)

    def space(self, problem: Problem, device: DeviceFacts = H200) -> list[dict[str, Any]]:
        settings = seeds(problem, device)
        if not problem.fused.gated:
            return settings
        # gated: each setting as the nearest one whose tiles combine gate and up columns in place
        out: dict[str, dict[str, Any]] = {}
        for s in settings:
            p = Sm90WgmmaParams(**s)
            if gated_problem(p):
                p = with_update(p, gated_update(p))
            if p is not None and not gated_problem(p):
                out.setdefault(repr(sorted(p.model_dump().items())), p.model_dump())
        return list(out.values())


def gated_problem(p: Sm90WgmmaParams) -> str | None:
    """Why a setting cannot fuse a gated epilogue (each thread combines a gate value and the up value 8 columns on, in
    a whole tile), or None."""
    if p.reduces:
        return f"split_k={p.split_k}, k_groups={p.k_groups}: the tile's sums must be whole in one CTA (no split-K)"
    if p.mixed_tail:
        return "mixed_tail's 192-column tiles would store 96 gated columns, not whole 64-column panels"
    if p.epilogue == "tma" and (p.swap_ab or p.block_n % 128):
        return ("epilogue=tma stores 64-column panels of C, which has block_n / 2 columns a tile: block_n a multiple "
                "of 128, and not swapped (swapped tiles store gated C through the smem epilogue)")
    return None


def gated_update(p: Sm90WgmmaParams) -> dict[str, Any]:
    """The change that makes a setting fit a gated epilogue: no split-K or mixed tail, and the smem epilogue where TMA
    stores cannot take the half-width tile."""
    update: dict[str, Any] = {"split_k": 1, "k_groups": 1} if p.reduces else {}
    if p.mixed_tail:
        update["mixed_tail"] = False
    if p.epilogue == "tma" and (p.swap_ab or p.block_n % 128):
        update["epilogue"] = "smem"
    return update
