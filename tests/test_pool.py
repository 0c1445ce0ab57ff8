"""The worker pool: timeouts, crash detection and replacement, with fake workers (no GPU)."""

from __future__ import annotations

import time

import pytest

from core.records import EvalJob, Problem, Status
from sandbox.pool import GpuWorker, WorkerUnavailable
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
