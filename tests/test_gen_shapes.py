"""tools/gen_shapes.py: a seeded suite of LLM projections and odd sizes that `run --shapes` reads."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from agent.shapes import read_shapes_file

_spec = importlib.util.spec_from_file_location("gen_shapes", Path(__file__).parents[1] / "tools" / "gen_shapes.py")
gen = importlib.util.module_from_spec(_spec)
sys.modules["gen_shapes"] = gen  # dataclasses look their module up there
_spec.loader.exec_module(gen)


def test_same_seed_same_suite_other_seed_other_suite():
    a, b, c = gen.generate(5, 48), gen.generate(5, 48), gen.generate(6, 48)
    assert a == b
    assert [p for p, _ in a] != [p for p, _ in c]


def test_suite_holds_distinct_valid_shapes_of_both_kinds():
    suite = gen.generate(11, 200)
    problems = [p for p, _ in suite]
    assert len(problems) == 200 == len(set(problems))
    assert all(p.n % 8 == 0 and p.k % 8 == 0 and p.m * p.n * p.k <= gen.MAX_MNK for p in problems)
    notes = [note for _, note in suite]
    odd = sum(note == "random odd size" for note in notes)
    assert 0.1 * len(notes) < odd < 0.4 * len(notes)
    assert any("decode" in n for n in notes) and any("prefill" in n for n in notes)
    assert len({n.split()[0] for n in notes if "tokens" in n}) >= 8  # many model configurations, not a few


def test_projections_follow_the_configuration():
    shapes = {name: (n, k) for name, n, k in gen.projections(gen.MODELS["llama-3-8b"])}
    assert shapes["q"] == (4096, 4096) and shapes["kv"] == (1024, 4096)  # 8 KV heads of 128
    assert shapes["down"] == (4096, 14336) and shapes["lm_head"] == (128256, 4096)


def test_output_is_a_shapes_file(tmp_path, capsys):
    assert gen.main(["--seed", "3", "--count", "12"]) == 0
    f = tmp_path / "suite.txt"
    f.write_text(capsys.readouterr().out)
    assert read_shapes_file(f, "nk") == [p.__class__(p.m, p.n, p.k, "nk") for p, _ in gen.generate(3, 12)]


def test_bad_count_exit_2(capsys):
    assert gen.main(["--seed", "1", "--count", "0"]) == 2
    assert "error: --count" in capsys.readouterr().err
