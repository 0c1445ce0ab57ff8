"""Search/replace patches: applied in order as plain text, or refused with a short, precise reason; bases resolved
among the edited candidates tried for the problem."""

from __future__ import annotations

import pytest

from agent.bandit import ThompsonBandit
from agent.proposers.base import SearchState
from agent.proposers.patch import PatchError, apply_patch, find_base, patch_text, template_changes
from core.records import Candidate, EvalResult, Patch, Problem, Status, TextEdit

P = Problem(128, 128, 128)
TEXT = "int a = 1;\nint b = 2;\nreturn a;\nreturn a;\n"


def edits(*pairs: tuple[str, str]) -> tuple[TextEdit, ...]:
    return tuple(TextEdit(s, r) for s, r in pairs)


def test_edits_apply_in_order_each_to_the_text_the_previous_left():
    out = apply_patch(TEXT, edits(("int a = 1;", "int a = 3;"), ("a = 3;\nint b", "a = 3;\nconst int b")))
    assert out == "int a = 3;\nconst int b = 2;\nreturn a;\nreturn a;\n"


@pytest.mark.parametrize("patch, reason", [
    ((), "the patch has no edits"),
    (edits(("", "x")), "edit 1: the search text is empty"),
    (edits(("int a", "int c"), ("return a;", "return c;")), "edit 2: search text occurs 2 times: add context"),
    (edits(("int z", "x")), "edit 1: search text not found (copy it from the template exactly)"),
    (edits(("int a = 1;", "int c = 1;"), ("int a = 1;", "x")), "edit 2: search text not found (an earlier edit"),
    (edits(("int  a =\n1;", "x")), "matches only if whitespace is ignored"),
    (edits(("int a = 1;", "int a = 1;")), "the edits change nothing"),
    (edits(("aa", "b")), "edit 1: search text occurs 2 times"),  # overlapping places count: 'aa' in 'aaa'
])
def test_bad_patches_are_refused_with_the_reason(patch, reason):
    text = "aaa\n" if patch and patch[0].search == "aa" else TEXT
    with pytest.raises(PatchError) as e:
        apply_patch(text, patch)
    assert reason in str(e.value)


def state_with(*cands: Candidate) -> SearchState:
    state = SearchState(P, "sm_90a", ThompsonBandit())
    state.tried += [(c, None, EvalResult(c.id, Status.SKIPPED)) for c in cands]
    return state


def test_a_base_names_an_edited_candidate_of_the_search_by_id_or_unique_prefix():
    edited = [Candidate(P, "naive", {"block_x": 16, "block_y": 16}, "llm-edit", template_override=f"edited {i}")
              for i in range(17)]  # 17 ids: two of them share a first hex digit
    plain = Candidate(P, "naive", {"block_x": 32, "block_y": 8}, "builtin")
    other = Candidate(P, "sm80_mma", {}, "llm-edit", template_override="other")
    state = state_with(*edited, plain, other)
    assert all(find_base(ref, "naive", state) is None for ref in (None, "", "naive"))  # the family's template
    assert find_base(edited[0].id[:8], "naive", state) == edited[0]
    shared = next(c.id[0] for c in edited if sum(d.id.startswith(c.id[0]) for d in edited) > 1)
    for ref, reason in ((plain.id, "uses the family's own template"), (other.id, "is a sm80_mma candidate"),
                        ("ffffffffffff", "no candidate tried for this problem"), (shared, "is ambiguous")):
        with pytest.raises(PatchError, match=reason):
            find_base(ref, "naive", state)


def test_changes_and_patches_read_as_diffs_cut_where_they_say():
    changes = template_changes(TEXT, TEXT.replace("int b = 2;", "int b = 5;"), 1000)
    assert "-int b = 2;\n+int b = 5;\n" in changes and changes.startswith("--- family template")
    cut = template_changes(TEXT * 50, (TEXT * 50).replace("return", "yield"), 300)
    assert len(cut) < 400 and "[diff cut here:" in cut
    shown = patch_text(Patch("naive", edits(("a\nb", "c"))))
    assert shown == "# base: naive\n@@ edit 1 of 1 @@\n-a\n-b\n+c\n"
