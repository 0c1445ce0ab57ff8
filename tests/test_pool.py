"""The worker pool: timeouts, crash detection and replacement, one worker per GPU, with fake workers (no GPU)."""

from __future__ import annotations

import time

import pytest

from core.records import EvalJob, Problem, ProfileResult, Status
from sandbox.pool import GpuWorker, MixedDevices, WorkerPool, WorkerUnavailable
from tests import fake_workers


def job(cid="c1", timeout_s=0.5):
    return EvalJob(cid, Problem(64, 64, 64), "sm80_mma", {}, b"", timeout_s=timeout_s)


def test_ok_worker_returns_results_and_stays_up():
    w = GpuWorker(target=fake_workers.ok_worker)
    try:
        assert w.start()["name"] == "fake"
        r1, r2 = w.evaluate(job("a")), w.evaluate(job("b"))
        assert (r1.status, r2.status) == (Status.OK, Status.OK)
        assert r1.device["pid"] == r2.device["pid"]
        assert r1.speedup == pytest.approx(1.2)
    finally:
        w.close()


def test_hung_kernel_is_killed_within_its_deadline_and_worker_replaced():
    w = GpuWorker(target=fake_workers.hang_worker)
    try:
        w.start()
        t0 = time.monotonic()
        r = w.evaluate(job("hang"))
        assert r.status is Status.TIMEOUT and "killed" in r.reason
        assert time.monotonic() - t0 < 5.0  # the phase announced 0.5 s
        assert not w.alive()
        w.target = fake_workers.ok_worker  # the next job gets a fresh worker
        assert w.evaluate(job("next")).status is Status.OK
        assert w.restarts == 1
    finally:
        w.close()


def test_worker_that_dies_mid_job_is_a_fault_and_is_replaced():
    w = GpuWorker(target=fake_workers.crash_worker)
    try:
        w.start()
        r = w.evaluate(job("crash"))
        assert r.status is Status.FAULT and "exit code 7" in r.reason
        w.target = fake_workers.ok_worker
        assert w.evaluate(job("next")).status is Status.OK
    finally:
        w.close()


def test_cuda_fault_replaces_the_worker_and_the_run_goes_on():
    w = GpuWorker(target=fake_workers.fault_then_ok_worker)
    try:
        w.start()
        first = w.evaluate(job("ok1"))
        bad = w.evaluate(job("bad1"))
        after = w.evaluate(job("ok2"))
        assert bad.status is Status.FAULT and "illegal address" in bad.reason
        assert after.status is Status.OK and after.device["pid"] != first.device["pid"]
    finally:
        w.close()


def test_no_gpu_is_reported_as_unavailable():
    w = GpuWorker(target=fake_workers.no_gpu_worker)
    with pytest.raises(WorkerUnavailable, match="no CUDA device"):
        w.start()


def test_worker_that_never_starts_times_out():
    w = GpuWorker(target=fake_workers.silent_worker, startup_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailable, match="did not start"):
        w.start()
    assert time.monotonic() - t0 < 5.0
    assert not w.alive()


# one worker per GPU

def scripted(cid, **params):
    return EvalJob(cid, Problem(64, 64, 64), "sm80_mma", params, b"", timeout_s=2.0)


def test_jobs_go_to_idle_gpus_and_never_share_one():
    with WorkerPool((0, 1), target=fake_workers.scripted_worker) as pool:
        pool.start()
        assert pool.slots == 2
        results = [f.result(timeout=30) for f in [pool.submit(scripted(f"j{i}", sleep=0.3)) for i in range(6)]]
    assert all(r.status is Status.OK for r in results)
    by_gpu = {}
    for r in results:
        by_gpu.setdefault(r.device["index"], []).append((r.device["t0"], r.device["t1"]))
    assert set(by_gpu) == {0, 1}
    for runs in by_gpu.values():
        runs.sort()
        assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:], strict=False))  # one job at a time per GPU


def test_a_job_whose_worker_died_is_retried_once_and_passes(tmp_path):
    with WorkerPool((0, 1), target=fake_workers.scripted_worker) as pool:
        pool.start()
        r = pool.evaluate(scripted("once", die=str(tmp_path / "died")))
        assert r.status is Status.OK and (tmp_path / "died").exists()
        assert pool.describe()["retried"] == 1
        assert pool.evaluate(scripted("next")).status is Status.OK


