"""agent.pace: what a shape keeps back from its share for its follow-up, and a run that says once, early, when its
budget cannot reach every shape at the pace so far."""

from __future__ import annotations

import dataclasses

from agent.config import RunConfig
from agent.events import Notice
from agent.loop import SearchLoop
from agent.pace import WEIGHT_BYTES, Pace, follow_up_reserve, follow_up_words, remeasure_cost, share, weight
from agent.proposers.builtin import BuiltinProposer
from agent.store import RunStore
from core.records import Problem
from tests.helpers import fake_evaluate


def test_the_pace_is_judged_after_three_shapes_and_said_once():
    pace = Pace(started=0.0, deadline=300.0)
    assert pace.check(now=20.0, done=2, waiting=100) is None  # too early to tell
    assert pace.check(now=30.0, done=3, waiting=20) is None  # 20 x 10 s fit in 270 s
    said = pace.check(now=30.0, done=3, waiting=100)  # 100 x 10 s do not
    assert said.startswith("at 10.0 s a shape so far, the 4.5 minutes left reach at most about 27 of the 100 shapes")
    assert said.endswith("--budget-minutes 17.2 or more would reach them all")
    assert pace.check(now=40.0, done=4, waiting=99) is None  # once


def test_a_share_is_weighted_by_the_operand_bytes_of_the_shape_and_the_waiting_ones():
    small, big = Problem(256, 2304, 768), Problem(8, 128256, 8192)  # about 5 MB and 2.1 GB of operands
    assert weight(small) < 1.01 and weight(big) == 1.0 + big.operand_bytes / WEIGHT_BYTES
    assert share(100.0, small, [small] * 3) == 25.0  # equal shapes: equal parts
    assert share(100.0, small, [big]) == 100.0 * weight(small) / (weight(small) + weight(big))
    assert share(100.0, big, [small]) > 2 * share(100.0, small, [big])  # the costly shape, more seconds
    assert share(-5.0, small, [big]) == 0.0


def test_a_run_too_short_for_its_shapes_says_so(tmp_path):
    import time

    problems = [Problem(64 * (i + 1), 64, 64) for i in range(12)]
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems(problems)
    seen = []
    SearchLoop(store, RunConfig(budget_minutes=0.02, max_candidates=2), BuiltinProposer(), "sm_90a",
               lambda j: time.sleep(0.15) or dataclasses.replace(fake_evaluate(j), wall_s=0.15),
               seen.append).run(problems)
    notices = [e.message for e in seen if isinstance(e, Notice) and e.topic == "budget"]
    assert len(notices) == 1 and "shapes still waiting" in notices[0]
    assert [m for _, kind, m in store.events() if kind == "budget" and "still waiting" in m] == notices


def test_the_follow_up_reserve_counts_re_measurement_probes_and_profiles():
    assert follow_up_reserve([], 1, 4, 5, 3.0) == 0.0  # nothing measured yet: nothing to go by
    assert follow_up_reserve([2.0], 1, 4, 0, 0.0) == 0.0  # one candidate: no re-measurement
    assert follow_up_reserve([2.0], 1, 4, 5, 0.0) == 10.0  # a bucket: its winner at five probe M
    assert follow_up_reserve([2.0, 2.0, 2.0, 2.0, 2.0], 1, 4, 0, 0.0) == 12.0  # 4 leaders: 6 measurements
    assert follow_up_reserve([2.0, 2.0], 2, 4, 5, 1.5) == 1.5 + 5 + 3  # two GPUs share the measurements
    # re-measurements that cost half a first screen: half the halving's time kept, the probes' as before
    assert follow_up_reserve([2.0] * 5, 1, 4, 5, 0.0, remeasure_cost=0.5) == 10.0 + 6.0
    assert follow_up_words(False, False) == "re-measurement"
    assert follow_up_words(True, True) == "re-measurement, probe timings and profiles"


def test_what_re_measurements_cost_is_learned_from_the_run():
    assert remeasure_cost([]) == 1.0  # nothing yet: as much as a first screen
    assert remeasure_cost([0.5, 0.4, 0.9]) == 0.5  # the median
    assert remeasure_cost([0.05]) == 0.25  # never below a quarter


def test_the_loop_measures_what_its_re_measurements_cost(tmp_path):
    """First screens of 2 s, re-measurements (the honest timing alone) of 1 s: the run learns 0.5."""
    def timed(job):
        return dataclasses.replace(fake_evaluate(job), wall_s=1.0 if job.honest_only else 2.0)

    problems = [Problem(1000, 3000, 2000), Problem(64, 64, 64, "nk")]
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems(problems)
    loop = SearchLoop(store, RunConfig(max_candidates=4), BuiltinProposer(), "sm_90a", timed)
    loop.run(problems)
    assert loop.remeasure_ratios and set(loop.remeasure_ratios) == {0.5}
