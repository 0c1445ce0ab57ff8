"""The tuning database: what it keeps, the run store's hook that feeds it what the loop records, importing runs,
files it cannot use, and runs through the CLI that learn from it."""

from __future__ import annotations

import sqlite3

import pytest

import agent.runner
from agent.cli import main
from agent.config import RunConfig
from agent.cost_model import MIN_PROBLEMS
from agent.loop import SearchLoop
from agent.proposers.builtin import BuiltinProposer
from agent.runner import open_tuning
from agent.store import RunStore
from agent.tuning_db import TuningDB, TuningDbError, TuningRecorder, TuningRow
from core.device import H200
from core.records import Candidate, EvalJob, EvalResult, Problem, Status, Timing
from sandbox.executor import InlineExecutor
from templates import families_for_arch, get_family
from tests.helpers import fake_evaluate, populated_run, sometimes_wrong

P = Problem(1000, 3000, 2000)
SETTING = {"block_m": 128, "block_n": 128, "consumers": 2, "stages": 4}


def ok(cid: str, us: float) -> EvalResult:
    return EvalResult(cid, Status.OK, warm=Timing(us, us, us, 10), cold=Timing(us, us, us, 10),
                      cublas_warm=Timing(30.0, 30, 30, 10), cublas_cold=Timing(33.0, 33, 33, 10))


