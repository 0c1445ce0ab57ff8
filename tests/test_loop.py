"""The search loop: every outcome recorded, failures as data, budgets, resume without redoing work."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import pytest

from agent import buckets
from agent.config import RunConfig
from agent.events import BucketEndTimed, CandidateDone, Remeasured
from agent.loop import SearchLoop
from agent.proposers.builtin import BuiltinProposer, RandomProposer
from agent.store import RunStore
from core.records import BuildResult, Candidate, EvalJob, Problem, Status
from core.source import NO_FILES
from sandbox.build_pool import BuildPool
from sandbox.executor import CompileOnly
from sandbox.pool import WorkerPool
from templates import get_family
from tests import fake_workers
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
    SearchLoop(store, RunConfig(max_candidates=3), BuiltinProposer(), "sm_80", CompileOnly()).run([P])
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


def test_shapes_are_searched_cheapest_first_and_reported_in_their_order(tmp_path):
    big, small = Problem(4096, 4096, 4096), Problem(64, 64, 64)
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([big, small])
    summaries = SearchLoop(store, RunConfig(max_candidates=2), BuiltinProposer(), "sm_90a",
                           fake_evaluate).run([big, small])
    assert [s.problem for s in summaries] == [big, small]
    seqs = {p: [seq for (seq,) in store.db.execute("SELECT seq FROM candidates WHERE problem_key = ?", (p.key,))]
            for p in (big, small)}
    assert seqs[small] and seqs[big] and max(seqs[small]) < min(seqs[big])


@pytest.mark.parametrize("wall_s, most", [(0.001, 10), (2.0, 5)])
def test_a_shape_keeps_room_in_its_budget_for_its_re_measurement(tmp_path, wall_s, most):
    """Evaluations that take 2 s each (as the worker reports): in a 12 s share, re-measuring 4 leaders takes 6
    evaluations (12 s), so the shape stops proposing after 4-5 candidates instead of overrunning its share."""
    def slow(job):
        return dataclasses.replace(fake_evaluate(job), wall_s=wall_s)

    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    SearchLoop(store, RunConfig(budget_minutes=0.2, max_candidates=10), BuiltinProposer(), "sm_90a", slow).run([P])
    tried = len(store.results(P))
    assert 2 <= tried <= most and (wall_s > 1 or tried == most)
    spent = [m for _, kind, m in store.events() if kind == "budget"]  # a shape cut short by time says so
    assert spent == ([f"{P.key}: time share spent after {tried} candidates (0 in flight); 12.0 s kept for "
                      "re-measurement"] if wall_s > 1 else [])


def test_remeasure_records_extra_measurements(tmp_path):
    store = populated_run(tmp_path / "r", problems=(P,), n=6)
    best = store.winner(P).candidate
    assert len(store.speedups(best.id)) >= 2  # measured, then re-measured by successive halving


def test_leaders_are_remeasured_on_the_honest_figure_alone(tmp_path):
    """The first screen times warm and cold; a re-measurement the honest figure alone (what ranks past the screen),
    and the candidate's warm and cold figures stay the first screen's."""
    jobs = []

    def spy(job):
        jobs.append(job)
        return fake_evaluate(job)

    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    SearchLoop(store, RunConfig(max_candidates=6), BuiltinProposer(), "sm_90a", spy).run([P])
    again = [j for j in jobs if j.honest]
    assert again and all(j.honest_only for j in again) and not any(j.honest or j.honest_only for j in jobs[:6])
    best = store.winner(P).candidate
    honest = next(fake_evaluate(j) for j in again if j.candidate_id == best.id)
    assert store.result(best.id).warm is not None  # the first screen's
    assert store.speedups(best.id) == pytest.approx([31.0 / honest.honest.median_us] * len(store.speedups(best.id)))


def test_random_proposer_draws_from_the_same_space(tmp_path):
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    SearchLoop(store, RunConfig(max_candidates=5), RandomProposer(seed=3), "sm_90a", fake_evaluate).run([P])
    assert {c.origin for c in store.candidates(P)} == {"random"}


# several GPUs: the same records, every GPU busy, never two jobs on one

Q = Problem(64, 64, 64, "nk")


def search(folder, executor, problems=(P, Q), n=6, observer=None, **kw):
    store = RunStore(folder, create=True)
    store.add_problems(list(problems))
    SearchLoop(store, RunConfig(max_candidates=n), BuiltinProposer(), "sm_90a", executor, observer, **kw).run(
        list(problems))
    return store


def recorded(store, p):
    return [(c.id, r.status, r.time_us, len(store.speedups(c.id))) for c, r in store.results(p)]


def test_one_gpu_worker_records_what_a_plain_evaluate_does(tmp_path):
    inline = search(tmp_path / "inline", fake_evaluate)
    with WorkerPool((0,), target=fake_workers.timed_like_fake_evaluate) as pool:
        pool.start()
        pooled = search(tmp_path / "pool", pool)
    for p in (P, Q):
        assert recorded(inline, p) == recorded(pooled, p)
        assert inline.winner(p).candidate.id == pooled.winner(p).candidate.id


def test_two_gpus_stay_busy_and_every_candidate_is_recorded_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SLEEP", "0.05")
    events = []
    with WorkerPool((0, 1), target=fake_workers.timed_like_fake_evaluate) as pool:
        pool.start()
        store = search(tmp_path / "r", pool, n=8, builder=BuildPool(2),
                       observer=lambda e: events.append((type(e), getattr(e, "problem", None))))
    runs = {0: [], 1: []}
    for p in (P, Q):
        results = store.results(p)
        assert len(results) == len(store.candidates(p)) == len({c.id for c, _ in results}) == 8
        for c, r in results:  # each result is its own candidate's (no mix-up between jobs in flight)
            job = EvalJob(c.id, p, c.family, c.params, b"")
            assert r.status is Status.OK and r.time_us == fake_evaluate(job).time_us
            runs[r.device["index"]].append((r.device["t0"], r.device["t1"]))
        assert len(store.speedups(store.winner(p).candidate.id)) >= 2  # re-measured honestly twice: what ranks
    for gpu in runs.values():  # never two jobs on one GPU
        gpu.sort()
        assert gpu and all(a[1] <= b[0] for a, b in zip(gpu, gpu[1:], strict=False))
    assert any(a[0] < b[1] and b[0] < a[1] for a in runs[0] for b in runs[1])  # both GPUs at once
    # the next shape's candidates take idle GPUs while the previous shape is re-measured
    assert events.index((CandidateDone, Q)) < max(i for i, e in enumerate(events) if e == (Remeasured, P))


def test_a_worker_that_dies_mid_run_costs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DIE_ONCE", str(tmp_path / "died"))
    with WorkerPool((0, 1), target=fake_workers.timed_like_fake_evaluate) as pool:
        pool.start()
        store = search(tmp_path / "r", pool)
        assert pool.describe()["retried"] == 1
    assert (tmp_path / "died").exists()
    for p in (P, Q):
        assert len(store.results(p)) == 6 and store.failure_counts(p) == {"ok": 6}


def test_resume_after_an_interrupt_with_several_in_flight(tmp_path, monkeypatch):
    # each job takes a while, so that the loop has refilled the workers before the fourth result comes back (with
    # instant jobs, a loaded machine could hand it the second to fourth results at once, nothing else in flight)
    monkeypatch.setenv("FAKE_SLEEP", "0.1")

    def stop_at_the_fourth(event):
        if isinstance(event, CandidateDone) and len(store.results(P)) == 4:
            raise KeyboardInterrupt

    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    with WorkerPool((0, 1), target=fake_workers.timed_like_fake_evaluate) as pool:
        pool.start()
        with pytest.raises(KeyboardInterrupt):
            SearchLoop(store, RunConfig(max_candidates=8), BuiltinProposer(), "sm_90a", pool,
                       stop_at_the_fourth).run([P])
    done = {c.id for c, _ in store.results(P)}
    assert len(done) == 4 and len(store.candidates(P)) > 4  # some were in flight
    again = []
    SearchLoop(store, RunConfig(max_candidates=8), BuiltinProposer(), "sm_90a",
               lambda j: again.append(j.candidate_id) or fake_evaluate(j)).run([P])
    assert len(store.results(P)) == 8 and not done & set(again[:4])


# compiling ahead: the proposer's likely next candidates built while the GPU evaluates

class CountingBuilds(BuildPool):
    """Compiles in the caller's thread (processes=0), counting what it was asked to build; `fail`: every build
    fails as a compiler process that died would."""

    def __init__(self, fail: bool = False):
        super().__init__(0)
        self.ids: list[str] = []
        self.fail = fail

    def submit(self, source, arch, candidate_id, timeout_s):
        self.ids.append(candidate_id)
        if self.fail:
            out = Future()
            out.set_result(BuildResult(candidate_id, False, arch, source, error="the compiler process died"))
            return out
        return super().submit(source, arch, candidate_id, timeout_s)


def test_compiling_ahead_changes_nothing_recorded_and_spares_the_inline_compiles(tmp_path):
    plain = search(tmp_path / "plain", fake_evaluate, n=8)
    inline, ahead = CountingBuilds(), CountingBuilds()
    fast = search(tmp_path / "ahead", fake_evaluate, n=8, builder=inline, ahead=ahead)
    for p in (P, Q):
        assert recorded(plain, p) == recorded(fast, p)
    tried = {c.id for p in (P, Q) for c in fast.candidates(p)}
    # the first shape's first candidate, before anything was ahead; the second shape's first settings compiled
    # ahead while the first shape's re-measurement ran
    assert len(tried) == 16 and len(inline.ids) <= 1
    assert tried - set(inline.ids) <= set(ahead.ids)
    # a build ahead that failed is compiled again in line, and the candidate is recorded as if nothing happened
    inline = CountingBuilds()
    again = search(tmp_path / "failed", fake_evaluate, n=8, builder=inline, ahead=CountingBuilds(fail=True))
    for p in (P, Q):
        assert recorded(plain, p) == recorded(again, p)
    assert len(inline.ids) == 16


def test_compile_only_runs_compile_nothing_ahead(tmp_path):
    ahead = CountingBuilds()
    search(tmp_path / "r", CompileOnly(), n=3, ahead=ahead)
    assert ahead.ids == []


def test_a_range_is_searched_in_buckets_seeded_by_neighbours_and_timed_at_their_probe_m(tmp_path):
    """Buckets of 1-48 through a fake GPU worker whose kernels beat cuBLAS only from M = 20 up: the first bucket
    gets the full budget, each later one its neighbour's leaders first and a smaller budget; each bucket's winner
    is re-timed at its probe M (ends and quarters), and a kernel serves a bucket's M only between probe M where it
    was at least as fast as cuBLAS."""
    problems = buckets.plan([Problem(24, 256, 512, "nk", m_range=(1, 48))])
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems(problems)
    config = RunConfig(max_candidates=8, profile=False)
    ends = []
    with WorkerPool((0,), target=fake_workers.m_dependent_worker) as pool:
        pool.start()
        SearchLoop(store, config, BuiltinProposer(), "sm_90a", pool,
                   lambda e: ends.append((e.problem.key, e.m)) if isinstance(e, BucketEndTimed) else None
                   ).run(problems)
    tried = [len(store.results(p)) for p in problems]
    assert [p.mnk for p in problems] == ["1-1_256_512", "2-2_256_512", "3-4_256_512", "5-8_256_512", "9-16_256_512",
                                         "17-24_256_512", "25-32_256_512", "33-48_256_512"]
    assert tried == [8] + [5] * 7  # 43 candidates, not 8 x 8
    for before, p in zip(problems, problems[1:], strict=False):  # each starts from the bucket searched before it
        firsts = store.candidates(p)[:3]
        assert all("leader of the neighbouring bucket" in c.rationale for c in firsts)
        assert [c.params for c in firsts] == [c.params for c, _ in store.leaders(before)[:3]]
    for p in problems:  # the winner, and where it fails at a probe the next leader, re-timed at its probe M
        timed = store.bucket_ends(p)
        probes = buckets.probe_ms(p)
        assert set(timed[store.winner(p).candidate.id]) == set(probes) and len(timed) <= buckets.END_TRIES
        assert {(p.key, m) for m in probes} <= set(ends) and set(p.m_span) <= set(probes)
    served = {p.mnk: buckets.served(store, p) for p in problems}
    assert [k for k, v in served.items() if v] == ["17-24_256_512", "25-32_256_512", "33-48_256_512"]
    assert served["17-24_256_512"].pieces == ((21, 24),)  # slow at its probes 17 and 19
    assert all(s.pieces == (tuple(p.m_span),) for p in problems[6:] if (s := served[p.mnk]))
    assert all(min(r.speedup for m, r in s.ends.items() if s.serves(m)) >= 1.0 for s in served.values() if s)


def test_a_bucket_keeps_room_in_its_budget_for_its_probe_timings(tmp_path):
    """The same 2 s evaluations in a 12 s share: a bucket of M also times its winner at its five probe M, so it stops
    proposing after 2 candidates where a shape of one M goes on to 4 (fewer each where builds take real time)."""
    def slow(job):
        return dataclasses.replace(fake_evaluate(job), wall_s=2.0)

    tried = {}
    for p in (P, dataclasses.replace(P, m_range=(P.m - 8, P.m + 8))):
        store = RunStore(tmp_path / p.key.replace(":", "_"), create=True)
        store.add_problems([p])
        SearchLoop(store, RunConfig(budget_minutes=0.2, max_candidates=10), BuiltinProposer(), "sm_90a",
                   slow).run([p])
        tried[p.m_range] = len(store.results(p))
        spent = [m for _, kind, m in store.events() if kind == "budget"]
    bucket = tried[(P.m - 8, P.m + 8)]
    assert 1 <= bucket <= 2 < tried[None] <= 4
    [cut] = spent
    assert cut.startswith(f"{p.key}: time share spent after {bucket} candidates (0 in flight); ")
    assert cut.endswith(f"{16.0 if bucket == 2 else 10.0} s kept for re-measurement and probe timings")


def test_each_shape_of_a_run_gets_a_bandit_seeded_for_it(tmp_path):
    loop = SearchLoop(RunStore(tmp_path / "r", create=True), RunConfig(seed=3), BuiltinProposer(), "sm_90a",
                      fake_evaluate)
    a, b = (loop.restore(Problem(m, 4096, 4096, "nk")) for m in (1, 8))
    draws = [[s.bandit.rng.random() for _ in range(4)] for s in (a, b)]
    assert draws[0] != draws[1]
    again = loop.restore(Problem(1, 4096, 4096, "nk"))
    assert [again.bandit.rng.random() for _ in range(4)] == draws[0]
