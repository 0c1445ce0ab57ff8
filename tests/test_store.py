"""agent.store.RunStore: what a measurement keeps, and a run folder written before a column existed opens as today's."""

from __future__ import annotations

import sqlite3

from agent.store import DB_NAME, RunStore
from core.records import EvalResult, Status, Timing


def result(cid: str, wall_s: float, honest: bool) -> EvalResult:
    t, c = Timing(10.0, 9.9, 10.1, 100), Timing(12.0, 11.9, 12.1, 100)
    timings = dict(honest=t, cublas_honest=c) if honest else dict(warm=t, cublas_warm=c)
    return EvalResult(cid, Status.OK, wall_s=wall_s, **timings)


def test_a_measurement_keeps_its_own_wall_time(tmp_path):
    store = RunStore(tmp_path / "r", create=True)
    store.add_measurement(result("a", 2.0, honest=False))
    store.add_measurement(result("a", 0.7, honest=True))  # a re-measurement: the honest timing alone, cheaper
    rows = store.db.execute("SELECT wall_s, honest, speedup FROM measurements ORDER BY created").fetchall()
    assert rows == [(2.0, 0, 1.2), (0.7, 1, 1.2)]


def test_a_store_from_before_wall_times_opens_and_records_them(tmp_path):
    RunStore(tmp_path / "r", create=True).close()
    db = sqlite3.connect(tmp_path / "r" / DB_NAME)
    db.execute("DROP TABLE measurements")  # as session 23 wrote it
    db.execute("CREATE TABLE measurements (candidate_id TEXT, time_us REAL, cublas_us REAL, speedup REAL, "
               "created REAL, honest INT DEFAULT 0)")
    db.execute("INSERT INTO measurements VALUES ('old', 10.0, 12.0, 1.2, 0.0, 0)")
    db.commit()
    db.close()
    store = RunStore(tmp_path / "r")
    store.add_measurement(result("new", 1.5, honest=True))
    assert store.db.execute("SELECT candidate_id, wall_s FROM measurements ORDER BY created").fetchall() == [
        ("old", None), ("new", 1.5)]
