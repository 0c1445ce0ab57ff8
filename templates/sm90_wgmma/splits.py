"""Settings of the sm90_wgmma family's search order (`search.py`) for few C tiles and a long K: which problems split
K over several CTAs a C tile (thread-block clusters summing through distributed shared memory, K groups summing
through a workspace, multicast pairs in K groups) and the settings that do it, best guesses first; and unsplit
clusters along N that share A's rows. From measurements on the H200 (docs/notebook.md).
"""

from __future__ import annotations

from core.records import Problem
from templates.sm90_wgmma.costs import CLUSTERS_PER_SLOT, MIN_K_TILES, TILES, split_cost
from templates.sm90_wgmma.params import Sm90WgmmaParams, deepest, launched_tiles

MAX_PARTS = 8  # CTAs a C tile's K is split over at most (a cluster of 8, or 8 K groups)


def k_parts(tiles: int, sms: int, k_tiles: int, least: int) -> int:
    """How many CTAs each of `tiles` C tiles can split its K over: as many as one wave of `sms` holds, at most
    MAX_PARTS, each at least `least` of the `k_tiles` (under 2: no split)."""
    return min(MAX_PARTS, sms // tiles, k_tiles // least)


def cluster_size(parts: int) -> int:
    """The largest cluster of split_k CTAs (a power of two) within `parts`; 1 where parts < 2."""
    return 1 << (parts.bit_length() - 1) if parts > 1 else 1


def split_class(problem: Problem, sms: int) -> str | None:
    """Which problems split-K serves, all with at least 32 k-tiles (halves keep 16). "long": K long against M and
    N (K >= 8 max(M, N)), measured on the dev suite: split settings lead. At M > 64 (skinny problems have K groups
    and swapped roles of their own): "few" where even 64 x 64 tiles fill at most half the SMs (1024_128_4096:
    32, and the best unsplit settings streamed K through them at 0.70x of cuBLAS): split settings lead too;
    "some" where 128 x 128 tiles fill at most a quarter of the SMs but smaller tiles fill them: split settings enter
    at SPLIT_RANK, after the best unsplit guesses. None: no split-K."""
    if problem.k < 32 * 64:
        return None
    if problem.k >= 8 * max(problem.m, problem.n):
        return "long"
    if problem.m <= 64:
        return None
    if problem.tiles(64, 64) <= sms // 2:
        return "few"
    return "some" if problem.tiles(128, 128) <= sms // 4 else None


def split_settings(problem: Problem, sms: int, smem_per_sm: int) -> list[Sm90WgmmaParams]:
    """Split-K settings for long-K problems with few C tiles (`split_class`), best guesses first: every tile shape
    with split_k 8 or 4 (and 2 outside the "long" class, where K is shorter against the tiles), tiles x split_k
    within two waves of CTAs, every CTA at least 16 k-tiles, with the deepest ring that fits and with a 4-stage ring
    (several CTAs per SM); where a tile's cluster of 4 or 8 CTAs would not fit one wave (GPC placement) and each CTA
    would get at least 2 x MIN_K_TILES, also as cluster pairs in K groups, for the cheapest such tile only
    (512_1024_8192: 32 tiles of 128 x 128 in pairs of 2 groups 0.91-0.94x of cuBLAS, the rules' split leaders
    0.86-0.92x, three runs of session 11; at 16 k-tiles a CTA they lost to every fitting cluster). The two best
    tilings lead (each its best ring), so the first two are not one tiling twice. None for other problems."""
    kind = split_class(problem, sms)
    if kind is None:
        return []
    k_tiles = -(-problem.k // 64)
    found: list[Sm90WgmmaParams] = []
    for bm, bn, consumers in TILES:
        if (problem.b_layout == "kn" and bn % 64) or bm > -(-problem.m // 64) * 64 or bn > -(-problem.n // 64) * 64:
            continue  # kn needs 64-column panels; rows or columns past M, N would be computed for nothing
        tiles = problem.tiles(bm, bn)
        if tiles >= sms // 2:
            continue
        for split in (8, 4) if kind == "long" else (8, 4, 2):
            if tiles * split > 2 * sms or k_tiles // split < 16 or tiles * split < 32:
                continue
            ways = [{"split_k": split}]
            if (split >= 4 and CLUSTERS_PER_SLOT[split] < tiles <= CLUSTERS_PER_SLOT[2] * 2 // split
                    and k_tiles // split >= 2 * MIN_K_TILES):  # the workspace sums amortised over a longer K
                ways.append({"split_k": 2, "k_groups": split // 2})
            for way in ways:
                for rings in ((8, 6, 5), (4,)):  # the deepest that fits; a shallow one
                    for stages in rings:
                        try:
                            found.append(Sm90WgmmaParams(block_m=bm, block_n=bn, consumers=consumers,
                                                         stages=stages, **way))
                            break
                        except ValueError:
                            continue
    found.sort(key=lambda p: split_cost(p, problem, sms, smem_per_sm))
    grouped = [_tile(p) for p in found if p.k_groups > 1][:1]  # the K groups of the cheapest such tile only
    found = [p for p in found if p.k_groups == 1 or _tile(p) in grouped]
    leaders: list[Sm90WgmmaParams] = []
    for p in found:
        if len(leaders) < 2 and all(_tiling(p) != _tiling(q) for q in leaders):
            leaders.append(p)
    return (leaders + [p for p in found if p not in leaders])[:12]


def _tiling(p: Sm90WgmmaParams) -> tuple[int, int, int, int]:
    """What a split setting does to the problem, its ring and warpgroups aside."""
    return p.block_m, p.block_n, p.split_k, p.k_groups


def _tile(p: Sm90WgmmaParams) -> tuple[int, int, int]:
    """A setting's tile shape and warpgroups."""
    return p.block_m, p.block_n, p.consumers


def group_settings(problem: Problem, sms: int) -> list[Sm90WgmmaParams]:
    """K-group settings for skinny problems (M <= 64) whose 64-row tiles fill at most half the SMs: 64 x 64, 128, 256
    tiles with as many CTAs per tile as one wave holds (at most 8), first with each CTA at least MIN_K_TILES / 2
    k-tiles, then at least MIN_K_TILES; the deepest ring that fits; none for other problems. A tile's CTAs are K
    groups, or cluster pairs in K groups (the pair sums through distributed shared memory, which costs less than the
    workspace), pairs first. 64 x 256 tiles only as one pair, or in a wave of groups: their sums spill in others
    (fewer groups where K is short; pairs in groups).
    Measured on the H200: 64_4096_16384 64x64 with 2 groups 1.03-1.14x of cuBLAS (the best single-CTA tiles
    0.91-1.03x), a cluster pair 37.6 against 38.6 us kn; 64_1024_4096 nk (decode's k/v projections at batch 64)
    64x64 in 4 pairs of 8 k-tiles 1.23x, 8 groups 1.10x, 4 groups of 16 k-tiles 1.06x, the best unsplit tiles
    0.66-0.80x; on M = 128-1024 the fp32 partials cost more than the extra SMs bring (0.33-0.77x)."""
    k_tiles = -(-problem.k // 64)
    if problem.m > 64 or -(-problem.n // 64) > sms // 2:
        return []
    found = []
    for bn in (64, 128, 256):
        tiles = -(-problem.n // bn)
        if bn > -(-problem.n // 64) * 64:
            continue
        for floor in (MIN_K_TILES // 2, MIN_K_TILES):
            groups = k_parts(tiles, sms, k_tiles, floor)
            if groups < 2:
                continue
            if bn == 256 and groups < min(MAX_PARTS, sms // tiles):
                continue  # 64 x 256 sums spill in fewer groups than a wave holds (where K is short)
            pairs = groups == 2 or (groups >= 4 and bn < 256)  # and as pairs in groups
            ways = [{"split_k": 2, "k_groups": groups // 2}] if pairs else []
            for way in ways + [{"k_groups": groups}]:
                v = deepest({"block_m": 64, "block_n": bn, "consumers": 1, **way})
                if v is not None:
                    found.append(v)
    return found


# Multicast pairs in K groups pay where each CTA keeps a long K. Measured on the H200 (session 13: the rules' first
# eight and up to six pairs each on 17 few-tile long-K problems, one sweep, nk unless noted): of the 10
# problem-layouts where pairs keep 48+ k-tiles a CTA, 5 gained 5-27% over the best of the eight (1607_392_11704
# 176 x 128 swapped pairs in 3 groups 0.91 -> 1.15x of cuBLAS, unpaired 0.99x; 256_2048_16384 128 x 128 in 4 groups
# 0.90 -> 0.99x; 579_1000_14960 1.01 -> 1.07x; 512_1024_8192 64 x 128 in 2 groups 0.94 -> 0.99-1.00x in the sweep,
# both layouts, 0.93-0.96x in the suite runs, where cuBLAS itself moved 19.8-21.7 us between evaluations), 4 were
# level (414 both layouts, 231_3072_24576, 914_1152_10400) and 512_3072_24576 lost 8% (0.83x against 0.90x). At
# 16-32 k-tiles a CTA pairs measured 0.35-0.92x against split-K clusters' 0.97-1.39x (1024_128_4096, 1372_192_6168,
# 221_1024_8192, 128_4096_4096, 2048_256_2048): not proposed.
PAIR_MIN_K_TILES = 3 * MIN_K_TILES
# Pairs of 64-row tiles at M <= 128 are not proposed: there K groups of 64-row tiles measured 0.33-0.77x of the
# unsplit settings (128_8192_8192; not measured in pairs)
PAIR_MIN_M = 128
PAIR_FILL = 0.75  # the share of the SMs a pair setting's CTAs fill at least (the pairs that gained: 0.82-0.97)


def pair_group_settings(problem: Problem, sms: int, smem_per_sm: int, shapes: list[dict],
                        min_k_tiles: int = PAIR_MIN_K_TILES, fill: float = PAIR_FILL,
                        min_m: int = PAIR_MIN_M) -> list[Sm90WgmmaParams]:
    """Multicast pairs in K groups for problems (M > min_m) whose C tiles fill under half the SMs with a long K: the
    two CTAs of a pair take vertically adjacent C tiles and share each B tile (read from L2 once a pair), and as many
    K groups as one wave holds (at most 8, each CTA at least min_k_tiles k-tiles) fill at least `fill` of the SMs. Of
    `shapes` (tile fields: the listed tiles, the swapped tiles of M's rows), those with at least two row tiles and
    128-column multiples, each with its deepest ring, cheapest first by `split_cost`. The defaults are the search
    order's rule; a sweep passes looser limits to measure beyond it."""
    if problem.m <= min_m:
        return []
    k_tiles = -(-problem.k // 64)
    found = []
    for fields in shapes:
        bm, bn = fields["block_m"], fields["block_n"]
        if bn % 128 or -(-problem.m // bm) < 2 or bn > -(-problem.n // 64) * 64:
            continue
        tiles = 2 * problem.tiles(2 * bm, bn)  # whole pairs of row tiles (a trailing CTA past M still loads)
        groups = k_parts(tiles, sms, k_tiles, min_k_tiles)
        if (tiles < sms // 2 and groups >= 2 and tiles * groups >= fill * sms
                and (v := deepest({**fields, "cluster_m": 2, "k_groups": groups}))):
            found.append(v)
    return sorted(found, key=lambda p: split_cost(p, problem, sms, smem_per_sm))


# Clusters of 4 CTAs along N, each loading a quarter of the A tile's rows (multicast) and all of its 64-column B tile,
# unsplit: the structure of cuBLAS's kernel for 414_2472_11744 nk (nvjet 64x144 in clusters of 4, 120 CTAs; ncu, session
# 14). Measured on the H200 (tools/sweeps/multicast_n.sh, multicast_n_class.sh; warm ratio to cuBLAS, the best of the
# rules' first four before): 414_2472_11744 nk 144 x 64 swapped 0.96-0.975x (0.85-0.90x), kn 1.01x (1.03x);
# 1607_392_11704 128 x 64 nk 1.09-1.15x (pairs in K groups 1.03-1.15x), kn 1.17x (1.08x); level or behind where K is
# shorter (56-140 k-tiles: 1024_1024_4096, 2863_512_3584, 1024_1600_6400, 1024_1536_8960 0.86-1.03x against 1.00-1.11x),
# where the tile pads M or N far (148_3584_18944 58% of the tiles' area inside M x N: 0.54-0.56x; 6147_24_12888: 9%),
# and behind on 182_3584_18944 (71%: 0.59-0.62x against 0.95-1.01x), 914_1152_10400 (0.97-0.98x of the pairs in K
# groups' 1.03-1.06x) and 512_3584_18944 (256 x 64: 0.89-0.95x against 0.93-0.99x). No cost model here told the winners
# (1607: 74% inside) from those: they enter the list after the leaders (search.CLUSTER_N_RANK).
CLUSTER_N_MIN_K_TILES = 160
CLUSTER_N_FILL = 0.7  # the share of the launched tiles' area inside M x N at least


def cluster_n_settings(problem: Problem, sms: int, smem_per_sm: int, shapes: list[dict]) -> list[Sm90WgmmaParams]:
    """Tiles of 64 columns and at least twice as many rows (of `shapes`: the listed tiles, the swapped tiles of M's
    rows) in clusters of 4 along N, unsplit, where K has at least CLUSTER_N_MIN_K_TILES k-tiles, the clusters fill
    between PAIR_FILL of the SMs and the one wave of clusters of 4 that run at once, and the padding of M and N
    leaves CLUSTER_N_FILL of the tiles inside them; each with its deepest ring, cheapest first by `split_cost`."""
    if -(-problem.k // 64) < CLUSTER_N_MIN_K_TILES:
        return []
    found = []
    for fields in shapes:
        bm, bn = fields["block_m"], fields["block_n"]
        if bn != 64 or bm < 2 * bn or (v := deepest({**fields, "cluster_n": 4})) is None:
            continue
        ctas = launched_tiles(v, problem)
        inside = problem.m * problem.n / (ctas * bm * bn)
        if PAIR_FILL * sms <= ctas <= 4 * CLUSTERS_PER_SLOT[4] and inside >= CLUSTER_N_FILL:
            found.append(v)
    return sorted(found, key=lambda p: split_cost(p, problem, sms, smem_per_sm))
