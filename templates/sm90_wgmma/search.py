"""The search order of the sm90_wgmma family: which settings to try for a problem on a device, best guesses first.

The order is a table of named rules (`RULES`), applied top to bottom. Each rule yields the settings of one kind for
the problem (none where its condition does not hold; `kinds.py` and `splits.py` make them, `costs.py` ranks them) and
says where they go: rules without a place are appended in table order and build the base list (the listed tile
shapes ranked by `tile_cost`, with what leads them); a rule with a place puts its settings after that many settings
of the list as the rules above it left it (two at the same place: the later one's go first). A setting already in
the list keeps its first place; the first MAX_SEEDS are tried. Each rule names the entry of docs/decisions.md that
says why it is there and what it measured.

The learned model (agent/cost_model.py) reorders the result on a device it has measured, under one policy stated
there: this order is its prior, and it holds none of these settings back more than a few places.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from core.device import H200, DeviceFacts
from core.plan import ceil_div
from core.records import Problem
from templates.sm90_wgmma.costs import TILES, byte_group, traffic
from templates.sm90_wgmma.kinds import (
    fitted_settings,
    listed_settings,
    listed_shapes,
    narrow_settings,
    pair_first,
    persistent_leads,
    ping_pong_settings,
    ping_pong_short_k_settings,
    raster_settings,
    swap_fit_settings,
    swap_split_settings,
    swap_tiny_settings,
    swapped_shapes,
    tall_settings,
)
from templates.sm90_wgmma.params import Sm90WgmmaParams, deepest, launch_plan, mixed_rows, tail_cut, with_update
from templates.sm90_wgmma.splits import (
    cluster_n_settings,
    group_settings,
    pair_group_settings,
    split_class,
    split_settings,
)

MAX_SEEDS = 30


@dataclass(frozen=True)
class Search:
    """What the rules read of one problem on one device; each part computed once, when a rule first asks."""

    problem: Problem
    device: DeviceFacts

    @property
    def sms(self) -> int:
        return self.device.sms

    @property
    def k_tiles(self) -> int:
        return ceil_div(self.problem.k, 64)

    @cached_property
    def shapes(self) -> list[tuple[float, list[Sm90WgmmaParams]]]:
        return listed_shapes(self.problem, self.device)

    @cached_property
    def picked(self) -> list[Sm90WgmmaParams]:
        """The best guesses of the listed shapes."""
        return listed_settings(self.shapes)

    @cached_property
    def raster(self) -> list[Sm90WgmmaParams]:
        """The best guess with other raster groups than the one its waves read the fewest bytes in."""
        best = self.picked[0]
        return raster_settings(best, self.problem, byte_group(best, self.problem, self.device))

    @cached_property
    def listed(self) -> list[Sm90WgmmaParams]:
        """The best guesses of the listed shapes, then the best guess's other raster groups."""
        return self.picked + self.raster

    @cached_property
    def first(self) -> list[Sm90WgmmaParams]:
        """The best guess, where it is a multicast pair that goes before the persistent leads."""
        return self.listed[:1] if pair_first(self.listed, self.problem, self.device, self.k_tiles) else []

    @cached_property
    def leads(self) -> list[Sm90WgmmaParams]:
        best = self.listed[0]
        one_wave = self.problem.tiles(best.block_m, best.block_n) <= self.sms * best.min_blocks
        return [] if one_wave else persistent_leads(self.listed[:10], self.k_tiles)

    @cached_property
    def other_epilogues(self) -> list[Sm90WgmmaParams]:
        found = (with_update(p, u) for p in self.listed[:2] for u in ({"epilogue": "direct"}, {"epilogue": "tma"}))
        return [v for v in found if v is not None]

    @cached_property
    def split_class(self) -> str | None:
        return split_class(self.problem, self.sms)

    @cached_property
    def split(self) -> list[Sm90WgmmaParams]:
        return split_settings(self.problem, self.device)

    @cached_property
    def swap_fit(self) -> tuple[list[Sm90WgmmaParams], list[Sm90WgmmaParams]]:
        """The M-fitted swapped tiles: leads and their other kinds."""
        return swap_fit_settings(self.problem, self.device, self.shapes[0][0])

    @cached_property
    def swap_split(self) -> list[Sm90WgmmaParams]:
        return swap_split_settings(self.problem, self.device)

    @cached_property
    def tile_fields(self) -> list[dict[str, Any]]:
        """The listed tiles and the swapped tiles of M's rows, as fields: the shapes the cluster rules try."""
        return [{"block_m": bm, "block_n": bn, "consumers": c} for bm, bn, c in TILES] + swapped_shapes(self.problem)

    @cached_property
    def wide(self) -> list[Sm90WgmmaParams]:
        """The first two one-tile-a-block settings of the base list whose columns are whole 128-column pairs."""
        base = self.first + self.leads + self.listed[len(self.first):] + self.other_epilogues
        return [p for p in base if not p.persistent and p.block_n % 128 == 0][:2]


