"""Evaluation on a Dask cluster, with fake GPU workers: dispatch, a GPU worker dying, a Dask worker killed mid-run,
and the store on the driver keeping every result once."""

from __future__ import annotations

import os
import signal
import time

import pytest

distributed = pytest.importorskip("distributed")

import dask  # noqa: E402
from distributed import LocalCluster  # noqa: E402

from agent.config import RunConfig  # noqa: E402
from agent.events import CandidateDone  # noqa: E402
from agent.loop import SearchLoop  # noqa: E402
from agent.proposers.builtin import BuiltinProposer  # noqa: E402
from agent.store import RunStore  # noqa: E402
from core.records import EvalJob, Problem, Status  # noqa: E402
from sandbox import cluster as dask_executor  # noqa: E402
from sandbox.cluster import DaskExecutor, WorkerUnavailable  # noqa: E402
from tests import fake_workers  # noqa: E402

P, Q = Problem(1000, 3000, 2000), Problem(64, 64, 64, "nk")


def scripted(cid, **params):
    return EvalJob(cid, Problem(64, 64, 64), "sm80_mma", params, b"", timeout_s=2.0)


def local_cluster(n, processes=False, **kw):
    return LocalCluster(n_workers=n, threads_per_worker=1, processes=processes, dashboard_address=":0", **kw)


@pytest.fixture(scope="module")
def two_workers():
    with local_cluster(2) as c:
        yield c


def test_jobs_spread_over_the_workers_one_at_a_time_each(two_workers):
    ex = DaskExecutor(two_workers.scheduler_address, target=fake_workers.scripted_worker, poll_s=0.2)
    try:
        assert ex.start()["name"] == "fake" and ex.slots == 2 and len(ex.infos) == 2
        results = [f.result(timeout=30) for f in [ex.submit(scripted(f"j{i}", sleep=0.2)) for i in range(6)]]
    finally:
        ex.close()
    assert all(r.status is Status.OK for r in results)
    by_process = {}
    for r in results:
        by_process.setdefault(r.device["pid"], []).append((r.device["t0"], r.device["t1"]))
    assert len(by_process) == 2  # one GPU worker process per Dask worker, both used
    for runs in by_process.values():
        runs.sort()
        assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:], strict=False))


def test_a_gpu_worker_that_dies_is_replaced_and_its_job_retried_once(two_workers, tmp_path):
    ex = DaskExecutor(two_workers.scheduler_address, target=fake_workers.scripted_worker, poll_s=0.2)
    try:
        ex.start()
        assert ex.evaluate(scripted("once", die=str(tmp_path / "died"))).status is Status.OK
        twice = ex.evaluate(scripted("killer", die="always"))
        assert twice.status is Status.FAULT and "exit code 9" in twice.reason and "retry" in twice.reason
        assert ex.describe()["retried"] == 2
        assert ex.evaluate(scripted("after")).status is Status.OK
    finally:
        ex.close()


def test_an_unreachable_scheduler_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(dask_executor, "CONNECT_TIMEOUT_S", 0.5)
    for address, words in (("tcp://127.0.0.1:1", "Timed out"), ("127.0.0.1", "missing port")):
        ex = DaskExecutor(address)
        with pytest.raises(WorkerUnavailable, match=f"cannot reach the Dask scheduler at {address} .*{words}"):
            ex.start()
        assert ex.client is None


def test_with_no_worker_left_the_waiting_jobs_fail_instead_of_hanging():
    with local_cluster(1) as c:
        ex = DaskExecutor(c.scheduler_address, target=fake_workers.scripted_worker, poll_s=0.1, give_up_s=0.5)
        try:
            ex.start()
            waiting = ex.submit(scripted("w", sleep=1.0))
            c.scale(0)
            with pytest.raises(WorkerUnavailable, match="no Dask worker for"):
                waiting.result(timeout=30)
            assert ex.describe()["lost_workers"] == 1
        finally:
            ex.close()


def test_a_daemonic_dask_worker_is_refused_with_the_fix():
    with dask.config.set({"distributed.worker.daemon": True}), local_cluster(1, processes=True) as c:
        ex = DaskExecutor(c.scheduler_address, target=fake_workers.scripted_worker)
        with pytest.raises(WorkerUnavailable, match="DASK_DISTRIBUTED__WORKER__DAEMON=False"):
            ex.start()


def test_the_loop_on_dask_loses_nothing_when_a_worker_is_killed_mid_run(tmp_path, monkeypatch):
    """Dask worker processes (as `dask worker` runs them); one is killed at the third result, jobs in flight there
    are run again elsewhere, and the run's records are complete, each result once."""
    monkeypatch.setenv("FAKE_SLEEP", "0.2")
    problems = [P, Q]
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems(problems)
    with dask.config.set({"distributed.worker.daemon": False}), local_cluster(2, processes=True) as c:
        ex = DaskExecutor(c.scheduler_address, target=fake_workers.timed_like_fake_evaluate, poll_s=0.2)
        try:
            ex.start()
            pids = ex.client.run(os.getpid)
            killed = []

            def kill_one(event):
                if isinstance(event, CandidateDone) and len(store.results(P)) == 3 and not killed:
                    killed.append(min(pids.values()))
                    os.kill(killed[0], signal.SIGKILL)

            summaries = SearchLoop(store, RunConfig(max_candidates=6, profile=False), BuiltinProposer(), "sm_90a",
                                   ex, kill_one).run(problems)
            time.sleep(0.5)  # the watcher's next look at the scheduler
            assert killed and ex.describe()["lost_workers"] >= 1
        finally:
            ex.close()
    for p, summary in zip(problems, summaries, strict=True):
        results = store.results(p)
        assert summary.tried == len(results) == len(store.candidates(p)) == 6
        assert all(r.status is Status.OK for _, r in results)  # nothing was lost with the worker
        measured = [store.db.execute("SELECT COUNT(*) FROM measurements WHERE candidate_id = ?", (c.id,)).fetchone()[0]
                    for c, _ in results]
        assert min(measured) >= 1 and sum(measured) >= 6 + 4  # once each, plus the leaders' re-measurements
    assert len({r.device["pid"] for p in problems for _, r in store.results(p)}) >= 2
