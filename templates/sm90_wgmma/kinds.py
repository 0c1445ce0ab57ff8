"""The kinds of setting the sm90_wgmma family's search order (`search.py`) proposes: each function yields one
kind's settings for a problem on a device (none where the kind does not serve it), best guesses first. Where each
kind enters the order, and why: the rules table in `search.py` and docs/decisions.md.
"""

from __future__ import annotations

from typing import Any

from core.device import DeviceFacts
from core.plan import ceil_div
from core.records import Problem
from templates.sm90_wgmma.costs import MIN_K_TILES, TILES, odd_rows, tile_cost, traffic
from templates.sm90_wgmma.params import Sm90WgmmaParams, deepest, with_update
from templates.sm90_wgmma.splits import cluster_size, k_parts


def swap_tiny_settings(problem: Problem, device: DeviceFacts) -> list[Sm90WgmmaParams]:
    """Swapped-role settings for tiny M (at most 48 rows: block_m = M rounded up to 16), block_n 64, 128, 256, the
    deepest ring that fits (up to 12 stages: the tiles are small; two CTAs an SM where the tiles outnumber the SMs).
    Where the tiles fill fewer than half the SMs and K is long, each tile's K is split over as many CTAs as one wave
    holds (at most 8, and fewer where each would get under MIN_K_TILES k-tiles: decode's k/v projections, N = 1024
    and K = 4096, split 4 ways rather than not at all): in one cluster where that many clusters run at once, in K
    groups, and in pairs of K groups; none for other problems (decisions.md `swap-tiny`)."""
    if problem.m > 48:
        return []
    k_tiles = ceil_div(problem.k, 64)
    bm = ceil_div(problem.m, 16) * 16
    found = []
    for bn in (64, 128, 256):
        tiles = ceil_div(problem.n, bn)
        if bn > ceil_div(problem.n, 64) * 64:
            continue
        parts = k_parts(tiles, device.sms, k_tiles, MIN_K_TILES)  # fewer parts where K is too short for a full wave
        ways: list[dict[str, int]] = [{"min_blocks": 2}] if tiles > device.sms else [{}]  # two CTAs an SM: one wave
        if tiles < device.sms // 2 and parts >= 2:
            ways = [{"split_k": parts}] if tiles <= device.clusters_at_once(parts) else []
            ways += [{"k_groups": parts}] + ([{"split_k": 2, "k_groups": parts // 2}] if parts >= 4 else [])
        elif tiles < device.sms // 2 and bn > 64:
            continue  # few tiles and K too short to split: only the smallest tile, the most CTAs
        for way in ways:
            v = deepest({"block_m": bm, "block_n": bn, "consumers": 1, "swap_ab": True, **way}, top=12)
            if v is not None:
                found.append(v)
    return found


# Tile shapes beyond TILES: block_n in steps of 16 (nk; kn B panels are 64 columns) for rows of 64, 128, 192, 256.
FITTED_ROWS = ((64, 1), (128, 2), (192, 3), (256, 2))
FITTED_GAIN = 0.97  # a fitted shape enters where the cost model puts it at least 3% ahead (decisions.md `fitted`)


def fitted_settings(problem: Problem, device: DeviceFacts, listed_best: float) -> list[Sm90WgmmaParams]:
    """Tile shapes off the TILES list whose CTAs fill the waves of SMs better with less padding (DeepGEMM picks
    block_n in steps of 16 for that), where `tile_cost` ranks them clearly ahead of the best listed shape; the two best,
    each with its best ring. For odd sizes: 4437_512_3584 nk has 140 tiles of 128 x 128 (two waves, the second of
    8), 35 x 3 = 105 of 128 x 176 (one)."""
    step = 64 if problem.b_layout == "kn" else 16
    shapes = [{"block_m": bm, "block_n": bn, "consumers": consumers}
              for bm, consumers in FITTED_ROWS
              for bn in range(max(step, 32), min(256, ceil_div(problem.n, step) * step) + 1, step)
              if (bm, bn, consumers) not in TILES and bm <= ceil_div(problem.m, 64) * 64]
    return _ahead(problem, device, shapes, FITTED_GAIN * listed_best)


# Swapped tiles of M just past a multiple of 64: the rows are wgmma's N (steps of 16), the B tile split among the
# consumers in 64-row wgmmas. They enter where `tile_cost` puts them this far ahead of every listed shape
# (decisions.md `swap-fit`).
SWAP_FIT_GAIN = 0.95
SWAP_FIT_COLS = ((128, 2), (192, 3), (64, 1))  # (block_n, consumers): one m64 wgmma row block per consumer
# Where rows are off 128-byte lines, also 256 columns (fewer of A's rows a k-tile per output), and where B's are,
# multicast pairs of the 128- and 256-column tiles (B's rows read once a pair; decisions.md `odd-rows`).
ODD_ROWS_COLS = ((256, 2),)


def swap_fit_settings(problem: Problem, device: DeviceFacts,
                       listed_best: float) -> tuple[list[Sm90WgmmaParams], list[Sm90WgmmaParams]]:
    """Swapped-role tiles for M > 48 whose rows, M split evenly over the fewest tiles of at most 256 rows and rounded
    up to 16, pad M far less than 64-row multiples do (205 rows: one 208-row tile, not 256; 414: two of 208, not 512;
    657: three of 224, not 768), where `tile_cost` ranks them well ahead of the best listed shape: the two best, each as
    a lead and an alternate. Beyond one wave the lead is the persistent kind, with TMA stores in 16-row chunks, where
    that keeps a ring of 4 stages (decisions.md `swap-fit`)."""
    leads, alternates = [], []
    for p in _ahead(problem, device, swapped_shapes(problem, odd=True), SWAP_FIT_GAIN * listed_best):
        tiles = problem.tiles(p.block_m, p.block_n)
        # TMA stores in 16-row chunks leave the ring what the smem epilogue's whole C tile took: up to 6 stages
        persistent = (deepest({**p.model_dump(), "persistent": True, "epilogue": "tma"}, top=max(p.stages, 6))
                      if tiles > device.sms * p.min_blocks else None)
        if persistent is not None and persistent.stages >= 4:
            leads.append(persistent)
            alternates.append(p)
        else:
            leads.append(p)
            alternates += [persistent] if persistent is not None else []
    return leads, alternates


def swapped_shapes(problem: Problem, odd: bool = False) -> list[dict[str, Any]]:
    """Swapped tiles of M's rows for M > 48: M split evenly over ceil(M / 256) to ceil(M / 64) tiles, rounded up
    to 16, where that is not a multiple of 64 (those are listed shapes), with each of SWAP_FIT_COLS; with `odd`,
    where rows are off 128-byte lines, also ODD_ROWS_COLS and multicast pairs."""
    if problem.m <= 48:
        return []  # tiny M: swap_tiny_settings
    odd_a, odd_b = odd_rows(problem) if odd else (False, False)
    even = (ceil_div(problem.m, tiles) for tiles in range(ceil_div(problem.m, 256), ceil_div(problem.m, 64) + 1))
    rows = {ceil_div(share, 16) * 16 for share in even}
    cols = SWAP_FIT_COLS + (ODD_ROWS_COLS if odd_a or odd_b else ())
    shapes = [{"block_m": bm, "block_n": bn, "consumers": consumers, "swap_ab": True, "epilogue": "smem"}
              for bm in sorted(rows) if bm % 64 and bm > 64 for bn, consumers in cols
              if bn <= ceil_div(problem.n, 64) * 64]
    return shapes + [{**s, "cluster_m": 2} for s in shapes if odd_b and s["block_n"] % 128 == 0]


# Tall swapped tiles (rows as wgmma's N, 256 columns as four m64 wgmmas over two consumers) with persistent blocks
# and TMA stores in 16-row chunks (C needs 16 KB beside the ring, not a whole tile): cuBLAS's tiling for large
# problems. They enter only where `tile_cost` x TALL_COST stays under the persistent lead's (the same overlap of
# stores with the next tile): the cost model rates them ahead of what they measure (decisions.md `tall`).
TALL_ROWS = (144, 160, 176, 192)
TALL_COST = 1.05


def tall_settings(problem: Problem, device: DeviceFacts, lead: list[Sm90WgmmaParams]) -> list[Sm90WgmmaParams]:
    """Persistent swapped tiles of TALL_ROWS x 256 with TMA stores, where there are tiles beyond a wave and
    `tile_cost` puts them ahead of the first persistent lead by TALL_COST: the two best, each with its deepest ring
    (at most 4 stages)."""
    if problem.n < 256 or not lead:
        return []
    bar = tile_cost(lead[0], problem, device)
    ranked = []
    for bm in TALL_ROWS:
        v = deepest({"block_m": bm, "block_n": 256, "consumers": 2, "swap_ab": True, "epilogue": "tma",
                     "persistent": True}, top=4)
        if v is not None and v.stages >= 3 and problem.tiles(bm, 256) > device.sms:
            ranked.append((tile_cost(v, problem, device) * TALL_COST, bm, v))
    return [v for cost, _, v in sorted(ranked) if cost < bar][:2]


# Few C tiles because N is narrow (one m64 wgmma of columns at most) and M moderate: the listed tiles' 64 rows give
# ceil(M / 64) x ceil(N / 16) CTAs (534_32_1120: 18; cuBLAS runs 68 of 8 rows). Swapped tiles of 16 and 32 of M's rows
# (N padded to 64 wgmma rows) with K split over cluster pairs (decisions.md `narrow`).
NARROW_N = 64
NARROW_ROWS = (16, 32)
NARROW_PART_K_TILES = 7  # the fewest k-tiles a CTA of the split gets (310_40_928: 15 k-tiles over 2)


def narrow_settings(problem: Problem, device: DeviceFacts) -> list[Sm90WgmmaParams]:
    """Swapped tiles of NARROW_ROWS of M's rows by one 64-column wgmma, each tile's K split in one cluster over as
    many CTAs as a wave holds (a power of two, at most 8, each at least NARROW_PART_K_TILES k-tiles), for M > 48
    (tiny M: `swap_tiny_settings`) and N <= NARROW_N; none where K is too short to split."""
    if problem.m <= 48 or problem.n > NARROW_N:
        return []
    k_tiles = ceil_div(problem.k, 64)
    found = []
    for bm in NARROW_ROWS:
        tiles = ceil_div(problem.m, bm)
        parts = cluster_size(k_parts(tiles, device.sms, k_tiles, NARROW_PART_K_TILES))
        if parts < 2 or tiles > device.clusters_at_once(parts):
            continue
        v = deepest({"block_m": bm, "block_n": 64, "consumers": 1, "swap_ab": True, "split_k": parts})
        found += [v] if v is not None else []
    return found


# Ping-pong consumers (each of two owns whole tiles, one storing while the other multiplies) where K is a k-tile or
# two and every block gets two tiles or more (decisions.md `ping-pong`).
PING_PONG_K_TILES = 2
PING_PONG_TILES = ((64, 256, "tma"), (128, 128, "tma"), (128, 128, "smem"))  # the order they won in


def _ping_pong(problem: Problem, device: DeviceFacts, tiles: tuple[tuple[int, int, str], ...],
               **fields: Any) -> list[Sm90WgmmaParams]:
    """Persistent ping-pong settings of these (block_m, block_n, epilogue) tiles, the deepest ring of up to 4 stages,
    where every block gets two tiles or more."""
    found = (deepest({"block_m": bm, "block_n": bn, "consumers": 2, "persistent": True, "ping_pong": True,
                      "epilogue": epilogue, **fields}, top=4)
             for bm, bn, epilogue in tiles if problem.tiles(bm, bn) >= 2 * device.sms)
    return [v for v in found if v is not None]


def ping_pong_settings(problem: Problem, device: DeviceFacts) -> list[Sm90WgmmaParams]:
    return _ping_pong(problem, device, PING_PONG_TILES) if ceil_div(problem.k, 64) <= PING_PONG_K_TILES else []


# Ping-pong 128 x 192 tiles with C staged a 64-column panel at a time (so the ring keeps 4 stages beside both
# consumers' staging) where K is 16-25 k-tiles, M and N are PING_PONG_SHORT_MIN or more and every block gets two
# tiles or more; not with a residual (c_panels loads R into registers) or a gated epilogue (decisions.md
# `ping-pong-short-k`).
PING_PONG_SHORT_K = (16, 25)  # k-tiles
PING_PONG_SHORT_MIN = 1024


def ping_pong_short_k_settings(problem: Problem, device: DeviceFacts) -> list[Sm90WgmmaParams]:
    lo, hi = PING_PONG_SHORT_K
    if (not lo <= ceil_div(problem.k, 64) <= hi or min(problem.m, problem.n) < PING_PONG_SHORT_MIN
            or problem.fused.residual or problem.fused.gated):
        return []
    return _ping_pong(problem, device, ((128, 192, "tma"),), c_panels=True)


# Smaller M (one tile of rows) keeps the listed split-K and unsplit settings (decisions.md `swap-split`).
SWAP_SPLIT_MIN_M = 256


def swap_split_settings(problem: Problem, device: DeviceFacts) -> list[Sm90WgmmaParams]:
    """Swapped tiles of M's rows (two or three consumers, M > SWAP_SPLIT_MIN_M, fewer rows than the listed 128-,
    192- and 256-row tiles pad M to) with each tile's K split, where they fill under half the SMs: over as many CTAs
    as one wave holds (at most 8, each at least MIN_K_TILES k-tiles), in K groups, and in one cluster of the largest
    power of two of them where that many clusters run at once. The two K-group settings and the one cluster split
    with the least work a CTA (a tile's area over its parts, with `tile_cost`'s traffic term), in that order: group,
    cluster, group. Not proposed where M is a multiple of 128 (decisions.md `swap-split`)."""
    if problem.m <= SWAP_SPLIT_MIN_M:
        return []
    k_tiles = ceil_div(problem.k, 64)
    groups, clusters = [], []
    listed_rows = min(ceil_div(problem.m, bm) * bm for bm in (128, 192, 256))
    for fields in swapped_shapes(problem):
        bm, bn = fields["block_m"], fields["block_n"]
        if fields["consumers"] < 2 or ceil_div(problem.m, bm) * bm >= listed_rows:
            continue  # one consumer warpgroup a CTA: too small a tile to split; or no rows saved
        tiles = problem.tiles(bm, bn)
        parts = k_parts(tiles, device.sms, k_tiles, MIN_K_TILES)
        if tiles >= device.sms // 2 or parts < 2:
            continue
        if (v := deepest({**fields, "k_groups": parts})) is not None:
            groups.append((bm * bn / parts * traffic(bm, bn), v))
        split = cluster_size(parts)
        if tiles <= device.clusters_at_once(split) and (v := deepest({**fields, "split_k": split})) is not None:
            clusters.append((bm * bn / split * traffic(bm, bn), v))
    groups.sort(key=lambda item: item[0])
    clusters.sort(key=lambda item: item[0])
    return [v for _, v in groups[:1] + clusters[:1] + groups[1:2]]


def _ahead(problem: Problem, device: DeviceFacts, shapes: list[dict[str, Any]], bar: float) -> list[Sm90WgmmaParams]:
    """The two shapes of `shapes` that `tile_cost` puts below `bar`, cheapest first, each with its best ring and blocks
    per SM."""
    ranked = sorted((tile_cost(Sm90WgmmaParams.model_construct(**fields), problem, device), i)
                    for i, fields in enumerate(shapes))
    found = []
    for cost, i in ranked:
        if cost >= bar or len(found) == 2:
            break
        variants = [v for v in (_valid(**shapes[i], stages=stages, min_blocks=blocks)
                                for stages in (4, 3, 5, 6) for blocks in (1, 2)) if v is not None]
        if variants:
            found.append(min(variants, key=lambda v: tile_cost(v, problem, device)))
    return found


def _valid(**fields: Any) -> Sm90WgmmaParams | None:
    try:
        return Sm90WgmmaParams(**fields)
    except ValueError:
        return None


def pair_first(picked: list[Sm90WgmmaParams], problem: Problem, device: DeviceFacts, k_tiles: int) -> bool:
    """Whether the best guess, a multicast pair (which has no persistent kind), goes before the persistent leads:
    where `tile_cost` puts it further ahead of the best single tile than persistent blocks could gain by hiding a
    tile's fixed costs (its ring's fill and stores, 2 of its k_tiles + 2)."""
    best, plain = picked[0], next((p for p in picked if p.cluster_m == 1), None)
    return best.cluster_m > 1 and (plain is None or tile_cost(best, problem, device) < tile_cost(plain, problem, device)
                                   * k_tiles / (k_tiles + 2))


def persistent_leads(picked: list[Sm90WgmmaParams], k_tiles: int) -> list[Sm90WgmmaParams]:
    """The persistent kinds of the best guesses: up to three with TMA stores, then, where the best guess's columns
    are no whole 64-column panels (nk's fitted widths: no TMA stores), its kind with the smem epilogue; each where
    its ring keeps 3 stages or covers K (decisions.md `persistent-leads`)."""
    def found(update: dict[str, Any], fits: bool) -> list[Sm90WgmmaParams]:
        variants = (with_update(p, update) for p in picked if (p.block_n % 64 == 0) == fits)
        return list({v.model_dump_json(): v for v in variants
                     if v is not None and (v.stages >= 3 or v.stages > k_tiles)}.values())
    smem = found({"persistent": True, "epilogue": "smem"}, False)[:1] if picked[0].block_n % 64 else []
    return found({"persistent": True, "epilogue": "tma"}, True)[:3] + smem


def listed_shapes(problem: Problem, device: DeviceFacts) -> list[tuple[float, list[Sm90WgmmaParams]]]:
    """Each tile shape of TILES (kn: whole 64-column panels) with its ring and blocks-per-SM variants, cheapest by
    `tile_cost` first, and the shapes so, each with its cheapest variant's cost. Where B's rows are off 128-byte
    lines, each tile also as a multicast pair, a shape of its own that `tile_cost` ranks (it weighs the rows saved)."""
    k_tiles = ceil_div(problem.k, 64)
    shapes: list[tuple[float, list[Sm90WgmmaParams]]] = []
    for bm, bn, consumers in TILES:
        if problem.b_layout == "kn" and bn % 64:
            continue
        for cluster_m in (1, 2) if odd_rows(problem)[1] else (1,):
            variants = []
            for stages in (4, 3, 5, 6, 8):  # preference order; the deepest ring that fits closes the list
                if stages > k_tiles + 1 and stages != 4:
                    continue  # a ring deeper than K only costs shared memory
                for min_blocks in (1, 2):
                    v = _valid(block_m=bm, block_n=bn, consumers=consumers, stages=stages, min_blocks=min_blocks,
                               cluster_m=cluster_m)
                    variants += [v] if v is not None else []
            if variants:
                ranked = sorted(variants, key=lambda v: tile_cost(v, problem, device))
                shapes.append((tile_cost(ranked[0], problem, device), ranked))
    shapes.sort(key=lambda item: item[0])
    return shapes


def listed_settings(shapes: list[tuple[float, list[Sm90WgmmaParams]]]) -> list[Sm90WgmmaParams]:
    """The best guesses of `listed_shapes`: of the first ten single-tile shapes, three variants each of the first three,
    two of the next three, one of the next four (the best shapes get more pipeline variants, the rest keep the
    search broad); a multicast pair ranked among them brings its cheapest variant."""
    picked: list[Sm90WgmmaParams] = []
    rank = 0  # of the single-tile shapes
    for _, variants in shapes:
        if rank == 10:
            break
        if variants[0].cluster_m > 1:
            picked.append(variants[0])
            continue
        picked.extend(variants[: 3 if rank < 3 else 2 if rank < 6 else 1])
        rank += 1
    return picked


def raster_settings(best: Sm90WgmmaParams, problem: Problem, chosen: int) -> list[Sm90WgmmaParams]:
    """The best guess with three of the raster groups 16, 8, 4 and 1 other than `chosen` (the group the best guess
    runs in), each where the tile rows outnumber it (1 always)."""
    tiles_m = ceil_div(problem.m, best.block_m)
    groups = [g for g in (16, 8, 4, 1) if g != chosen and (g < tiles_m or g == 1)]
    return [best.model_copy(update={"raster_group": g}) for g in groups[:3]]
