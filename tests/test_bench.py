"""bench: choosing each shape's kernel across runs, cuBLAS where nothing beat it, and the written outputs."""

from __future__ import annotations

import dataclasses
import json

from agent import buckets
from agent.bench import BenchRow, bench_offline, best_across, by_series, geomean, write_outputs
from core.records import BaselineJob, EvalResult, Problem, Status, Timing
from tests.helpers import fake_evaluate, m_dependent_evaluate, populated_run

WIN, LOSE = Problem(1000, 3000, 2000), Problem(64, 64, 64, "nk")  # the fake timings beat cuBLAS only on WIN


def evaluate(job):
    if isinstance(job, BaselineJob):
        return EvalResult("cublas", Status.OK, cublas_warm=Timing(30, 29, 31, 10), cublas_cold=Timing(33, 32, 34, 10))
    return fake_evaluate(job)


def test_best_across_runs_and_cublas_fallback(tmp_path):
    stores = [populated_run(tmp_path / "a", n=4), populated_run(tmp_path / "b", n=6)]
    store, cid, ratio = best_across(stores, WIN)
    assert ratio > 1 and store.candidate(cid).problem == WIN
    assert best_across(stores, LOSE) is None


def test_bench_offline_rows(tmp_path):
    stores = [populated_run(tmp_path / "a", n=4)]
    seen = []
    rows = bench_offline(lambda j: seen.append(type(j).__name__) or evaluate(j), stores, [WIN, LOSE],
                         progress=lambda s: None)
    win, lose = rows
    assert win.kernel.startswith("a/") and win.ratio_warm > 1 and win.tflops > 0
    assert lose.kernel == "cuBLAS" and lose.ratio_warm == 1.0
    assert seen == ["EvalJob", "BaselineJob"]  # the winner is re-checked and re-timed, not trusted


def test_outputs_written(tmp_path):
    rows = bench_offline(evaluate, [populated_run(tmp_path / "a", n=4)], [WIN, LOSE], progress=lambda s: None)
    paths = write_outputs(rows, tmp_path / "out", {"name": "fake"})
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(data["rows"]) == 2 and data["geomean_warm"] == geomean([r.ratio_warm for r in rows])
    assert paths[0].name == "bench.json"


def test_server_table_names_the_launch_path():
    from rich.console import Console

    from agent.bench import server_table

    lat = {"p50": 20.0, "p90": 21.0, "p99": 30.0, "n": 100}
    report = {"path": "compiled", "shapes": {"64_4096_4096:nk:f16": {"ours": lat, "cublas": lat, "kernel": True},
                                             "64_64_64:nk:f16": {"ours": lat, "cublas": lat, "kernel": False}}}
    console = Console(width=200, record=True)
    console.print(server_table(report, 200))
    text = console.export_text()
    assert "through the compiled op" in text and "64_4096_4096:nk:f16" in text and "cuBLAS" in text


def test_bench_ranks_on_honest_time_and_names_the_baseline(tmp_path):
    jobs = []

    def honest(job):
        jobs.append(job)
        r = evaluate(job)
        if isinstance(job, BaselineJob):
            return EvalResult("cublas", Status.OK, cublas_warm=r.cublas_warm, cublas_cold=r.cublas_cold,
                              cublas_honest=Timing(31, 30, 32, 10))
        slower = Timing(r.warm.median_us * 1.1, r.warm.min_us, r.warm.max_us, 10)  # no reuse: 10% slower
        return EvalResult(r.candidate_id, r.status, warm=r.warm, cold=r.cold, cublas_warm=r.cublas_warm,
                          cublas_cold=r.cublas_cold, honest=slower, cublas_honest=r.cublas_warm)

    win, lose = bench_offline(honest, [populated_run(tmp_path / "a", n=4)], [WIN, LOSE], progress=lambda s: None)
    assert all(j.honest for j in jobs)  # the winner and cuBLAS alone are both timed honestly
    assert abs(win.ratio_honest - win.ratio_warm / 1.1) < 1e-9 and lose.ratio_honest == 1.0
    fused = Problem(8, 64, 64, "nk", "f16", False, "silu_mul")
    assert fused.fused.baseline == "cuBLAS x2 (gate, up) + silu + mul" and WIN.fused.baseline == "cuBLAS"
    assert write_outputs([win, lose], tmp_path / "o", {})[0].read_text().count("geomean_honest") == 1


