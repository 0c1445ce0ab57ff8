"""Progress events: what the search loop and the run's set-up tell the view as a run goes, one record a kind.

The loop calls an `Observer` with each; the views (agent/view.py) draw them, tests collect them. Nothing here is
stored: the run store keeps its own records and events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.records import BuildResult, Candidate, EvalResult, Problem


@dataclass(frozen=True)
class RunStarted:
    """The search begins: `shapes` problems in `budget_s` seconds, from `started` (time.monotonic())."""

    shapes: int
    budget_s: float
    started: float


@dataclass(frozen=True)
class ShapeStarted:
    """A problem's search begins with `share_s` seconds of its own; `resumed` candidates were recorded before."""

    problem: Problem
    resumed: int
    share_s: float


@dataclass(frozen=True)
class CandidateDone:
    """A candidate went through render, build and evaluation (or stopped at one of them: see the result)."""

    problem: Problem
    candidate: Candidate
    build: BuildResult | None
    result: EvalResult


@dataclass(frozen=True)
class Remeasured:
    """One of a shape's leaders measured again (successive halving)."""

    problem: Problem
    candidate: Candidate
    result: EvalResult


@dataclass(frozen=True)
class BucketEndTimed:
    """A bucket's leader re-checked and re-timed next to cuBLAS at one of the bucket's probe M, `m` (buckets.py)."""

    problem: Problem
    candidate: Candidate
    m: int
    result: EvalResult


@dataclass(frozen=True)
class Profiling:
    """Nsight Compute starts on one of a shape's leaders."""

    problem: Problem
    candidate: Candidate


@dataclass(frozen=True)
class ShapeCut:
    """A shape stopped proposing with `got` candidates (recorded and in flight) of the `asked` for, and why."""

    problem: Problem
    got: int
    asked: int
    why: str


@dataclass(frozen=True)
class ShapeDone:
    """A shape's search, re-measurement and profiles are over: `tried` candidates have results."""

    problem: Problem
    tried: int


@dataclass(frozen=True)
class Notice:
    """Something the user should see when it happens (an LLM call that failed, profiles switched off, the tuning
    database); `topic` names where it comes from, `problem` the shape it concerns, if one."""

    topic: str
    message: str
    problem: Problem | None = None


Event = (RunStarted | ShapeStarted | CandidateDone | Remeasured | BucketEndTimed | Profiling | ShapeCut | ShapeDone
         | Notice)
Observer = Callable[[Event], None]


def ignore(event: Event) -> None:
    """An observer that drops every event."""
