"""agent.buckets: the ladder that splits a range of M, the representative M, merging ranges, the seeded budget,
and which kernel serves which M of a bucket (at least as fast as cuBLAS at neighbouring probe M); the loop's bucket
flow is in tests/test_loop.py."""

from __future__ import annotations

import pytest

from agent import buckets
from agent.store import RunStore
from core.records import BuildResult, Candidate, EvalResult, Problem, Status, Timing


def test_the_ladder_up_to_512_then_steps_of_at_most_one_and_a_half():
    assert buckets.split(1, 512) == [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 24), (25, 32), (33, 48), (49, 64),
                                     (65, 96), (97, 128), (129, 160), (161, 192), (193, 256), (257, 320), (321, 384),
                                     (385, 448), (449, 512)]
    tops = [hi for _, hi in buckets.split(513, 100_000)]
    assert tops[:5] == [768, 1152, 1728, 2560, 3840] and tops[-1] == 100_000
    for a, b in zip([512] + tops[:-2], tops[:-1], strict=True):
        assert b <= 1.5 * a and b % 64 == 0
    assert buckets.split(100, 130) == [(100, 128), (129, 130)]  # a range's own ends cut its outer buckets
    assert buckets.split(7, 7) == [(7, 7)]


@pytest.mark.parametrize("lo, hi", [(1, 4096), (3, 3), (100, 4000), (511, 70_000)])
def test_buckets_cover_the_range_once_each_representative_inside(lo, hi):
    parts = buckets.split(lo, hi)
    assert parts[0][0] == lo and parts[-1][1] == hi
    assert all(b[0] == a[1] + 1 for a, b in zip(parts, parts[1:], strict=False))
    assert all(a <= buckets.representative(a, b) <= b for a, b in parts)


def test_plan_merges_ranges_of_a_series_and_keeps_single_m_problems():
    nk = Problem(1, 4096, 4096, "nk")
    problems = [Problem(30, 4096, 4096, "nk", m_range=(1, 48)), Problem(20, 4096, 4096, "nk"),
                Problem(60, 4096, 4096, "nk", m_range=(40, 64)), Problem(70, 4096, 4096, "nk", m_range=(65, 100)),
                Problem(6, 4096, 4096, "kn", m_range=(5, 8)), Problem(20, 4096, 4096, "nk")]
    planned = buckets.plan(problems)
    assert [p.key for p in planned] == [f"{lo}-{hi}_4096_4096:nk:f16" for lo, hi in buckets.split(1, 100)] + [
        "20_4096_4096:nk:f16", "5-8_4096_4096:kn:f16"]
    assert all(buckets.series(p) == nk for p in planned[:-1])
    assert planned[4] == Problem(13, 4096, 4096, "nk", m_range=(9, 16))


def test_a_seeded_bucket_gets_a_smaller_budget():
    assert buckets.budget(16, seeded=False) == 16 and buckets.budget(16, seeded=True) == 5
    assert buckets.budget(40, seeded=True) == 10 and buckets.budget(3, seeded=True) == 3


def ok(cid: str, ratio: float) -> EvalResult:
    return EvalResult(cid, Status.OK, warm=Timing(30 / ratio, 1, 1, 1), cublas_warm=Timing(30.0, 1, 1, 1))


def store_with(tmp_path, bucket: Problem, ratios: dict[str, float]) -> tuple[RunStore, list[Candidate]]:
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([bucket])
    cands = [Candidate(bucket, "sm80_mma", {"block_m": 64 * (i + 1)}) for i in range(len(ratios))]
    for c, (name, ratio) in zip(cands, ratios.items(), strict=True):
        store.add_candidate(c)
        store.add_build(BuildResult(c.id, True, "sm_90a", "source", cubin=b"cubin " + name.encode()))
        store.add_result(ok(c.id, ratio))
        store.add_measurement(ok(c.id, ratio))
    return store, cands


def test_probe_m_are_a_buckets_ends_and_quarters():
    assert buckets.probe_ms(Problem(21, 256, 512, "nk", m_range=(17, 24))) == [17, 19, 21, 22, 24]
    assert buckets.probe_ms(Problem(177, 256, 512, "nk", m_range=(161, 192))) == [161, 169, 177, 184, 192]
    assert buckets.probe_ms(Problem(4, 256, 512, "nk", m_range=(3, 4))) == [3, 4]
    assert buckets.probe_ms(Problem(1, 256, 512, "nk", m_range=(1, 1))) == [1]


def test_spans_are_the_stretches_between_neighbouring_probes_that_both_pass():
    b = Problem(177, 256, 512, "nk", m_range=(161, 192))
    at = lambda *ratios: {m: ok("c", r) for m, r in zip(buckets.probe_ms(b), ratios, strict=True)}  # noqa: E731
    assert buckets.spans(b, at(1.1, 1.0, 1.2, 1.1, 1.3)) == [(161, 192)]
    assert buckets.spans(b, at(1.1, 1.0, 1.2, 0.9, 1.3)) == [(161, 177)]  # cuBLAS faster at 184: 178-192 theirs
    assert buckets.spans(b, at(0.9, 1.1, 1.2, 0.9, 1.3)) == [(169, 177)]
    assert buckets.spans(b, at(1.1, 0.9, 1.2, 0.9, 1.3)) == []  # no two neighbours pass
    wrong = at(1.1, 1.1, 1.2, 1.1, 1.3) | {184: EvalResult("c", Status.WRONG, "wrong at M=184")}
    assert buckets.spans(b, wrong) == []  # wrong at one M: trusted at none
    ends_only = {161: ok("c", 1.1), 192: ok("c", 1.05)}  # a run from before interior probes
    assert buckets.spans(b, ends_only) == [(161, 192)] and buckets.spans(b, {161: ok("c", 1.1)}) == []