def test_rows_round_trip_and_a_remeasurement_updates_the_median(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite")
    c = Candidate(P, "sm90_wgmma", SETTING)
    db.record("run1", H200, "sm_90a", c, ok(c.id, 20.0), [1.5])
    db.record("run1", H200, "sm_90a", c, ok(c.id, 20.0), [1.5, 1.3, 1.4])
    skipped = Candidate(P, "sm90_wgmma", {**SETTING, "stages": 5})
    db.record("run1", H200, "sm_90a", skipped, EvalResult(skipped.id, Status.SKIPPED, "compile only"), [])
    bad = Candidate(P, "sm80_mma", {"block_m": 64})
    db.record("run2", H200, "sm_90a", bad, EvalResult(bad.id, Status.WRONG, "max error 1e-1"), [])
    rows = db.rows("NVIDIA H200")
    assert [(r.family, r.status, r.speedup) for r in rows] == [("sm90_wgmma", Status.OK, 1.4),
                                                              ("sm80_mma", Status.WRONG, None)]
    assert rows[0] == TuningRow("NVIDIA H200", 132, P, "sm90_wgmma", SETTING, False, Status.OK, 1.4, "run1")
    assert db.rows("NVIDIA A100") == [] and db.summary()[0][:4] == ("NVIDIA H200", "sm80_mma", 1, 0)
    db.close()


def test_the_run_store_forwards_what_the_loop_records(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite")
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    store.listeners.append(TuningRecorder(db, store.run_id, H200, "sm_90a", pytest.fail))
    SearchLoop(store, RunConfig(max_candidates=6), BuiltinProposer(), "sm_90a", sometimes_wrong()).run([P])
    rows = {Candidate(r.problem, r.family, r.params).id: r for r in db.rows()}
    results = dict((c.id, r) for c, r in store.results(P))
    assert set(rows) == set(results) and len(rows) == 6
    for cid, r in results.items():
        assert rows[cid].status is r.status
        if r.status is Status.OK:  # the median over the measurement and the re-measurements
            assert rows[cid].speedup == pytest.approx(store.median_speedup(cid))
    assert any(r.status is Status.WRONG for r in rows.values())
    assert any(len(store.speedups(cid)) > 1 for cid in results)  # re-measured ones were updated too


def test_a_failing_write_is_said_once_and_the_run_goes_on(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite")
    said = []
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    store.listeners.append(TuningRecorder(db, store.run_id, H200, "sm_90a", said.append))
    db.close()  # every write now fails
    SearchLoop(store, RunConfig(max_candidates=3), BuiltinProposer(), "sm_90a", fake_evaluate).run([P])
    assert len(store.results(P)) == 3 and len(said) == 1 and "no longer kept" in said[0]


@pytest.mark.parametrize("make", [
    lambda p: p.mkdir(),  # a folder
    lambda p: p.write_bytes(b"not a database at all" * 100),
    lambda p: sqlite3.connect(p).executescript("CREATE TABLE meta (key TEXT, value TEXT);"
                                               "INSERT INTO meta VALUES ('marker', 'something else');"),
])
def test_files_it_cannot_use_are_named_and_the_run_goes_on_without(tmp_path, make):
    path = tmp_path / "t.sqlite"
    make(path)
    with pytest.raises(TuningDbError, match="t.sqlite"):
        TuningDB(path)
    db, model, note = open_tuning(str(path), H200, 0)
    assert db is None and model is None and "goes on without a tuning database" in note
    assert open_tuning(None, H200, 0) == (None, None, "")


def test_import_runs_that_ran_on_a_gpu(tmp_path, capsys):
    store = populated_run(tmp_path / "runs" / "r1")
    store.set_meta("device", H200.to_dict())
    populated_run(tmp_path / "runs" / "r2")  # no device recorded
    db_path = tmp_path / "t.sqlite"
    assert main(["db", "--db", str(db_path)]) == 0 and "no tuning database" in capsys.readouterr().out
    assert not db_path.exists()
    code = main(["db", "--db", str(db_path), "--import", "r1", "r2", "--runs-dir", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert code == 0 and "r1: 12 results added" in out and "r2: run r2 recorded no GPU" in out
    rows = TuningDB(db_path).rows()
    assert len(rows) == 12 and {r.run_id for r in rows} == {"r1"}
    assert {r.problem for r in rows} == set(store.problems())
    code = main(["db", "--db", str(db_path), "--import", "nope", "--runs-dir", str(tmp_path / "runs")])
    assert code == 2 and "no run 'nope'" in capsys.readouterr().err


class FakePool(InlineExecutor):
    def __init__(self) -> None:
        super().__init__(fake_evaluate)


def test_runs_add_to_the_database_and_a_later_run_learns_from_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(agent.runner, "start_pool", lambda arch, gpus=None, cluster=None: (FakePool(), H200))
    db_path, runs = tmp_path / "t.sqlite", tmp_path / "runs"
    assert main(["run", "--mnk", "128_256_64", "--db", str(db_path), "--max-candidates", "2", "--no-profile",
                 "--runs-dir", str(runs)]) == 0
    assert "needs 4 problems" in " ".join(capsys.readouterr().out.split())  # nothing learned yet
    assert len(TuningDB(db_path).rows("NVIDIA H200")) == 2
    # both families' spaces measured on 6 problems, where sm90 tiles of 64 columns win by far
    db = TuningDB(db_path)
    for m in (100, 300, 900, 2700, 5000, 8000):
        problem = Problem(m, 2048, 1024)
        for family in families_for_arch("sm_90a"):
            for params in family.space(problem, H200):
                c = Candidate(problem, family.name, params)
                speedup = 2.0 if family.name == "sm90_wgmma" and params["block_n"] == 64 else 0.5
                db.record("seed", H200, "sm_90a", c, ok(c.id, 30.0 / speedup), [speedup])
    db.close()
    before = set(runs.iterdir())
    assert main(["run", "--mnk", "640_1024_512", "--db", str(db_path), "--max-candidates", "1", "--no-profile",
                 "--runs-dir", str(runs)]) == 0
    assert "order sm80_mma, sm90_wgmma" in " ".join(capsys.readouterr().out.split())
    (folder,) = set(runs.iterdir()) - before
    (first,) = RunStore(folder).candidates()
    assert first.family == "sm90_wgmma" and first.params["block_n"] == 64
    code = main(["run", "--mnk", "64_64_64", "--no-db", "--db", "x", "--runs-dir", str(runs)])
    assert code == 2 and "not both" in capsys.readouterr().err


def three_stages_win(job: EvalJob) -> EvalResult:
    """sm90 settings with a 3-stage ring are 2x cuBLAS, everything else 0.5x: a truth the families' order lacks."""
    return ok(job.candidate_id, 15.0 if job.family == "sm90_wgmma" and job.params["stages"] == 3 else 60.0)


def test_a_first_run_on_an_empty_database_learns_from_its_own_earlier_shapes(tmp_path, monkeypatch):
    monkeypatch.setattr(agent.runner, "start_pool",
                        lambda arch, gpus=None, cluster=None: (InlineExecutor(three_stages_win), H200))
    shapes = [Problem(m, 4096, 4096) for m in range(1000, 1500, 50)]
    assert all(get_family("sm90_wgmma").space(p, H200)[0]["stages"] != 3 for p in shapes)  # not its own order
    (tmp_path / "shapes.txt").write_text("".join(f"{p.mnk}\n" for p in shapes))
    db_path, runs = tmp_path / "t.sqlite", tmp_path / "runs"
    assert main(["run", "--shapes", str(tmp_path / "shapes.txt"), "--db", str(db_path), "--max-candidates", "14",
                 "--no-profile", "--runs-dir", str(runs)]) == 0
    (folder,) = runs.iterdir()
    store = RunStore(folder)
    firsts = [next(c for c in store.candidates() if c.problem == p) for p in shapes]
    assert not any(c.family == "sm90_wgmma" and c.params["stages"] == 3 for c in firsts[:MIN_PROBLEMS])
    assert all(c.family == "sm90_wgmma" and c.params["stages"] == 3 for c in firsts[-2:])  # learned in the run
    assert any(kind == "tuning" and "retrained on" in text and "order sm" in text for _, kind, text in store.events())


def test_problem_count_is_per_gpu_model(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite")
    for problem in (P, Problem(64, 64, 64), Problem(64, 64, 64, "nk")):
        c = Candidate(problem, "sm90_wgmma", SETTING)
        db.record("run1", H200, "sm_90a", c, ok(c.id, 20.0), [1.5])
        db.record("run1", H200, "sm_90a", Candidate(problem, "sm80_mma", {"block_m": 64}), ok(c.id, 20.0), [1.5])
    assert db.problem_count("NVIDIA H200") == 3 and db.problem_count("NVIDIA A100") == 0


def test_a_database_that_fails_mid_run_leaves_the_model_as_it_was(tmp_path):
    from agent.cost_model import Learner

    notes = []
    learner = Learner(TuningDB(tmp_path / "t.sqlite"), "NVIDIA H200", notify=notes.append)
    learner.db.db.close()  # the file went away under the run
    space = get_family("sm90_wgmma").space(P, H200)
    assert learner.order(P, "sm90_wgmma", space, 132) == space and learner.db is None
    assert len(notes) == 1 and "no longer retrained" in notes[0]
    learner.order(P, "sm90_wgmma", space, 132)
    assert len(notes) == 1  # said once
