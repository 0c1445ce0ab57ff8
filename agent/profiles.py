"""Nsight Compute profiles of each shape's leaders, for the LLM's prompts and `show`: one after the other, charged to
the shape's time share, switched off for the run when ncu cannot profile or keeps failing."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from agent.events import Notice, Observer, Profiling
from agent.proposers.base import SearchState
from agent.store import RunStore
from core.records import Candidate, EvalJob, Problem, ProfileResult
from sandbox.executor import Executor, Profiler
from sandbox.profile import NCU_MISSING, NO_COUNTERS

PROFILE_TOP = 2  # leaders profiled at the end of a shape's search
PROFILE_GUESS_S = 10.0  # what a profile is taken to cost before the run has timed one
# Profiles take at most this part of a shape's time share; where not one fits, the shape is searched without any
# (docs/decisions.md, "Nsight Compute profiles only where something reads them")
PROFILE_SHARE = 0.5

# the loop's way of waiting for a future on a shape's behalf: (future, shape, what to do with its result)
Await = Callable[[Future, Any, Callable[[Any], None]], None]


class Shape(Protocol):
    """What profiling needs of a shape the loop is searching."""

    problem: Problem
    deadline: float  # time.monotonic() at which its share is spent
    share_s: float  # the seconds of the run the shape was given
    state: SearchState


class LeaderProfiles:
    def __init__(self, store: RunStore, executor: Executor, profiler: Profiler | None, observe: Observer):
        self.store, self.executor, self.observe = store, executor, observe
        self.profiler = profiler  # None: no profiles (not wanted, compile only, or switched off)
        self.failures = 0  # in a row
        self.walls: list[float] = []  # seconds each profile took, submission to result
        self.started: dict[str, int] = {}  # profiles started, by problem key

    @property
    def on(self) -> bool:
        return self.profiler is not None

    @property
    def each_s(self) -> float:
        """What a profile is taken to cost: the run's mean so far, PROFILE_GUESS_S before the first."""
        return sum(self.walls) / len(self.walls) if self.walls else PROFILE_GUESS_S

    def allowed(self, s: Shape) -> int:
        """Profiles the shape may still start: as many as fit PROFILE_SHARE of its share, less those started."""
        return max(0, int(PROFILE_SHARE * s.share_s // self.each_s) - self.started.get(s.problem.key, 0))

    def reserve_s(self, s: Shape) -> float:
        """Seconds the profiles of the shape's leaders not yet profiled will take, one after the other, at most as
        many as it may still start; 0 when profiling is off."""
        if not self.on:
            return 0.0
        todo = sum(self.store.profile(c.id) is None for c, _ in self.store.leaders(s.problem)[:PROFILE_TOP])
        return min(todo, self.allowed(s)) * self.each_s

    def start(self, s: Shape, todo: list[Candidate], await_: Await) -> None:
        """Profile the first of `todo` not yet profiled, then the next when it is done; none once the shape's share
        is spent or its profiles would take more than PROFILE_SHARE of it."""
        while todo and self.profiler is not None:
            c = todo.pop(0)
            if self.store.profile(c.id) is not None:
                continue
            why = (f"a profile (~{self.each_s:.0f} s) would take more than {PROFILE_SHARE:.0%} of the shape's "
                   f"{s.share_s:.0f} s share" if not self.allowed(s) else
                   "the shape's time share is spent" if time.monotonic() >= s.deadline else None)
            if why:
                self.store.event("profile", f"{s.problem.key}: {c.id} not profiled: {why}")
                return
            self.started[s.problem.key] = self.started.get(s.problem.key, 0) + 1
            self.observe(Profiling(s.problem, c))
            job = EvalJob(c.id, s.problem, c.family, c.params, self.store.build(c.id).cubin)
            started = time.monotonic()
            await_(self.executor.profile(self.profiler, job), s,
                   lambda prof, c=c, t0=started: self._profiled(s, c, prof, todo, await_, time.monotonic() - t0))
            return

    def _profiled(self, s: Shape, c: Candidate, prof: ProfileResult, todo: list[Candidate], await_: Await,
                  wall_s: float) -> None:
        if self.profiler is None:  # switched off while this one ran
            return
        if not prof.ok and prof.error.startswith((NCU_MISSING, NO_COUNTERS)):
            why = "ncu not found" if prof.error.startswith(NCU_MISSING) else prof.error
            self._off(f"profiling skipped: {why}")  # said once per run, not once per shape
            return
        self.walls.append(wall_s)
        self.store.add_profile(c.id, prof)
        self.failures = 0 if prof.ok else self.failures + 1
        if prof.ok:
            s.state.profiles[c.id] = prof.summary
        else:
            self.store.event("profile", f"{c.id}: {prof.error[:300]}")
            if self.failures >= 2:  # a broken ncu costs its timeout every time: stop paying it
                self._off("profiling skipped: two profiles in a row failed")
        self.start(s, todo, await_)

    def _off(self, message: str) -> None:
        self.store.event("profile", message)
        self.observe(Notice("profile", message))
        self.profiler = None
