"""The sm90_wgmma search order as a table of rules (templates/sm90_wgmma/search.py): how the table places settings,
that every rule has its reason in docs/decisions.md, and what must lead where on the dev suite and a generated suite,
both layouts. (Which settings each kind yields, and the positions the table gives them on chosen problems, are in
tests/test_sm90_family.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.device import H200
from core.records import Problem
from templates.sm90_wgmma import search
from templates.sm90_wgmma.params import Sm90WgmmaParams
from templates.sm90_wgmma.search import RULES, Rule, Search, seeds, traced

ROOT = Path(__file__).parents[1]
DECISIONS = (ROOT / "docs" / "decisions.md").read_text()
ENTRIES = set(re.findall(r"^## `([a-z0-9-]+)`", DECISIONS, re.M))


def _suite() -> list[Problem]:
    dev = ["64_64_64", "64_4096_64", "512_512_128", "1024_1024_1024", "64_1024_16384", "256_128_16384",
           "64_4096_16384", "128_8192_8192", "16384_512_128", "12288_1024_64", "16384_16384_64", "2048_1024_12288",
           "256_4096_4096", "4096_4096_4096", "16_4096_4096", "1000_3000_2000", "1024_128_4096", "2048_256_4096"]
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_shapes.py"), "--seed", "2026", "--count", "48"],
                         capture_output=True, text=True, check=True).stdout
    generated = [line.split("#")[0].strip() for line in out.splitlines() if line.split("#")[0].strip()]
    return [Problem(*map(int, s.split("_")), layout) for s in dev + generated for layout in ("kn", "nk")]


SUITE = _suite()
LEADING = {"ping-pong", "narrow", "swap-tiny", "split-k-leaders", "k-groups-skinny", "pair-first", "persistent-leads",
           "listed"}


def test_every_rule_names_a_decision_and_every_cited_decision_exists():
    assert len({r.name for r in RULES}) == len(RULES)
    assert {r.decision for r in RULES} <= ENTRIES
    assert all(r.when for r in RULES)
    cited = set()
    for folder in ("agent", "core", "sandbox", "templates"):
        for path in (ROOT / folder).rglob("*.py"):
            cited |= set(re.findall(r"decisions\.md,?\s+(?:#\s*)?`([a-z0-9-]+)`", path.read_text()))
    assert cited and cited <= ENTRIES, sorted(cited - ENTRIES)


def test_no_comment_in_the_code_cites_a_session_or_the_notebook():
    for folder in ("agent", "core", "sandbox", "templates"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".j2", ".cpp", ".h"):
                text = path.read_text()
                assert not re.search(r"\bsessions? \d|BENCHMARKS|notebook", text), path


def _table(monkeypatch, rules: tuple[Rule, ...]) -> list[tuple[str, int]]:
    monkeypatch.setattr(search, "RULES", rules)
    return [(name, p.block_n) for name, p in traced(Problem(64, 64, 64))]


def _of(*widths: int):
    return lambda s, ordered: [Sm90WgmmaParams(block_m=64, block_n=n, consumers=1, stages=2) for n in widths]


def test_the_table_appends_then_places_after_counting_the_list_as_it_stands(monkeypatch):
    rules = (Rule("a", "tile-cost", "always", _of(16, 32, 48)), Rule("b", "tile-cost", "always", _of(64)),
             Rule("c", "tile-cost", "always", _of(80), after=1), Rule("d", "tile-cost", "always", _of(96), after=1),
             Rule("e", "tile-cost", "always", _of(112, 32), after=0),  # 32 is a's: it keeps its first place
             Rule("f", "tile-cost", "always", _of(128), after=99))  # past the end: appended
    assert _table(monkeypatch, rules) == [("e", 112), ("e", 32), ("a", 16), ("d", 96), ("c", 80), ("a", 48),
                                          ("b", 64), ("f", 128)]
    # a rule sees the list as the rules above it left it
    seen = []
    rules = (Rule("a", "tile-cost", "always", _of(16, 32)),
             Rule("g", "tile-cost", "always", lambda s, ordered: seen.append(len(ordered)) or [], after=0))
    _table(monkeypatch, rules)
    assert seen == [2]
    monkeypatch.setattr(search, "MAX_SEEDS", 2)
    assert len(_table(monkeypatch, (Rule("a", "tile-cost", "always", _of(16, 32, 48)),))) == 2


@pytest.mark.parametrize("problem", SUITE, ids=lambda p: p.key)
def test_what_leads_where(problem):
    order = traced(problem)
    names = [name for name, _ in order]
    s = Search(problem, H200)
    assert [p.model_dump() for _, p in order] == seeds(problem)
    assert 8 <= len(order) <= search.MAX_SEEDS
    assert names[0] in LEADING, "late kinds (other epilogues, cp.async, fitted shapes, clusters) never lead"
    # ping-pong consumers and narrow splits, where they apply, lead
    for rule in ("ping-pong", "narrow"):
        if rule in names:
            assert names[0] in ("ping-pong", "narrow")
    # few C tiles with a long K: a setting that splits K leads wherever split settings exist
    if s.split_class in ("long", "few") and s.split:
        assert order[0][1].split_k * order[0][1].k_groups > 1
    # persistent blocks lead beyond one wave only, and then before any one-tile-a-block guess of the listed shapes
    # (a tail split may come second: its own tiles go past one round)
    best = s.listed[0]
    beyond = problem.tiles(best.block_m, best.block_n) > H200.sms * best.min_blocks
    if "persistent-leads" in names:
        assert beyond and names.index("persistent-leads") < names.index("listed")
    elif not beyond:
        assert not any(p.persistent and not p.swap_ab and not p.ping_pong and not p.tail_split for _, p in order[:3])
    # the cost model's best tile shape, in one kind or another, is among the first six where no kind of its own
    # leads (ping-pong consumers, split K, swapped roles)
    if not {"ping-pong", "swap-tiny", "split-k-leaders", "k-groups-skinny", "narrow", "swap-split"} & set(names):
        assert (best.block_m, best.block_n) in [(p.block_m, p.block_n) for _, p in order[:6]]


def test_settings_run_in_the_raster_group_whose_waves_read_the_fewest_bytes():
    from templates.sm90_wgmma.costs import DEFAULT_GROUP, byte_group, wave_bytes

    big = Problem(4437, 8192, 8192, "nk")  # 35 x 32 tiles of 128 x 256: a wave of 132 reads 8 rows, 16.5 columns
    order = traced(big)
    lead = order[0][1]
    g = byte_group(lead.model_copy(update={"raster_group": DEFAULT_GROUP}), big, H200)
    assert g != DEFAULT_GROUP and lead.raster_group == g
    tiles_m, tiles_n, panel = 35, 32, 8192 * 2
    chosen, default = (wave_bytes(tiles_m, tiles_n, x, 132, 128 * panel, 256 * panel) for x in (g, DEFAULT_GROUP))
    assert chosen < 0.95 * default and abs(default / 1e6 - 888) < 0.02 * 888  # ncu's 888 MB at group 8 (session 23)
    groups = [p.raster_group for _, p in order if (p.block_m, p.block_n, p.persistent) == (128, 256, True)
              and not p.tail_split]
    assert groups[0] == g and DEFAULT_GROUP in [p.raster_group for _, p in order]  # the old group is still tried
    for _, p in order:  # clusters and split K keep the default
        if p.cluster_m > 1 or p.cluster_n > 1 or p.split_k > 1 or p.k_groups > 1:
            assert p.raster_group in (DEFAULT_GROUP, 16, 4, 1)
    small = traced(Problem(256, 4096, 4096, "nk"))  # one wave: every group reads the same panels
    assert {p.raster_group for _, p in small} <= {DEFAULT_GROUP, 16, 4, 1}
    assert [p.raster_group for _, p in small[:3]] == [DEFAULT_GROUP] * 3


def test_a_residual_epilogue_leads_with_r_by_tma_where_the_first_settings_would_load_it_after_the_mainloop():
    one_round = Problem(2048, 2048, 2048, "nk", "bf16", False, "residual")  # 128 tiles of 128 x 256: one-tile blocks
    order = traced(one_round)
    plain = traced(Problem(2048, 2048, 2048, "nk", "bf16"))
    assert plain[0][1].epilogue != "tma" and not plain[0][1].residual_panels
    assert [name for name, _ in order[:2]] == ["residual-panels"] * 2
    assert all(p.residual_panels and p.epilogue == "tma" for _, p in order[:2])
    assert [p.model_copy(update={"epilogue": "tma"}) for _, p in plain[:2]] == [p for _, p in order[:2]]
    assert [p for _, p in order[2:4]] == [p for _, p in plain[:2]]  # the list's own first two still follow
    # beyond a round the persistent leads already bring R by TMA; at decode swapped tiles lead: nothing added
    for problem in (Problem(2048, 4096, 14336, "nk", "f16", False, "residual"),
                    Problem(8, 4096, 4096, "nk", "f16", False, "residual")):
        order = traced(problem)
        assert "residual-panels" not in [name for name, _ in order]
    assert traced(Problem(2048, 4096, 14336, "nk", "f16", False, "residual"))[0][1].residual_panels
