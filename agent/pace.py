"""Whether a run's budget reaches every shape: after a few shapes, the pace so far against the shapes still waiting.

Shapes are searched cheapest first, and each takes at least its first candidate and its follow-up however small its
share; a budget too short for the list leaves the last (the costliest) shapes with nothing. `Pace` says so once, as
soon as it shows: how many of the waiting shapes the time left reaches at the pace so far (an upper bound: later
shapes cost more), and a budget that would reach them all at that pace (a lower bound).
"""

from __future__ import annotations

import math

MIN_DONE = 3  # shapes finished before the pace is judged
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