def test_an_m_inside_a_bucket_is_benched_as_the_export_dispatches_it(tmp_path):
    """Every M of a range that was not a representative: the bucket's served kernel (even where it is slower at this
    M: the export runs it there), cuBLAS where the bucket goes to cuBLAS."""
    problems = buckets.plan([Problem(24, 256, 512, "nk", m_range=(1, 48))])
    store = populated_run(tmp_path / "a", problems=tuple(problems), n=3, evaluate=m_dependent_evaluate)
    served = buckets.served(store, problems[-1])  # 33-48

    jobs = []

    def timed(job):
        jobs.append(job)
        if isinstance(job, BaselineJob):
            return evaluate(job)
        r = m_dependent_evaluate(job)
        return r if job.problem.m != 47 else dataclasses.replace(r, warm=Timing(40, 40, 40, 1))  # slower at 47

    asked = [Problem(m, 256, 512, "nk") for m in (5, 18, 30, 47)]
    rows = bench_offline(timed, [store], asked, progress=lambda s: None)
    assert [r.kernel == "cuBLAS" for r in rows] == [True, True, False, False]
    assert rows[3].kernel == f"a/{served.candidate.id}" and rows[3].ratio_warm == 0.75
    assert rows[1].note == "M=18 in bucket 17-24_256_512" and rows[2].note == "M=30 in bucket 25-32_256_512"
    assert len(jobs) == 4 and all(j.honest for j in jobs)  # the dispatched kernel or cuBLAS, each timed honestly


def test_a_runs_own_buckets_bench_their_served_kernel(tmp_path):
    problems = buckets.plan([Problem(24, 256, 512, "nk", m_range=(9, 32))])
    store = populated_run(tmp_path / "a", problems=tuple(problems), n=3, evaluate=m_dependent_evaluate)
    assert best_across([store], problems[0]) is None  # 9-16 goes to cuBLAS, whatever its winner ran at M=13
    for b in problems[1:]:  # 17-24 served at its stretch 21-24, which holds its representative 21; 25-32 all of it
        _, cid, _ = best_across([store], b)
        assert cid == buckets.served(store, b).candidate.id
    assert buckets.served(store, problems[1]).pieces == ((21, 24),)


def test_series_benched_at_several_m_get_a_line_each():
    def row(m, n, ratio, kernel="cuBLAS", dtype="f16"):
        return BenchRow(f"{m}_{n}_64", "nk", kernel, 10 / ratio, 10, 11 / ratio, 11, ratio, ratio, 1.0, 50.0,
                        ratio, dtype=dtype, ratio_honest=ratio)

    rows = [row(1, 128, 1.2, "a/k1"), row(7, 128, 0.99), row(30, 128, 1.44, "a/k2"), row(3, 256, 1.0),
            row(5, 128, 1.1, "a/k3", "bf16"), row(9, 128, 1.0, dtype="bf16"), row(64, 512, 1.3, "a/k4")]
    series = by_series(rows)  # 64_512 was benched at one M: no line
    assert [s["series"] for s in series] == ["128_64:nk:f16", "128_64:nk:bf16"]
    first = series[0]
    assert (first["m_values"], first["on_kernels"], first["lowest"], first["lowest_m"]) == (3, 2, 0.99, 7)
    assert abs(first["honest"] - geomean([1.2, 0.99, 1.44])) < 1e-12 and first["warm"] == first["honest"]
    assert json.loads(json.dumps(series)) == series  # as bench.json keeps them


def test_the_progress_line_says_why_a_problem_stays_on_cublas(tmp_path):
    """No kernel of the runs beat cuBLAS, or the winner lost when re-timed now: the line says which (and the row's
    note keeps the second)."""
    said = []

    def slower_now(job):
        r = evaluate(job)
        if isinstance(job, BaselineJob):
            return r
        return dataclasses.replace(r, warm=Timing(40, 39, 41, 10))  # re-timed now: behind cuBLAS's 30 µs

    rows = bench_offline(slower_now, [populated_run(tmp_path / "a", n=4)], [WIN, LOSE], progress=said.append)
    assert [r.kernel for r in rows] == ["cuBLAS", "cuBLAS"]
    assert said[0].startswith(f"{WIN.key}: cuBLAS (") and "now ok 0.750x: cuBLAS kept" in said[0]
    assert rows[0].note in said[0]
    assert said[1] == f"{LOSE.key}: cuBLAS (no kernel of the runs beat it)" and rows[1].note == ""
