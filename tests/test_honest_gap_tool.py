"""tools/honest_gap.py: the first screen against the honest figure per re-measured candidate, and the rejections."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from core.records import EvalJob, Status, Timing
from tests.helpers import fake_evaluate, populated_run

spec = importlib.util.spec_from_file_location("honest_gap", Path(__file__).parents[1] / "tools" / "honest_gap.py")
honest_gap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(honest_gap)

REUSED = {}  # candidate id -> the share of its warm time a reuse saved (its honest time is that much longer)


def evaluate(job: EvalJob):
    r = fake_evaluate(job)
    if not job.honest:
        return r
    warm = fake_evaluate(dataclasses.replace(job, honest=False, honest_only=False)).warm  # the first screen's
    t = warm.median_us * (1 + REUSED.get(job.candidate_id, 0.0)) * 1.02
    return dataclasses.replace(r, honest=Timing(t, t, t, 50), cublas_honest=Timing(30.6, 30.6, 30.6, 50))


def test_gaps_per_candidate_beside_cublas_and_a_reuse_stands_out(tmp_path, capsys):
    store = populated_run(tmp_path / "r", evaluate=evaluate)
    db = store.db
    remeasured = [cid for (cid,) in db.execute("SELECT DISTINCT candidate_id FROM measurements WHERE honest = 1")]
    assert remeasured
    rows = honest_gap.rows(db)
    assert {r["candidate"] for r in rows} == set(remeasured)
    for r in rows:  # both sides 2% slower honestly: no excess, every candidate at its shape's median
        assert abs(r["gap"] - 1.02) < 1e-9 and abs(r["cublas_gap"] - 1.02) < 1e-9 and abs(r["excess"] - 1) < 1e-9
        assert abs(r["vs_shape"] - 1) < 1e-9 and abs(r["cublas_vs_shape"] - 1) < 1e-9
    store.close()

    REUSED[remeasured[0]] = 0.08
    try:
        store = populated_run(tmp_path / "s", evaluate=evaluate)
    finally:
        REUSED.clear()
    store.close()
    assert honest_gap.main([str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "0 rejected" in out and "1 of" in out and "beyond 5%" in out
    first_row = next(line for line in out.splitlines() if line.startswith("| ") and "shape" not in line)
    assert remeasured[0] in first_row and "| 1.080 |" in first_row  # above its shape-mates by 8%: listed first


def test_rejections_are_listed_and_a_missing_store_exits_2(tmp_path, capsys):
    calls = []

    def wrong_sometimes(job):
        calls.append(job)
        if not job.honest and len(calls) % 4 == 0:
            return dataclasses.replace(fake_evaluate(job), status=Status.WRONG, reason="wrong result: 1e-1")
        return evaluate(job)

    populated_run(tmp_path / "r", evaluate=wrong_sometimes).close()
    assert honest_gap.main([str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "REJECTED" in out and "wrong result: 1e-1" in out
    assert honest_gap.main([str(tmp_path / "nothing")]) == 2
    assert "no run store" in capsys.readouterr().err
