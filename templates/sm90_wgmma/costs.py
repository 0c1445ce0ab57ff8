"""What the sm90_wgmma family's search order (`search.py`) ranks with: the tile shapes it lists, and two rough cost
models, relative times of a setting on a problem: one for whole tiles (waves of resident blocks), one for split-K
settings (streamed operands, cluster placement, workspace sums); and a byte model of the tile order (the raster group
whose waves read the fewest operand bytes). Where their constants come from: docs/decisions.md,
the entries named beside them.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache

import numpy as np

from core.device import DeviceFacts
from core.plan import ceil_div
from core.records import Problem
from templates.sm90_wgmma.params import Sm90WgmmaParams, launch_plan

# (block_m, block_n, consumers), from the large-problem favourites down to small-problem shapes.
TILES = [
    (128, 256, 2), (256, 128, 2), (128, 192, 2), (256, 192, 2), (128, 128, 2), (192, 128, 3), (256, 64, 2),
    (128, 64, 2), (128, 128, 1), (64, 256, 1), (64, 192, 1), (64, 128, 1), (64, 64, 1),
    (128, 224, 2), (128, 160, 2), (128, 96, 2), (64, 96, 1), (64, 48, 1), (64, 32, 1), (64, 16, 1),
]


# Rows of an operand that start off 128-byte lines (A: K x 2 bytes not a multiple of 128; B: the same in nk, N x 2
# bytes in kn): every 128-byte row a TMA copy brings spans two lines, and past a rate of such rows the L2 cannot keep
# up. A tile slows with u, such rows a k-tile per 1024 outputs of the tile (rows a multicast cluster shares counted
# once), by ODD_ROWS_SLOPE a unit past ODD_ROWS_FREE (decisions.md `odd-rows`).
ODD_ROWS_FREE, ODD_ROWS_SLOPE = 4.0, 0.04
ODD_ROWS_MIN_K_TILES = 8  # where K is shorter, a tile's loads weigh little against its fill and stores: not counted
# A multicast pair where rows are on lines, against the same tiles without (decisions.md `tile-cost`)
MULTICAST_COST = 1.02


def odd_rows(problem: Problem) -> tuple[bool, bool]:
    """Whether A's rows and B's rows in memory (nk: N rows of K; kn: K rows of N) start off 128-byte lines, where K
    spans at least ODD_ROWS_MIN_K_TILES k-tiles."""
    if problem.k < ODD_ROWS_MIN_K_TILES * 64:
        return False, False
    return problem.k % 64 != 0, (problem.k if problem.b_layout == "nk" else problem.n) % 64 != 0


def odd_rows_factor(p: Sm90WgmmaParams, problem: Problem, device: DeviceFacts) -> float:
    """How much rows off 128-byte lines slow a tile: u (see ODD_ROWS_FREE) scaled by the share of SMs busy."""
    odd_a, odd_b = odd_rows(problem)
    rows = p.block_m // p.cluster_n * odd_a + p.block_n // p.cluster_m * odd_b
    u = rows * 1024 / (p.block_m * p.block_n) * min(1.0, problem.tiles(p.block_m, p.block_n) / device.sms)
    return 1 + ODD_ROWS_SLOPE * max(0.0, u - ODD_ROWS_FREE)


def traffic(block_m: int, block_n: int) -> float:
    """A tile's operand traffic a unit of work: 1 + 40/block_m + 40/block_n (smaller tiles reload more per output)."""
    return 1 + 40 / block_m + 40 / block_n


