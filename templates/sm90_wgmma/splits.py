"""Settings of the sm90_wgmma family's search order (`search.py`) for few C tiles and a long K: which problems split
K over several CTAs a C tile (thread-block clusters summing through distributed shared memory, K groups summing
through a workspace, multicast pairs in K groups) and the settings that do it, best guesses first; and unsplit
clusters along N that share A's rows. Why each: docs/decisions.md, the entries named beside them.
"""

from __future__ import annotations

from core.device import DeviceFacts
from core.plan import ceil_div
from core.records import Problem
from templates.sm90_wgmma.costs import MIN_K_TILES, TILES, split_cost
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
    N (K >= 8 max(M, N)): split settings lead. At M > 64 (skinny problems have K groups and swapped roles of their
    own): "few" where even 64 x 64 tiles fill at most half the SMs (1024_128_4096: 32): split settings lead too;
    "some" where 128 x 128 tiles fill at most a quarter of the SMs but smaller tiles fill them: split settings enter
    after the best unsplit guesses. None: no split-K (decisions.md `split-k`)."""
    if problem.k < 32 * 64:
        return None
    if problem.k >= 8 * max(problem.m, problem.n):
        return "long"
    if problem.m <= 64:
        return None
    if problem.tiles(64, 64) <= sms // 2:
        return "few"
    return "some" if problem.tiles(128, 128) <= sms // 4 else None


def split_settings(problem: Problem, device: DeviceFacts) -> list[Sm90WgmmaParams]:
    """Split-K settings for long-K problems with few C tiles (`split_class`), best guesses first: every tile shape
    with split_k 8 or 4 (and 2 outside the "long" class, where K is shorter against the tiles), tiles x split_k
    within two waves of CTAs, every CTA at least 16 k-tiles, with the deepest ring that fits and with a 4-stage ring
    (several CTAs per SM); where a tile's cluster of 4 or 8 CTAs would not fit one wave (GPC placement) and each CTA
    would get at least 2 x MIN_K_TILES, also as cluster pairs in K groups, for the cheapest such tile only. The two
    best tilings lead (each its best ring), so the first two are not one tiling twice. None for other problems
    (decisions.md `split-k`)."""
    kind = split_class(problem, device.sms)
    if kind is None:
        return []
    k_tiles = ceil_div(problem.k, 64)
    found: list[Sm90WgmmaParams] = []
    for bm, bn, consumers in TILES:
        if ((problem.b_layout == "kn" and bn % 64) or bm > ceil_div(problem.m, 64) * 64
                or bn > ceil_div(problem.n, 64) * 64):
            continue  # kn needs 64-column panels; rows or columns past M, N would be computed for nothing
        tiles = problem.tiles(bm, bn)
        if tiles >= device.sms // 2:
            continue
        for split in (8, 4) if kind == "long" else (8, 4, 2):
            if tiles * split > 2 * device.sms or k_tiles // split < 16 or tiles * split < 32:
                continue
            ways = [{"split_k": split}]
            if (split >= 4 and device.clusters_at_once(split) < tiles <= device.clusters_at_once(2) * 2 // split
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
    found.sort(key=lambda p: split_cost(p, problem, device))
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


def group_settings(problem: Problem, device: DeviceFacts) -> list[Sm90WgmmaParams]:
    """K-group settings for skinny problems (M <= 64) whose 64-row tiles fill at most half the SMs: 64 x 64, 128, 256
    tiles with as many CTAs per tile as one wave holds (at most 8), first with each CTA at least MIN_K_TILES / 2
    k-tiles, then at least MIN_K_TILES; the deepest ring that fits; none for other problems. A tile's CTAs are K
    groups, or cluster pairs in K groups (the pair sums through distributed shared memory, which costs less than the
    workspace), pairs first. 64 x 256 tiles only as one pair, or in a wave of groups: their sums spill in others
    (fewer groups where K is short; pairs in groups). At M = 128-1024 the fp32 partials cost more than the extra SMs
    bring (decisions.md `k-groups-skinny`)."""
    k_tiles = ceil_div(problem.k, 64)
    if problem.m > 64 or ceil_div(problem.n, 64) > device.sms // 2:
        return []
    found = []
    for bn in (64, 128, 256):
        tiles = ceil_div(problem.n, bn)
        if bn > ceil_div(problem.n, 64) * 64:
            continue
        for floor in (MIN_K_TILES // 2, MIN_K_TILES):
            groups = k_parts(tiles, device.sms, k_tiles, floor)
            if groups < 2:
                continue
            if bn == 256 and groups < min(MAX_PARTS, device.sms // tiles):
                continue  # 64 x 256 sums spill in fewer groups than a wave holds (where K is short)
            pairs = groups == 2 or (groups >= 4 and bn < 256)  # and as pairs in groups
            ways = [{"split_k": 2, "k_groups": groups // 2}] if pairs else []
            for way in ways + [{"k_groups": groups}]:
                v = deepest({"block_m": 64, "block_n": bn, "consumers": 1, **way})
                if v is not None:
                    found.append(v)
    return found


# Multicast pairs in K groups pay where each CTA keeps a long K; with 16-32 k-tiles a CTA split-K clusters beat them
# (decisions.md `pair-groups`).
PAIR_MIN_K_TILES = 3 * MIN_K_TILES
PAIR_MIN_M = 128  # pairs of 64-row tiles at M <= 128 are not proposed: K groups lose there (`pair-groups`)
PAIR_FILL = 0.75  # the share of the SMs a pair setting's CTAs fill at least


def pair_group_settings(problem: Problem, device: DeviceFacts, shapes: list[dict],
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
    k_tiles = ceil_div(problem.k, 64)
    found = []
    for fields in shapes:
        bm, bn = fields["block_m"], fields["block_n"]
        if bn % 128 or ceil_div(problem.m, bm) < 2 or bn > ceil_div(problem.n, 64) * 64:
            continue
        tiles = 2 * problem.tiles(2 * bm, bn)  # whole pairs of row tiles (a trailing CTA past M still loads)
        groups = k_parts(tiles, device.sms, k_tiles, min_k_tiles)
        if (tiles < device.sms // 2 and groups >= 2 and tiles * groups >= fill * device.sms
                and (v := deepest({**fields, "cluster_m": 2, "k_groups": groups}))):
            found.append(v)
    return sorted(found, key=lambda p: split_cost(p, problem, device))


# Clusters of 4 CTAs along N, each loading a quarter of the A tile's rows (multicast) and all of its 64-column B tile,
# unsplit: the structure of cuBLAS's kernel for 414_2472_11744 nk (nvjet 64x144 in clusters of 4, 120 CTAs). For a
# very long K, and only where the tiles pad M and N little; no cost model here tells where they win, so they enter
# after the leaders, not by cost (decisions.md `cluster-n`).
CLUSTER_N_MIN_K_TILES = 160
CLUSTER_N_FILL = 0.7  # the share of the launched tiles' area inside M x N at least


def cluster_n_settings(problem: Problem, device: DeviceFacts, shapes: list[dict]) -> list[Sm90WgmmaParams]:
    """Tiles of 64 columns and at least twice as many rows (of `shapes`: the listed tiles, the swapped tiles of M's
    rows) in clusters of 4 along N, unsplit, where K has at least CLUSTER_N_MIN_K_TILES k-tiles, the clusters fill
    between PAIR_FILL of the SMs and the one wave of clusters of 4 that run at once, and the padding of M and N
    leaves CLUSTER_N_FILL of the tiles inside them; each with its deepest ring, cheapest first by `split_cost`."""
    if ceil_div(problem.k, 64) < CLUSTER_N_MIN_K_TILES:
        return []
    found = []
    for fields in shapes:
        bm, bn = fields["block_m"], fields["block_n"]
        if bn != 64 or bm < 2 * bn or (v := deepest({**fields, "cluster_n": 4})) is None:
            continue
        ctas = launched_tiles(v, problem)
        inside = problem.m * problem.n / (ctas * bm * bn)
        if PAIR_FILL * device.sms <= ctas <= 4 * device.clusters_at_once(4) and inside >= CLUSTER_N_FILL:
            found.append(v)
    return sorted(found, key=lambda p: split_cost(p, problem, device))