Settings = Callable[[Search, list[Sm90WgmmaParams]], list[Sm90WgmmaParams]]


@dataclass(frozen=True)
class Rule:
    """One rule of the order: its name, the docs/decisions.md entry that says why, its condition in words, the
    settings it yields (from what the problem is and the list as the rules above left it), and where they go: after
    `after` settings, or appended where None."""

    name: str
    decision: str
    when: str
    settings: Settings
    after: int | None = None


def _cp_async(s: Search, ordered: list[Sm90WgmmaParams]) -> list[Sm90WgmmaParams]:
    found = (with_update(p, {"loader": "cp_async"}) for p in ordered[:2]
             if p.consumers == 1 or p.split_k > 1 or p.k_groups > 1)
    return [v for v in found if v is not None]


# Tile shapes a tail split is tried with (persistent, TMA stores, the deepest ring that fits): (rows, columns, swapped).
TAIL_TILES = ((128, 256, False), (256, 128, False), (128, 192, False))
TALL_TAIL_TILES = ((192, 256, True),)  # the tall swapped tile's own rule (decisions.md `tail-split-tall`)
TAIL_GAIN = 0.99  # its rounds' work under that of the same tile without the cut
TAIL_SLACK = 1.05  # and at most this over the least of the first four that do not split K (the estimate leaves out
#                    what a tile shape costs beside its area: 128 x 256 tail splits measured ahead of 128 x 192 whole)


