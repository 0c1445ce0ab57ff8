"""What `show --llm` and `diff` print for the model's calls and patched candidates, and older run stores."""

from __future__ import annotations

import io

from rich.console import Console

from agent.report import diff_view, model_calls_view
from agent.store import RunStore
from core.records import (
    BuildResult,
    Candidate,
    EvalResult,
    ModelCall,
    Patch,
    Problem,
    ProposalFate,
    Status,
    TextEdit,
    Timing,
)

P = Problem(128, 128, 128)
PARAMS = {"block_x": 16, "block_y": 16}
LONG = "x" * 150 + " the end of a long line"


def text(renderable, width: int = 160) -> str:
    """What the CLI prints to a file or pipe (160 columns)."""
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def store_with_a_patch(folder) -> tuple[RunStore, Candidate, Candidate]:
    store = RunStore(folder, create=True)
    store.add_problems([P])
    plain = Candidate(P, "naive", PARAMS)
    patched = Candidate(P, "naive", PARAMS, "llm-patch", "shorter loop", "patched template",
                        Patch("naive", (TextEdit("float acc = 0.0f;", "float acc = 0.0f;  // " + LONG),)))
    t, cublas = Timing(8.0, 7.9, 8.1, 100), Timing(12.0, 11.9, 12.1, 100)
    for c, source in ((plain, "int a;\n"), (patched, f"int a;\n// {LONG}\n")):
        store.add_candidate(c)
        store.add_build(BuildResult(c.id, True, "sm_90a", source))
        store.add_result(EvalResult(c.id, Status.OK, warm=t, cublas_warm=cublas))
    return store, plain, patched


def test_show_llm_lists_each_call_its_proposals_and_their_fates(tmp_path):
    store, _, patched = store_with_a_patch(tmp_path / "r")
    assert "made no LLM calls" in text(model_calls_view(store))
    fates = (ProposalFate("patch", "naive", "accepted", "naive", patched.id),
             ProposalFate("params", "naive", "accepted", candidate_id="0123456789ab"),
             ProposalFate("patch", "naive", "refused", "naive",
                          reason="edit 1: search text occurs 3 times: add context"))
    store.add_model_call(ModelCall(P.key, "propose", 12_345, 678, False, ("the Jinja template of naive (~250 tokens)",),
                                   fates))
    store.add_model_call(ModelCall(P.key, "resend", 40, 2, True, error="reply dropped: not valid JSON [x]"))
    store.close()
    out = text(model_calls_view(RunStore(tmp_path / "r")))
    assert "12,345 / 678" in out and "40 / 2 (est.)" in out and "propose" in out and "resend" in out
    assert "patch naive on naive" in out and f"accepted as {patched.id}" in out and "ok 1.500x" in out
    assert "not tried" in out and "refused: edit 1: search text occurs 3 times" in out
    assert "reply dropped: not valid JSON [x]" in out  # the model's words are not read as markup
    assert "call 1 left out: the Jinja template of naive" in out and "2 calls, 12,385 prompt" in out


def test_diff_shows_a_patch_and_wraps_long_lines(tmp_path):
    store, plain, patched = store_with_a_patch(tmp_path / "r")
    out = text(diff_view(store, plain.id, patched.id), width=100)
    assert "llm-patch" in out and "patch of B" in out and "(1 edit of its base's Jinja template)" in out
    assert "-float acc = 0.0f;" in out and "@@ edit 1 of 1 @@" in out and "rendered sources:" in out
    assert out.count("the end of a long line") == 2  # wrapped, not cut at the console's width
    assert "patch of A" not in out


def test_a_store_from_before_patches_and_model_calls_opens(tmp_path):
    store, plain, patched = store_with_a_patch(tmp_path / "r")
    store.db.execute("DROP TABLE model_calls")
    store.db.execute("ALTER TABLE candidates DROP COLUMN patch")
    store.close()
    again = RunStore(tmp_path / "r")
    assert again.candidate(plain.id) == plain and again.candidate(patched.id).patch is None
    assert again.model_calls() == []
    again.add_model_call(ModelCall(P.key, "propose", 1, 2))
    assert again.model_calls() == [ModelCall(P.key, "propose", 1, 2)]
    assert RunStore(tmp_path / "r").candidate(patched.id).template_override == "patched template"


def test_show_says_what_serves_each_bucket_of_m(tmp_path):
    from agent import buckets
    from agent.report import show_run
    from tests.helpers import m_dependent_evaluate, populated_run

    problems = buckets.plan([Problem(24, 256, 512, "nk", m_range=(9, 32))])
    store = populated_run(tmp_path / "r", problems=tuple(problems), n=3, evaluate=m_dependent_evaluate)
    out = " ".join(text(show_run(store)).split())  # the long lines wrapped
    assert "bucket 9-16_256_512 nk: cuBLAS (no leader at least as fast as cuBLAS at two neighbouring probe M)" in out
    for b in problems[1:]:
        assert f"bucket {b.mnk} nk: kernel {buckets.served(store, b).note(b)}" in out
    assert "; serves M 21-24, cuBLAS the rest" in out


def test_a_store_from_before_ranges_of_m_opens_and_keeps_buckets_apart(tmp_path):
    store, plain, _ = store_with_a_patch(tmp_path / "r")
    store.db.execute("ALTER TABLE problems DROP COLUMN m_lo")
    store.db.execute("ALTER TABLE problems DROP COLUMN m_hi")
    store.db.execute("DROP TABLE bucket_ends")
    store.close()
    again = RunStore(tmp_path / "r")
    assert again.problems() == [P] and again.candidate(plain.id) == plain
    bucket = Problem(128, 128, 128, m_range=(97, 128))
    again.add_problems([bucket])
    assert again.problems() == [P, bucket] and again.bucket_ends(bucket) == {}


def test_show_says_where_the_fastest_candidates_are_alike_and_all_slower_than_the_baseline(tmp_path):
    from agent.report import alike_lines, show_run

    cublas = Timing(9.0, 8.9, 9.1, 100)

    def store_with(folder, problem, times):
        store = RunStore(folder, create=True)
        store.add_problems([problem])
        for i, us in enumerate(times):
            c = Candidate(problem, "naive", {"block_x": 16, "block_y": 8 * (i + 1)})
            store.add_candidate(c)
            store.add_build(BuildResult(c.id, True, "sm_90a", "int a;\n"))
            result = EvalResult(c.id, Status.OK, warm=Timing(us, us, us, 100), cublas_warm=cublas)
            store.add_result(result)
            store.add_measurement(result)
        return store

    fused = Problem(2048, 2048, 2048, "nk", "bf16", False, "residual")
    store = store_with(tmp_path / "a", fused, (10.0, 10.1, 10.2, 14.0))
    out = " ".join(text(show_run(store)).split())
    assert f"alike {fused.key}: its 3 fastest candidates ran within 2.0% of each other" in out
    assert "all slower than cuBLAS + add (0.900x)" in out  # the baseline the epilogue is timed against
    plain = text(alike_lines(store_with(tmp_path / "b", P, (10.0, 10.0, 10.1)))[0])
    assert plain.startswith(f"alike {P.key}: its 3 fastest") and "all slower than cuBLAS (0.900x)" in plain
    assert alike_lines(store_with(tmp_path / "c", P, (10.0, 10.5, 11.0))) == []  # the settings differ: the tile
    assert alike_lines(store_with(tmp_path / "d", P, (8.0, 8.1, 8.1))) == []  # ahead of the baseline
    assert alike_lines(store_with(tmp_path / "e", P, (10.0, 10.0))) == []  # too few to say