def test_a_job_that_kills_its_retry_too_is_a_fault():
    with WorkerPool((0, 1), target=fake_workers.scripted_worker) as pool:
        pool.start()
        r = pool.evaluate(scripted("killer", die="always"))
        assert r.status is Status.FAULT and "exit code 9" in r.reason and "retry" in r.reason
        assert pool.describe()["retried"] == 1
        assert pool.evaluate(scripted("after")).status is Status.OK  # fresh workers serve the next job


def test_a_gpu_whose_worker_cannot_restart_is_retired_and_the_others_go_on(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_GONE", str(tmp_path))
    (tmp_path / "0.gone").touch()
    with WorkerPool((0, 1), target=fake_workers.scripted_worker) as pool:
        pool.start()
        futures = [pool.submit(scripted(f"j{i}", sleep=0.2, die=0)) for i in range(4)]  # each kills GPU 0's worker
        results = [f.result(timeout=30) for f in futures]
        assert {(r.status, r.device["index"]) for r in results} == {(Status.OK, 1)}
        assert pool.slots == 1 and pool.describe()["retried"] >= 1


def test_when_no_gpu_is_left_the_jobs_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_GONE", str(tmp_path))
    for i in (0, 1):
        (tmp_path / f"{i}.gone").touch()
    with WorkerPool((0, 1), target=fake_workers.scripted_worker) as pool:
        pool.start()
        assert pool.evaluate(scripted("killer", die="always")).status is Status.FAULT  # on both GPUs
        with pytest.raises(WorkerUnavailable, match="no GPU worker is left.*is gone"):
            pool.evaluate(scripted("late"))
        with pytest.raises(WorkerUnavailable):
            pool.evaluate(scripted("later"))


def test_gpus_of_different_models_are_refused():
    pool = WorkerPool((0, 1), target=fake_workers.mixed_models_worker)
    with pytest.raises(MixedDevices, match="not all one model.*GPU 0: fake model 0.*GPU 1: fake model 1"):
        pool.start()
    assert not any(w.alive() for w in pool.workers)


def test_profiles_run_on_a_worker_thread_with_its_device(tmp_path):
    seen = []

    def profiler(cubin, family, params, problem, device):
        seen.append(device)
        return ProfileResult(True, summary=f"on GPU {device}")

    with WorkerPool((0, 1), target=fake_workers.scripted_worker) as pool:
        pool.start()
        r = pool.profile(profiler, scripted("p")).result(timeout=10)
    assert r.ok and seen[0] in (0, 1) and r.summary == f"on GPU {seen[0]}"


@pytest.mark.gpu
def test_every_gpu_of_the_host_evaluates_a_real_kernel():
    import torch

    from sandbox.build import compile_cuda
    from templates import get_family

    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip("needs two GPUs")
    p = Problem(1024, 1024, 1024)
    family = get_family("sm80_mma")
    params = family.space(p)[0]
    with WorkerPool(tuple(range(gpus))) as pool:
        pool.start()
        build = compile_cuda(family.render(params, p), pool.facts.arch)
        assert build.ok, build.log
        job = EvalJob("real", p, "sm80_mma", params, build.cubin)
        results = [f.result() for f in [pool.submit(job) for _ in range(2 * gpus)]]
        assert pool.describe()["serving"] == gpus
    assert all(r.status is Status.OK for r in results), [r.reason for r in results]
    times = sorted(r.time_us for r in results)
    assert times[-1] < 1.2 * times[0]  # the same model, each timing alone on its GPU


def test_the_scaleout_simulation_runs_the_loop_on_stand_in_workers(tmp_path, capsys, monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    for name in ("FAKE_SLEEP", "HGEMM_AGENT_CACHE"):  # the tool sets them: restored after the test
        monkeypatch.setenv(name, "")
    path = Path(__file__).parents[1] / "tools" / "scaleout_sim.py"
    spec = importlib.util.spec_from_file_location("scaleout_sim", path)
    sim = importlib.util.module_from_spec(spec)
    sys.modules["scaleout_sim"] = sim
    spec.loader.exec_module(sim)
    assert sim.main(["--gpus", "1,x"]) == 2 and "--gpus takes counts" in capsys.readouterr().err
    assert sim.main(["--mnk", "64_64_64", "--max-candidates", "2", "--gpus", "1,2", "--seconds", "0.01",
                     "--cache", str(tmp_path / "cubins")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" stand-in")[0] for line in lines] == ["1", "2"]
    assert lines[0].endswith("1.00x") and "2 results" in lines[1]
