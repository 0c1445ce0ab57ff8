"""The search loop: every outcome recorded, failures as data, budgets, resume without redoing work."""

from __future__ import annotations

import pytest

from agent.config import RunConfig
from agent.loop import SearchLoop
from agent.proposers.builtin import BuiltinProposer, RandomProposer
from agent.store import RunStore
from core.records import Candidate, Problem, Status
from core.source import NO_FILES
from templates import get_family
from tests.helpers import fake_evaluate, populated_run

P = Problem(1000, 3000, 2000)
ENTRY = 'extern "C" __global__ void hgemm(const unsigned short* A, const unsigned short* B, unsigned short* C, ' \
        "int M, int N, int K)"


def test_loop_records_every_candidate_and_picks_the_fastest(tmp_path):
    store = populated_run(tmp_path / "r", problems=(P,), n=8)
    results = store.results(P)
    assert len(results) == 8 == len({c.id for c, _ in results})
    assert all(store.build(c.id).ok for c, _ in results)
    ok = [(c, r) for c, r in results if r.status is Status.OK]
    best = store.winner(P)
    assert best is not None and best.result.time_us == min(r.time_us for _, r in ok)
    assert best.speedup == max(store.median_speedup(c.id) for c, _ in ok)


def test_failures_are_data(tmp_path):
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    loop = SearchLoop(store, RunConfig(), BuiltinProposer(), "sm_90a", fake_evaluate)
    bad_params = loop.process(Candidate(P, "sm80_mma", {"block_m": 128, "warps_m": 3}))
    assert bad_params[1].status is Status.INVALID and "warps_m" in bad_params[1].reason
    bad_source = loop.process(Candidate(P, "sm80_mma", {}, template_override=ENTRY + "{ not CUDA {{ block_m }} }"))
    assert bad_source[1].status is Status.COMPILE_ERROR and bad_source[0].log
    bad_jinja = loop.process(Candidate(P, "sm80_mma", {}, template_override="{{ nope }}"))
    assert bad_jinja[1].status is Status.INVALID and "nope" in bad_jinja[1].reason
    assert store.failure_counts(P) == {"invalid": 2, "compile_error": 1}


NAIVE = get_family("naive").template_source()


@pytest.mark.parametrize("template, reason", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}" + NAIVE, "SecurityError"),
    ('#include "/etc/passwd"\n' + NAIVE, NO_FILES),
    ('%:/**/include "/root/.ssh/id_rsa"\n' + NAIVE, NO_FILES),
    ('#inc\\\nlude "/etc/shadow"\n' + NAIVE, NO_FILES),
    ('#if __has_include("/etc/hosts")\n#endif\n' + NAIVE, NO_FILES),
    ("__global__ void other() {}", 'extern "C"'),
])
def test_an_edited_template_is_rendered_once_in_the_loop_and_refused_there(tmp_path, template, reason):
    """Edits reach Python only through Jinja's sandbox, and a source that would read host files never compiles."""
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    loop = SearchLoop(store, RunConfig(), BuiltinProposer(), "sm_90a", fake_evaluate)
    build, result = loop.process(Candidate(P, "naive", {}, template_override=template))
    assert build is None and result.status is Status.INVALID and reason in result.reason


def test_compile_only_skips_evaluation(tmp_path):
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    SearchLoop(store, RunConfig(max_candidates=3), BuiltinProposer(), "sm_80", None).run([P])
    assert store.failure_counts(P) == {"skipped": 3}
    assert all(store.build(c.id).arch == "sm_80" for c in store.candidates(P))


def test_resume_after_interrupt_redoes_nothing(tmp_path):
    calls = []

    def flaky(job):
        calls.append(job.candidate_id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return fake_evaluate(job)

    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    with pytest.raises(KeyboardInterrupt):
        SearchLoop(store, RunConfig(max_candidates=6), BuiltinProposer(), "sm_90a", flaky).run([P])
    assert len(store.results(P)) == 2
    store.close()

    resumed = RunStore(tmp_path / "r")
    again = []
    SearchLoop(resumed, RunConfig(max_candidates=6), BuiltinProposer(), "sm_90a",
               lambda j: again.append(j.candidate_id) or fake_evaluate(j)).run([P])
    assert len(resumed.results(P)) == 6
    searched = again[:4]  # what follows is the re-measurement of the leaders
    assert not set(calls[:2]) & set(searched)  # recorded work is not redone
    assert calls[2] in searched  # the candidate in flight is


def test_budget_stops_the_search(tmp_path):
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    SearchLoop(store, RunConfig(budget_minutes=1e-9, max_candidates=50), BuiltinProposer(), "sm_90a",
               fake_evaluate).run([P])
    assert len(store.results(P)) <= 1


def test_remeasure_records_extra_measurements(tmp_path):
    store = populated_run(tmp_path / "r", problems=(P,), n=6)
    best = store.winner(P).candidate
    assert len(store.speedups(best.id)) >= 2  # measured, then re-measured by successive halving


def test_random_proposer_draws_from_the_same_space(tmp_path):
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    SearchLoop(store, RunConfig(max_candidates=5), RandomProposer(seed=3), "sm_90a", fake_evaluate).run([P])
    assert {c.origin for c in store.candidates(P)} == {"random"}