def test_served_is_the_leader_as_fast_as_cublas_at_every_probe(tmp_path):
    b = Problem(21, 256, 512, "nk", m_range=(17, 24))
    store, (first, second) = store_with(tmp_path, b, {"first": 1.4, "second": 1.2})
    assert buckets.served(store, b) is None  # not re-timed at its probe M yet
    checks = buckets.EndChecks(store, b, timeout_s=5.0)
    jobs = checks.next_jobs()
    assert {j.cubin for j in jobs} == {b"cubin first"} and {(j.timeout_s, j.honest) for j in jobs} == {(5.0, True)}
    assert [(j.candidate_id, j.problem) for j in jobs] == [(first.id, Problem(m, 256, 512, "nk"))
                                                           for m in (17, 19, 21, 22, 24)]
    for j, ratio in zip(jobs, (1.3, 1.2, 1.1, 1.05, 0.97), strict=True):  # slower than cuBLAS at M = 24
        checks.record(j, ok(first.id, ratio))
    jobs = checks.next_jobs()
    assert {j.candidate_id for j in jobs} == {second.id}
    for j in jobs:
        checks.record(j, ok(second.id, 1.0))
    assert checks.next_jobs() == [] and checks.verdict == second
    served = buckets.served(store, b)
    assert served.candidate == second and served.ends[17].speedup == 1.0 and served.pieces == ((17, 24),)
    assert served.note(b) == (f"1.200x at M=21, 1.000x at M=17, 1.000x at M=19, 1.000x at M=21, 1.000x at M=22, "
                              f"1.000x at M=24 ({second.id})")
    assert buckets.EndChecks(store, b, 5.0).next_jobs() == []  # a resumed run times nothing again
    assert [e[2] for e in store.events() if e[1] == "bucket"] == [
        f"{b.key}: {first.id} slower than cuBLAS or failed at a probe M (would serve M 17-22)",
        f"{b.key}: {second.id} at least as fast as cuBLAS at every probe M",
        f"{b.key}: {first.id} slower than cuBLAS or failed at a probe M (would serve M 17-22)",
        f"{b.key}: {second.id} at least as fast as cuBLAS at every probe M"]


def test_where_no_leader_serves_all_of_a_bucket_the_one_serving_most_serves_its_share(tmp_path):
    b = Problem(177, 256, 512, "nk", m_range=(161, 192))
    store, (first, second) = store_with(tmp_path, b, {"first": 1.4, "second": 1.2})
    checks = buckets.EndChecks(store, b, timeout_s=5.0)
    for cid, ratios in ((first.id, (0.9, 1.1, 1.1, 1.1, 1.1)), (second.id, (1.1, 1.1, 1.1, 0.95, 1.2))):
        jobs = checks.next_jobs()
        for j, ratio in zip(jobs, ratios, strict=True):
            checks.record(j, ok(cid, ratio))
    assert checks.next_jobs() == [] and checks.verdict is None
    served = buckets.served(store, b)  # first serves 169-192 (24 rows), second 161-177 (17)
    assert served.candidate == first and served.pieces == ((169, 192),)
    assert served.serves(169) and served.serves(192) and not served.serves(168)
    assert buckets.serving(store, b, 169) == served and buckets.serving(store, b, 168) is None
    assert served.note(b).endswith("; serves M 169-192, cuBLAS the rest")


def test_a_bucket_whose_leaders_fail_at_an_end_goes_to_cublas(tmp_path):
    b = Problem(1, 256, 512, "nk", m_range=(1, 1))
    store, (first, second, third) = store_with(tmp_path, b, {"a": 1.5, "b": 1.4, "c": 1.3})
    checks = buckets.EndChecks(store, b, 5.0)
    for cid in (first.id, second.id):
        (job,) = checks.next_jobs()  # a bucket of one M has one end
        assert job.candidate_id == cid and job.problem == Problem(1, 256, 512, "nk")
        checks.record(job, EvalResult(cid, Status.WRONG, "wrong result at M=1"))
    assert checks.next_jobs() == [] and checks.verdict is None  # END_TRIES leaders, then cuBLAS
    assert buckets.served(store, b) is None and third.id not in store.bucket_ends(b)


def test_seeds_come_from_the_nearest_searched_bucket_of_the_series(tmp_path):
    near, far = Problem(21, 256, 512, "nk", m_range=(17, 24)), Problem(5, 256, 512, "nk", m_range=(3, 8))
    other = Problem(29, 256, 512, "kn", m_range=(25, 32))
    store = RunStore(tmp_path / "r", create=True)
    target = Problem(29, 256, 512, "nk", m_range=(25, 32))
    store.add_problems([far, near, other, target])
    for i, p in enumerate((far, near, other)):
        for j in range(4):
            c = Candidate(p, "sm80_mma", {"block_m": 64, "stages": 2 + j, "tag": i})
            store.add_candidate(c)
            store.add_result(ok(c.id, 1.0 + j / 10))
            store.add_measurement(ok(c.id, 1.0 + j / 10))
    seeds = buckets.seeds(store, target)
    assert [c.params["stages"] for c in seeds] == [5, 4, 3] and {c.params["tag"] for c in seeds} == {1}
    assert all(c.problem == target and "17-24_256_512" in c.rationale for c in seeds)
    assert buckets.seeds(store, Problem(29, 256, 512, "nk")) == []  # a problem of one M has no neighbours
    assert buckets.covering(store, Problem(20, 256, 512, "nk")) == near
    assert buckets.covering(store, Problem(20, 256, 512, "kn")) is None
