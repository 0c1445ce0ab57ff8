"""sandbox/timing.py on the CPU: the CUPTI rounds' order (the graph replays themselves need a GPU: test_sandbox_gpu)."""

from __future__ import annotations

import pytest

from sandbox import timing
from sandbox.timing import CUPTI_ROUNDS, Subject, cupti_median, cupti_rounds


def test_cupti_rounds_reverse_the_subjects_order_every_other_round_and_prepare_each_replay(monkeypatch):
    calls: list[str] = []
    per_launch = {"candidate": 10.0, "cublas": 12.0}

    def fake_cupti(graph, launches):
        calls.append(graph)
        return per_launch[graph] + len(calls)  # a clock drifting by 1 µs a replay

    monkeypatch.setattr(timing, "cupti_us", fake_cupti)
    prepared: list[str] = []
    subjects = {name: Subject(lambda i: None, 4, before_replay=lambda name=name: prepared.append(name))
                for name in per_launch}
    out = cupti_rounds(subjects, {name: name for name in subjects})
    assert calls == (["candidate", "cublas", "cublas", "candidate"] * CUPTI_ROUNDS)[:2 * CUPTI_ROUNDS]
    assert prepared == calls
    # a drift linear in time falls on both alike: the figures keep the subjects' own difference
    figures = {name: cupti_median(v) for name, v in out.items()}
    assert figures["cublas"] - figures["candidate"] == pytest.approx(per_launch["cublas"] - per_launch["candidate"])


def test_a_profiler_that_cannot_start_leaves_the_subject_without_a_cupti_figure(monkeypatch):
    monkeypatch.setattr(timing, "cupti_us", lambda graph, launches: None if graph == "b" else 5.0)
    out = cupti_rounds({n: Subject(lambda i: None, 1) for n in "ab"}, {"a": "a", "b": "b"})
    assert out == {"a": [5.0] * CUPTI_ROUNDS, "b": [None] * CUPTI_ROUNDS}
    assert cupti_median(out["a"]) == 5.0 and cupti_median(out["b"]) is None


def test_one_replay_caught_at_another_clock_does_not_move_the_figure():
    assert cupti_median([1416.0, 1417.0, 1586.0, 1419.0, 1418.0, 1523.0]) == pytest.approx(1418.5)
    assert cupti_median([]) is None
