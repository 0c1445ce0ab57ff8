"""The live view: per-shape progress from typed events, the run's clock (elapsed, left, ETA), shapes cut short and
notices as they happen, as a redrawn table or as whole lines."""

from __future__ import annotations

import dataclasses
import io
import time

import pytest
from rich.console import Console

from agent.config import RunConfig
from agent.events import BucketEndTimed, CandidateDone, Notice, RunStarted, ShapeCut, ShapeDone, ShapeStarted
from agent.loop import SearchLoop
from agent.proposers.builtin import BuiltinProposer
from agent.store import RunStore
from agent.view import LineView, LiveView, fmt_clock
from core.records import Candidate, EvalResult, Problem, Status, Timing

P, Q, R = Problem(64, 64, 64), Problem(128, 128, 128), Problem(256, 256, 256)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def console() -> Console:
    return Console(width=200, record=True, file=io.StringIO())


def text(renderable) -> str:
    c = console()
    c.print(renderable)
    return c.export_text()


def result(cid: str, us: float) -> EvalResult:
    return EvalResult(cid, Status.OK, warm=Timing(us, us, us, 10), cublas_warm=Timing(12.0, 12, 12, 10))


def test_events_are_typed_immutable_records():
    event = ShapeCut(P, 3, 16, "its time share was spent")
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.got = 4


def at(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(seconds))


def test_the_table_shows_elapsed_left_eta_and_why_a_shape_was_cut():
    clock, out = Clock(), console()
    view = LiveView("run x", out, clock=clock, wall=lambda: clock.now - 1000)  # the wall clock starts at 0
    view(RunStarted(3, 300.0, clock.now))
    view(ShapeStarted(P, 0, 100.0))
    c = Candidate(P, "naive", {})
    view(CandidateDone(P, c, None, result(c.id, 10.0)))
    view(ShapeCut(P, 1, 16, "its time share was spent (4 s of it kept for re-measurement)"))
    clock.now += 60
    view(ShapeDone(P, 1))
    # two more shapes at a minute each: the run ends at 3:00
    assert view.progress() == f"elapsed 1:00, left 4:00 of 5:00; 1 of 3 shapes done; ETA {at(180)}"
    table = text(view)
    assert "1 of 16: its time share was spent" in table and "1.200x" in table and "elapsed 1:00" in table
    assert "64_64_64:kn:f16: 1 of 16 candidates: its time share was spent" in out.export_text()  # said at once
    clock.now += 230
    assert view.progress().endswith(f"left 0:10 of 5:00; 1 of 3 shapes done; ETA {at(300)}")  # never past the budget
    assert fmt_clock(3725) == "1:02:05"


def test_lines_for_pipes_say_each_candidate_each_shape_done_and_each_notice():
    clock, out = Clock(), console()
    view = LineView("run y", out, clock=clock)
    view(RunStarted(2, 120.0, clock.now))
    view(ShapeStarted(Q, 2, 60.0))
    c = Candidate(Q, "naive", {})
    view(CandidateDone(Q, c, None, EvalResult(c.id, Status.WRONG, "wrong result")))
    view(Notice("llm", "LLM call (propose): endpoint failed: HTTP 500", Q))
    clock.now += 30
    view(ShapeDone(Q, 3))
    lines = out.export_text().splitlines()
    assert lines[0] == "run y"
    assert lines[1].startswith(f"128_128_128:kn:f16: {c.id} naive wrong wrong result")
    assert lines[2] == "128_128_128:kn:f16: LLM call (propose): endpoint failed: HTTP 500"
    assert lines[3].startswith("128_128_128:kn:f16 done (3 candidates); elapsed 0:30, left 1:30 of 2:00; 1 of 2")
    assert view.rows[Q.key].tried == 3 and view.rows[Q.key].fail == {"wrong": 1}


def test_the_loop_tells_the_view_when_the_budget_cuts_a_shape(tmp_path):
    def slow(job):
        from tests.helpers import fake_evaluate

        return dataclasses.replace(fake_evaluate(job), wall_s=2.0)

    events = []
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P, R])
    SearchLoop(store, RunConfig(budget_minutes=0.2, max_candidates=10), BuiltinProposer(), "sm_90a", slow,
               events.append).run([P, R])
    assert isinstance(events[0], RunStarted) and events[0].shapes == 2 and events[0].budget_s == 12.0
    cuts = [e for e in events if isinstance(e, ShapeCut)]
    assert cuts and all(e.asked == 10 and e.got < 10 and "time share was spent" in e.why for e in cuts)
    assert [e.problem for e in events if isinstance(e, ShapeDone)] == [P, R]
    assert sum(isinstance(e, CandidateDone) for e in events) == sum(len(store.results(p)) for p in (P, R))


def test_a_bucket_end_timing_is_a_line_of_its_own():
    out = console()
    view = LineView("run z", out, clock=Clock())
    bucket = Problem(21, 64, 64, m_range=(17, 24))
    c = Candidate(bucket, "naive", {})
    view(BucketEndTimed(bucket, c, 17, result(c.id, 10.0)))
    assert out.export_text().splitlines()[1] == f"17-24_64_64:kn:f16: {c.id} at the bucket's probe M=17: ok 1.200x"
