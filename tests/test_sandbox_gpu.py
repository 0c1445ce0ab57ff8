"""The sandbox on a real GPU: correct kernels pass on random shapes, timing agrees with CUPTI and with itself."""

from __future__ import annotations

import random

import pytest

from core.records import Candidate, EvalJob, Problem, Status
from sandbox.build import compile_cuda
from templates import get_family

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pool():
    from sandbox.pool import WorkerPool

    with WorkerPool() as p:
        p.start()
        yield p


def build_job(family: str, params: dict, problem: Problem, time_it: bool = True) -> EvalJob:
    fam = get_family(family)
    cand = Candidate(problem, family, params)
    b = compile_cuda(fam.render(params, problem), "sm_90a", candidate_id=cand.id)
    assert b.ok, b.log
    return EvalJob.built(cand.id, problem, family, params, b, time_it=time_it)


def random_problems(count: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        m, n, k = rng.randint(1, 700), 8 * rng.randint(1, 90), 8 * rng.randint(1, 140)
        out.append(Problem(m, n, k, ("kn", "nk")[i % 2]))
    return out


def test_correct_kernels_are_never_rejected(pool):
    sm80 = get_family("sm80_mma")
    for i, p in enumerate(random_problems(8, seed=11)):
        settings = [("naive", {"block_x": 16, "block_y": 16})]
        settings += [("sm80_mma", params) for params in sm80.space(p)[i % 3:: 7][:2]]
        for family, params in settings:
            r = pool.evaluate(build_job(family, params, p, time_it=False))
            assert r.status is Status.OK, f"{family} {params} on {p.key}: {r.status} {r.reason}"
            assert r.max_rel_err <= 2 * r.cublas_rel_err + 1e-6


def test_every_sm90_producer_and_epilogue_passes_the_full_checks(pool):
    """TMA and cp.async producers; smem, direct and TMA-store epilogues, persistent or not; split-K clusters; K
    groups (workspace partials and arrival counters, which repeat launches must find reset); multicast clusters
    (a trailing CTA past M still loads its peer's B); swapped A and B roles: each kind space()
    proposes goes through every check (poison, guards, edge shapes, repeat launches)."""
    sm90 = get_family("sm90_wgmma")
    # 200_512_3000 kn: B's panels in one 3-D copy (N % 64 == 0; its edge shapes N = 504 take the 2-D copies), with
    # and without multicast
    # M <= 48: swapped roles (the A box only M rounded up to 8 rows), plain, two CTAs an SM, split-K and K groups
    problems = random_problems(4, seed=5) + [Problem(100, 264, 8192, "kn"), Problem(77, 200, 8192, "nk"),
                                             Problem(40, 1000, 8200, "kn"), Problem(17, 2056, 5000, "nk"),
                                             Problem(200, 512, 3000, "kn"), Problem(9, 136, 72, "kn"),
                                             Problem(16, 9000, 520, "nk")]
    for p in problems:
        kinds: dict[tuple, dict] = {}
        for params in sm90.space(p):
            kinds.setdefault((params["loader"], params["epilogue"], params["persistent"], params["split_k"] > 1,
                              params["k_groups"] > 1, params["cluster_m"] > 1, params["swap_ab"]), params)
        for params in kinds.values():
            r = pool.evaluate(build_job("sm90_wgmma", params, p, time_it=False))
            assert r.status is Status.OK, f"{params} on {p.key}: {r.status} {r.reason}"


def test_timing_record_is_complete(pool):
    p = Problem(1024, 1024, 1024)
    r = pool.evaluate(build_job("sm80_mma", get_family("sm80_mma").space(p)[0], p))
    assert r.status is Status.OK, r.reason
    for t in (r.warm, r.cold, r.cublas_warm, r.cublas_cold):
        assert t and t.min_us <= t.median_us <= t.max_us and t.launches >= 1
    # a replay lasts about 1 ms: the launch count comes from a short graph's estimate, which errs long for short kernels
    assert r.warm.median_us * r.warm.launches >= 800
    assert r.cold.median_us >= 0.8 * r.warm.median_us
    assert r.device["name"] and r.device["sms"] > 0 and "torch" in r.device["software"]


def test_a_remeasurement_times_the_honest_mode_alone(pool):
    """A re-measurement (honest_only): the checks and the honest timings, no warm or cold graphs; it ranks on the
    honest figures."""
    import dataclasses

    p = Problem(1024, 1024, 1024)
    job = dataclasses.replace(build_job("sm80_mma", get_family("sm80_mma").space(p)[0], p), honest=True,
                              honest_only=True)
    r = pool.evaluate(job)
    assert r.status is Status.OK, r.reason
    assert r.warm is r.cold is r.cublas_warm is r.cublas_cold is None
    assert r.honest.launches >= 1 and r.cublas_honest.launches >= 1
    assert r.speedup == pytest.approx(r.cublas_honest.median_us / r.honest.median_us)


@pytest.mark.gpu_alone
def test_two_runs_agree_within_their_spread(pool):
    p = Problem(2048, 2048, 2048)
    job = build_job("sm80_mma", get_family("sm80_mma").space(p)[0], p)
    a, b = pool.evaluate(job), pool.evaluate(job)
    assert a.status is b.status is Status.OK
    tolerance = max(a.warm.spread, b.warm.spread, 0.03)
    assert abs(a.warm.median_us - b.warm.median_us) / a.warm.median_us <= tolerance
    assert abs(a.speedup - b.speedup) / a.speedup <= 2 * tolerance


@pytest.mark.gpu_alone
@pytest.mark.parametrize("mnk", ["4096_4096_4096", "256_1024_256"])
def test_timing_agrees_with_cupti(mnk):
    """Graph timing against the kernel durations CUPTI reports (torch.profiler) for eager launches, same process:
    the recorded CUPTI figure must agree within a few percent; the graph figure too for a large kernel, and for a
    small one within the gap between back-to-back launches (about half a microsecond)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sandbox.launch import Kernel
    from sandbox.timing import Subject, graph_estimate_us, launches_for, measure

    m, n, k = (int(x) for x in mnk.split("_"))
    p = Problem(m, n, k)
    fam = get_family("sm80_mma")
    params = fam.space(p)[0]
    kernel = Kernel.for_family(compile_cuda(fam.render(params, p), "sm_90a").cubin, "sm80_mma", params, p)
    a = torch.randn(m, k, device="cuda").half()
    b = torch.randn(k, n, device="cuda").half()
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    launches = launches_for(graph_estimate_us(lambda: kernel(a, b, c, m, n, k)))
    timing = measure({"k": Subject(lambda i: kernel(a, b, c, m, n, k), launches)}, cupti=True)["k"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(200):
            kernel(a, b, c, m, n, k)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.key == "hgemm"]
    assert rows and rows[0].count >= 150, [(e.key, e.count) for e in prof.key_averages()]
    cupti = rows[0].device_time_total / rows[0].count
    print(f"{mnk}: graph {timing.median_us:.2f} us, recorded CUPTI {timing.cupti_us:.2f} us, eager {cupti:.2f} us")
    assert abs(timing.cupti_us - cupti) / cupti < 0.04
    assert abs(timing.median_us - cupti) / cupti < (0.02 if cupti > 100 else 0.04 + 0.7 / cupti)