def _rounds_work(p: Sm90WgmmaParams, s: Search) -> float:
    """Rounds of tiles over the SMs times a tile's area: what a setting's time follows on large problems (the last
    round counts whole, or, tail split, as the share of a tile each of its CTAs takes)."""
    plan = launch_plan(p, s.problem, s.device)
    if not p.persistent:
        return plan.waves * p.block_m * p.block_n
    last = tail_cut(plan.tiles, plan.ctas, s.k_tiles)[1] if p.tail_split else float(plan.tiles % plan.ctas > 0)
    return (plan.tiles // plan.ctas + last) * p.block_m * p.block_n


def _first_four_least(ordered: list[Sm90WgmmaParams], cost: Callable[[Sm90WgmmaParams], float]) -> float | None:
    """The least cost of the first four settings of the list that do not split K; None if there are none."""
    return min((cost(p) for p in ordered[:4] if not p.reduces), default=None)


def _tail_split_of(tiles: tuple[tuple[int, int, bool], ...]) -> Settings:
    """The rule's settings: the tail-split setting of `tiles` whose rounds take the least work, among those a cut
    along K saves 1 - TAIL_GAIN of the same tile's work (a part-filled last round that the cut ends sooner), where
    that work is at most TAIL_SLACK times the least of the first four settings that do not split K."""
    def settings(s: Search, ordered: list[Sm90WgmmaParams]) -> list[Sm90WgmmaParams]:
        found = []
        for bm, bn, swapped in tiles:
            v = deepest({"block_m": bm, "block_n": bn, "consumers": 2, "persistent": True, "epilogue": "tma",
                         "tail_split": True, "swap_ab": swapped}, top=4)
            if v is None or bm > ceil_div(s.problem.m, 64) * 64 or bn > ceil_div(s.problem.n, 64) * 64:
                continue
            work = _rounds_work(v, s)
            if work < TAIL_GAIN * _rounds_work(v.model_copy(update={"tail_split": False}), s):
                found.append((work, v))
        if not found:
            return []
        work, best = min(found, key=lambda f: f[0])
        least = _first_four_least(ordered, lambda p: _rounds_work(p, s))
        return [best] if least is None or work <= TAIL_SLACK * least else []
    return settings


MIXED_SAVE = 0.985  # the busiest CTA's work with the kernel's narrow rows, as a share of whole rounds of wide tiles


def _mixed_tail(s: Search, ordered: list[Sm90WgmmaParams]) -> list[Sm90WgmmaParams]:
    """The persistent 128 x 256 TMA-store setting with a mixed tail, where its tiles take more than one round, the
    narrow rows the kernel would cut end the busiest CTA's work in at most MIXED_SAVE of the whole rounds, and that
    work (in tile areas) is at most TAIL_SLACK times the least of the first four settings that do not split K (not
    for a gated epilogue)."""
    v = deepest({"block_m": 128, "block_n": 256, "consumers": 2, "persistent": True, "epilogue": "tma",
                 "mixed_tail": True}, top=4)
    if v is None or s.problem.fused.gated:
        return []
    ctas = launch_plan(v, s.problem, s.device).ctas
    tiles_m, tiles_n = ceil_div(s.problem.m, v.block_m), ceil_div(s.problem.n, v.block_n)
    rounds = ceil_div(tiles_m * tiles_n, ctas)
    if rounds == 1:
        return []
    rows, busiest = mixed_rows(tiles_m, tiles_n, ceil_div(s.problem.n, v.narrow_n), ctas)
    if not rows or busiest > MIXED_SAVE * rounds:
        return []
    work = busiest * v.block_m * v.block_n
    least = _first_four_least(ordered, lambda p: _rounds_work(p, s))
    return [v] if least is None or work <= TAIL_SLACK * least else []


# Swapped tiles of 192 columns (three consumers, one m64 wgmma each) and M-fitted rows, whose rounds fill the SMs
# better than the first four settings (decisions.md `swap-wave`): cuBLAS's tiling of 1246 x 3072 x 8192.
SWAP_WAVE_GAIN = 0.965  # their rounds' work x traffic at most this share of the first four's least
SWAP_WAVE_MIN = 1024  # M, N and K at least this: the large class, where it was measured


def _swap_wave(s: Search, ordered: list[Sm90WgmmaParams]) -> list[Sm90WgmmaParams]:
    """For M, N and K of SWAP_WAVE_MIN or more: of the swapped shapes of M's rows with 192 columns, the one whose
    rounds take the least work x traffic (`_rounds_work` x `costs.traffic`), where that is at most
    SWAP_WAVE_GAIN of the least of the first four settings that do not split K: with TMA stores, within a wave one
    tile a CTA with the deepest ring of up to 5 stages, beyond it persistent."""
    def cost(p: Sm90WgmmaParams) -> float:
        return _rounds_work(p, s) * traffic(p.block_m, p.block_n)

    if min(s.problem.m, s.problem.n, s.problem.k) < SWAP_WAVE_MIN:
        return []
    found = []
    for fields in swapped_shapes(s.problem):
        if fields["block_n"] != 192:
            continue
        tiles = s.problem.tiles(fields["block_m"], fields["block_n"])
        v = deepest({**fields, "epilogue": "tma", "persistent": tiles > s.sms}, top=5)
        found += [(cost(v), v)] if v is not None else []
    bar = _first_four_least(ordered, cost)
    if not found or bar is None:
        return []
    work, best = min(found, key=lambda f: f[0])
    return [best] if work <= SWAP_WAVE_GAIN * bar else []


def _residual_panels(s: Search, ordered: list[Sm90WgmmaParams]) -> list[Sm90WgmmaParams]:
    """For a residual epilogue whose first two settings both load R after the mainloop (C stored through shared
    memory or directly): those of them that are not swapped and do not split K, with TMA stores instead, so that R
    comes by TMA into the staging panels (`residual_panels`)."""
    if not s.problem.fused.residual or any(p.residual_panels for p in ordered[:2]):
        return []
    found = (with_update(p, {"epilogue": "tma"}) for p in ordered[:2] if not p.swap_ab and not p.reduces)
    return [v for v in found if v is not None and v.residual_panels]


FEW_TILES_LONG_K = "32+ k-tiles and K >= 8 max(M, N), or M > 64 and 64 x 64 tiles fill at most half the SMs"
RULES: tuple[Rule, ...] = (
    # the base list, appended in this order
    Rule("swap-tiny", "swap-tiny", "M <= 48",
         lambda s, _: swap_tiny_settings(s.problem, s.device)),
    Rule("split-k-leaders", "split-k", FEW_TILES_LONG_K + ": the two best tilings",
         lambda s, _: s.split[:2] if s.split_class in ("long", "few") else []),
    Rule("k-groups-skinny", "k-groups-skinny", "M <= 64 and 64-row tiles fill at most half the SMs",
         lambda s, _: group_settings(s.problem, s.device)),
    Rule("split-k-rest", "split-k", FEW_TILES_LONG_K + ": the other split settings",
         lambda s, _: s.split[2:] if s.split_class in ("long", "few") else []),
    Rule("pair-first", "pair-first", "the best guess is a multicast pair well ahead of the best single tile",
         lambda s, _: s.first),
    Rule("persistent-leads", "persistent-leads", "the best guess gives a block more than one tile",
         lambda s, _: s.leads),
    Rule("listed", "tile-cost", "always", lambda s, _: s.listed[len(s.first):]),
    Rule("other-epilogues", "other-epilogues", "always", lambda s, _: s.other_epilogues),
    # then each rule's settings where it places them
    Rule("split-k-some", "split-k", "32+ k-tiles, M > 64, 128 x 128 tiles fill at most a quarter of the SMs and "
         "smaller tiles fill them", lambda s, _: s.split if s.split_class == "some" else [], after=6),
    Rule("ping-pong", "ping-pong", "K <= 128 and two tiles a block or more",
         lambda s, _: ping_pong_settings(s.problem, s.device), after=0),
    Rule("narrow", "narrow", "M > 48, N <= 64 and K long enough to split in pairs",
         lambda s, _: narrow_settings(s.problem, s.device), after=0),
    Rule("swap-split", "swap-split", "M > 256, not a multiple of 128, swapped tiles fill under half the SMs",
         lambda s, _: s.swap_split, after=2),
    Rule("swap-fit", "swap-fit", "M > 48, swapped tiles of M's rows 5% ahead by tile_cost (unless swap-split)",
         lambda s, _: [] if s.swap_split else s.swap_fit[0], after=2),
    Rule("tall", "tall", "beyond a wave, tall swapped tiles ahead of the persistent lead by tile_cost x 1.05",
         lambda s, _: tall_settings(s.problem, s.device, s.leads), after=2),
    Rule("fitted", "fitted", "fitted tile shapes 3% ahead of every listed one by tile_cost",
         lambda s, _: fitted_settings(s.problem, s.device, s.shapes[0][0]), after=4),
    Rule("swap-fit-alternates", "swap-fit", "the swap-fit tiles' other kinds (all of them, where swap-split leads)",
         lambda s, _: (s.swap_fit[0] if s.swap_split else []) + s.swap_fit[1], after=7),
    Rule("cp-async", "cp-async", "the first two settings have one consumer warpgroup or split K", _cp_async, after=8),
    Rule("pair-groups", "pair-groups", "M > 128, C tiles under half the SMs, 48+ k-tiles a CTA in pairs",
         lambda s, _: pair_group_settings(s.problem, s.device, s.tile_fields)[:2], after=1),
    Rule("cluster-n", "cluster-n", "160+ k-tiles, 64-column tiles whose clusters of 4 fill about one wave",
         lambda s, _: cluster_n_settings(s.problem, s.device, s.tile_fields)[:1], after=3),
    Rule("tail-split", "tail-split", "a persistent tile whose part-filled last round, cut along K, takes 1% less work "
         "than the same tile uncut, within 5% of the first four's least", _tail_split_of(TAIL_TILES), after=1),
    Rule("tail-split-tall", "tail-split-tall", "the tall swapped 192 x 256 tile, where the same holds for it: third",
         _tail_split_of(TALL_TAIL_TILES), after=2),
    Rule("swap-wave", "swap-wave", "M, N, K >= 1024: swapped 192-column tiles of M-fitted rows whose rounds take "
         "at most 96.5% of the first four's least work x traffic", _swap_wave, after=2),
    Rule("mixed-tail", "mixed-tail", "beyond a round of 128 x 256 tiles, the kernel's narrow last tile-rows end the "
         "busiest block's work in at most 98.5% of the whole rounds, within 5% of the first four's least",
         _mixed_tail, after=6),
    Rule("residual-panels", "residual-panels", "a residual epilogue whose first two settings load R after the "
         "mainloop: those not swapped or split, with TMA stores (R by TMA into the panels), first",
         _residual_panels, after=0),
    Rule("ping-pong-short-k", "ping-pong-short-k", "M, N >= 1024, 16-25 k-tiles, two 128 x 192 tiles a block or "
         "more, no residual or gated epilogue: ping-pong 128 x 192 with C a panel at a time, second",
         lambda s, _: ping_pong_short_k_settings(s.problem, s.device), after=1),
    Rule("multicast-late", "multicast-late", "two one-tile-a-block guesses of 128-column multiples",
         lambda s, _: [v for p in s.wide if (v := with_update(p, {"cluster_m": 2})) is not None], after=12),
)


def traced(problem: Problem, device: DeviceFacts = H200) -> list[tuple[str, Sm90WgmmaParams]]:
    """The order with the rule that placed each setting: every rule's settings, placed as the table says, each in
    the raster group its waves read the fewest bytes in (`byte_group`; the best guess's other groups as they are),
    each setting at its first place, the first MAX_SEEDS."""
    s = Search(problem, device)
    ordered: list[tuple[str, Sm90WgmmaParams]] = []
    for rule in RULES:
        found = [(rule.name, p) for p in rule.settings(s, [p for _, p in ordered])]
        at = len(ordered) if rule.after is None else rule.after
        ordered[at:at] = found
    others = {id(p) for p in s.raster}  # these objects, not their equals: one of them may be the default group's
    seen: dict[str, tuple[str, Sm90WgmmaParams]] = {}
    for name, p in ordered:
        if id(p) not in others:
            p = p.model_copy(update={"raster_group": byte_group(p, problem, device)})
        seen.setdefault(p.model_dump_json(), (name, p))
    return list(seen.values())[:MAX_SEEDS]


def seeds(problem: Problem, device: DeviceFacts = H200) -> list[dict[str, Any]]:
    """The settings worth trying for this problem on this device, best guesses first (at most MAX_SEEDS)."""
    return [p.model_dump() for _, p in traced(problem, device)]
