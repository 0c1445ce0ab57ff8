"""A run's time: each shape's share of it, what a shape keeps back from its share for its follow-up, and whether the
budget reaches every shape (after a few shapes, the pace so far against the shapes still waiting).

A shape's share is the time left weighted by what its candidates cost to evaluate against the shapes still waiting
(`share`): an evaluation's time grows with the bytes of its operands (every check and timing mode fills, copies and
verifies them), so equal seconds a shape would give a 2-GB weight about half the candidates a small shape gets.

A shape stops proposing once the time left in its share is what its follow-up needs (`follow_up_reserve`), so that
the follow-up is charged to it and not to the shapes after it.

Shapes are searched cheapest first, and each takes at least its first candidate and its follow-up however small its
share; a budget too short for the list leaves the last (the costliest) shapes with nothing. `Pace` says so once, as
soon as it shows: how many of the waiting shapes the time left reaches at the pace so far (an upper bound: later
shapes cost more), and a budget that would reach them all at that pace (a lower bound).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from core.records import Problem

MIN_DONE = 3  # shapes finished before the pace is judged
# Operand bytes that add one small shape's evaluation time to a candidate's (docs/decisions.md `cost-shares`)
WEIGHT_BYTES = 1.7e9
SLACK = 1.25  # the waiting shapes must need this much more than the time left


class Pace:
    def __init__(self, started: float, deadline: float):
        self.started, self.deadline = started, deadline
        self.said = False

    def check(self, now: float, done: int, waiting: int) -> str | None:
        """The warning, once, where the waiting shapes need more than the time left at the pace so far; else None."""
        if self.said or done < MIN_DONE or not waiting:
            return None
        per = (now - self.started) / done
        left = max(self.deadline - now, 0.0)
        if per * waiting <= SLACK * left:
            return None
        self.said = True
        reach = int(left / per) if per > 0 else waiting
        minutes = math.ceil((now - self.started + per * waiting) / 60 * 10) / 10
        return (f"at {per:.1f} s a shape so far, the {left / 60:.1f} minutes left reach at most about {reach} of the "
                f"{waiting} shapes still waiting (the costliest come last and get no candidate); --budget-minutes "
                f"{minutes:g} or more would reach them all")


def weight(problem: Problem) -> float:
    """A candidate's evaluation time relative to a small shape's: 1 + its operand bytes over WEIGHT_BYTES."""
    return 1.0 + problem.operand_bytes / WEIGHT_BYTES


def share(left_s: float, problem: Problem, waiting: Iterable[Problem]) -> float:
    """The seconds of `left_s` the shape beginning now gets: its weight's part of its own and the waiting shapes'."""
    mine = weight(problem)
    return max(left_s, 0.0) * mine / (mine + sum(weight(p) for p in waiting))


def follow_up_reserve(walls: list[float], slots: int, remeasure_top: int, probes: int, profiles_s: float,
                      remeasure_cost: float = 1.0) -> float:
    """Seconds to keep back for a shape's follow-up, given the wall times of its evaluations so far (none: nothing
    kept): successive halving over k leaders measures k + ceil(k / 2) times, each `remeasure_cost` times the mean
    evaluation time (what re-measurements have cost so far against their shapes' first screens), spread over the
    GPUs; a bucket's winner is then timed at each of its `probes` M; then the leaders' profiles (`profiles_s`)."""
    if not walls:
        return 0.0
    mean = sum(walls) / len(walls) / slots
    reserve = profiles_s + probes * mean
    if len(walls) >= 2:
        leaders = min(remeasure_top, len(walls))
        reserve += (leaders + (leaders + 1) // 2) * mean * remeasure_cost
    return reserve


def remeasure_cost(ratios: list[float]) -> float:
    """A re-measurement's wall time over its shape's mean first-screen evaluation, from the run's re-measurements so
    far (their median; 1 before any, and never below a quarter)."""
    return max(0.25, statistics.median(ratios)) if ratios else 1.0


def follow_up_words(probes: bool, profiles: bool) -> str:
    """What the reserve is kept for, in words."""
    words = ["re-measurement"] + ["probe timings"] * probes + ["profiles"] * profiles
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
