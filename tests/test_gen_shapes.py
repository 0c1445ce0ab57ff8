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


def test_with_epilogues_every_epilogue_in_turn_and_the_file_reads_back(tmp_path, capsys):
    from core.epilogue import EPILOGUES, Epilogue

    suite = gen.with_epilogues(gen.generate(7, 48), 7)
    assert suite == gen.with_epilogues(gen.generate(7, 48), 7)
    problems = [p for p, _ in suite]
    names = [e for e in EPILOGUES if e != "none"]
    counts = [sum(p.epilogue == e for p in problems) for e in names]
    assert len(problems) == 48 and max(counts) - min(counts) <= 1 and min(counts) >= 48 // len(names) - 1
    assert all(p.n % 16 == 0 for p in problems if Epilogue(p.epilogue).gated)
    assert {p.b_layout for p in problems} == {"nk", "kn"} and {p.dtype for p in problems} == {"f16", "bf16"}
    assert {p.bias for p in problems} == {True, False}
    assert gen.main(["--seed", "7", "--count", "48", "--epilogues"]) == 0
    f = tmp_path / "fused.txt"
    f.write_text(capsys.readouterr().out)
    assert read_shapes_file(f) == problems  # each line names its own layout, dtype, bias and epilogue