def tile_cost(p: Sm90WgmmaParams, problem: Problem, device: DeviceFacts) -> float:
    """Relative time: waves of resident blocks times a tile's work, inflated by its traffic (rows off 128-byte lines
    included) and fixed costs. Multicast pairs launch whole pairs of row tiles."""
    plan = launch_plan(p, problem, device)
    waves, per_sm = plan.waves, plan.blocks_per_busy_sm
    k_tiles = ceil_div(problem.k, p.block_k)
    # Two consumer warpgroups an SM are the reference; three and one issue slower (decisions.md `tile-cost`)
    issue = {2: 1.0, 3: 1.06}.get(per_sm * p.consumers, 1.1)
    # kn with block_n = 192: B rows of 24 chunks leave producer threads idle (decisions.md `tile-cost`)
    uneven = 1.15 if problem.b_layout == "kn" and 128 % (p.block_n // 8) else 1.0
    # the ring fills once per tile
    pair = MULTICAST_COST if p.cluster_m > 1 else 1.0
    # rows off 128-byte lines slow the k-tiles' loads, not the ring's fill or the stores
    return (waves * per_sm * p.block_m * p.block_n * traffic(p.block_m, p.block_n) * issue * uneven * pair
            * (k_tiles * odd_rows_factor(p, problem, device) + 2 + 2 / p.stages))


MIN_K_TILES = 16  # the fewest k-tiles a CTA of a split tile gets (its pipeline's fill and the sum amortised)


# K groups sum through the workspace, which costs more than a cluster's sums through distributed shared memory: the
# last CTA of a tile reads the other groups' fp32 partials: WORKSPACE_SUM k-tiles' wgmma issue per group beyond the
# first (decisions.md `workspace-sum`).
WORKSPACE_SUM = 6


def split_cost(p: Sm90WgmmaParams, problem: Problem, device: DeviceFacts) -> float:
    """Relative time of a split-K setting. These problems stream operands: a CTA's k-tile costs the slower of its
    wgmma issue (~bm*bn/16 clocks) and its cp.async loads (~4 clocks a 128-byte row of A or B: the rate measured
    per SM on the H200; the CTAs of a multicast cluster each load their share of the B tile, or of the A tile's rows,
    along N), CTAs sharing an SM share its load rate,
    clusters beyond what fits (GPC placement: `DeviceFacts.clusters_at_once`) run in a second wave, and K groups add
    their workspace sums. Calibrated on 64_1024_16384 and 256_128_16384 (both layouts): it ranks the measured best
    first."""
    plan = launch_plan(p, problem, device)
    slots, clusters, cap = plan.resident, plan.clusters, plan.clusters_at_once
    waves = ceil_div(clusters, cap * slots)
    sharing = min(slots, ceil_div(clusters, cap))  # CTAs of one SM that load at once
    k_share = ceil_div(problem.k, p.block_k * p.split_k * p.k_groups)
    per_k_tile = max(p.block_m * p.block_n / 16, 4 * (p.block_m / p.cluster_n + p.block_n / p.cluster_m) * sharing)
    sums = 1 + WORKSPACE_SUM * (p.k_groups - 1)
    return waves * ((k_share + 2) * per_k_tile + sums * p.block_m * p.block_n / 16)


# Raster groups the byte model chooses from, and the least share of the default group's bytes a group must save to
# replace it (decisions.md `raster-bytes`).
RASTER_GROUPS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_GROUP = 8
GROUP_SAVING = 0.95
# The share of the L2 a wave's panels stay in for the next waves (decisions.md `raster-bytes`: fitted to ncu's DRAM
# figures on the H200)
L2_REUSE = 1 / 3


def wave_bytes(tiles_m: int, tiles_n: int, group: int, wave: int, a_panel: int, b_panel: int,
               reuse_bytes: int = 0) -> int:
    """Operand bytes a grid of tiles reads from DRAM in grouped rasterisation along M (the kernel's tile_origin):
    each wave of `wave` consecutive tile indices reads the A panels of its distinct tile-rows and the B panels of its
    distinct tile-columns, K deep, except those still in L2 from earlier waves. A wave streams its panels a k-slice at
    a time, so where its panels take more than `reuse_bytes` nothing useful is left for the next wave (it starts at
    k = 0 again); where they fit, they stay, with the most recent earlier panels up to `reuse_bytes` (LRU)."""
    t = np.arange(tiles_m * tiles_n)
    per_group = group * tiles_n
    first = t // per_group * group
    in_group = t % per_group
    span = np.minimum(group, tiles_m - first)
    rows, cols = first + in_group % span, in_group // span
    cached: OrderedDict[tuple[int, int], int] = OrderedDict()  # (0: A | 1: B, index) -> bytes, oldest first
    held = total = 0
    for w0 in range(0, len(t), wave):
        need = ([(0, int(r)) for r in np.unique(rows[w0:w0 + wave])]
                + [(1, int(c)) for c in np.unique(cols[w0:w0 + wave])])
        footprint = 0
        for panel in need:
            size = a_panel if panel[0] == 0 else b_panel
            footprint += size
            if panel in cached:
                cached.move_to_end(panel)
            else:
                total += size
                cached[panel] = size
                held += size
        if footprint > reuse_bytes:
            cached.clear()
            held = 0
        while held > reuse_bytes:
            held -= cached.popitem(last=False)[1]
    return total


def byte_group(p: Sm90WgmmaParams, problem: Problem, device: DeviceFacts) -> int:
    """The raster group whose waves read the fewest operand bytes (wave_bytes), where it saves 1 - GROUP_SAVING of
    the default group's; otherwise the default. Only whole tiles one a CTA or a persistent block's (no clusters, no
    split K, grouped along M): the others keep the default."""
    if (p.split_k > 1 or p.k_groups > 1 or p.cluster_m > 1 or p.cluster_n > 1 or p.raster_along != "m"
            or p.raster_group != DEFAULT_GROUP):
        return p.raster_group
    return _byte_group(ceil_div(problem.m, p.block_m), ceil_div(problem.n, p.block_n), device.sms * p.min_blocks,
                       p.block_m * problem.k * 2, p.block_n * problem.k * 2, int(device.l2_bytes * L2_REUSE))


@lru_cache(maxsize=4096)
def _byte_group(tiles_m: int, tiles_n: int, wave: int, a_panel: int, b_panel: int, reuse: int) -> int:
    if tiles_m <= 1 or tiles_m * tiles_n <= wave:
        return DEFAULT_GROUP  # one tile-row, or one wave: every group reads the same panels
    cost = {g: wave_bytes(tiles_m, tiles_n, g, wave, a_panel, b_panel, reuse)
            for g in RASTER_GROUPS if g <= tiles_m or g == DEFAULT_GROUP}
    best = min(cost, key=lambda g: (cost[g], abs(g - DEFAULT_GROUP)))
    return best if cost[best] <= GROUP_SAVING * cost[DEFAULT_GROUP] else DEFAULT_GROUP
