"""The search loop: propose -> render -> build -> evaluate -> record -> rank, under budgets, resumable.

Each candidate's records are written to the store as soon as they exist; on resume, candidates that already have
a result are loaded back (into the bandit and the proposer's view) instead of being redone.

With W GPUs the loop keeps up to 2W - 1 jobs in flight (candidates compiling or waiting for a GPU, re-measurements,
profiles): W on the GPUs and W - 1 compiled ahead. With one GPU that is one at a time, today's order exactly. Each
result is recorded, and the bandit updated, in this thread as it comes back, in submission order where several are
ready at once. Shapes take turns: the next shape starts proposing once the current one has proposed its last
candidate, so idle GPUs take its candidates while the previous shape's last evaluations, its re-measurement (successive
halving, round by round, a round's measurements at once) and its profiles finish. A shape's time budget is its share of
what is left when it starts, weighted by what its evaluations cost (agent/pace.py; shapes are searched cheapest first,
so what the small ones leave goes to the costly ones); it stops proposing early enough for its re-measurement and its
profiles (at most half of it: agent/profiles.py) to fit in that share too. A bucket of M (agent/buckets.py) starts from
its searched neighbour's leaders, with a smaller budget, then its leaders are re-timed at its probe M (in its share).

What happens is told to an observer as typed events (agent/events.py) as it happens: the view draws them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from agent import buckets
from agent.bandit import SuccessiveHalving
from agent.config import RunConfig
from agent.events import (
    BucketEndTimed,
    CandidateDone,
    Notice,
    Observer,
    Remeasured,
    RunStarted,
    ShapeCut,
    ShapeDone,
    ShapeStarted,
)
from agent.events import ignore as ignore_events
from agent.pace import Pace, follow_up_reserve, follow_up_words, remeasure_cost, share
from agent.profiles import PROFILE_TOP, LeaderProfiles
from agent.proposers.base import Proposer, SearchState, arm_of
from agent.store import RunStore, Winner
from core.device import H200, DeviceFacts
from core.records import BuildResult, Candidate, EvalJob, EvalResult, Problem, Status
from core.roofline import floor_us
from sandbox.build_pool import BuildPool
from sandbox.executor import Executor, InlineExecutor, Profiler
from templates import get_family

Done = Callable[[BuildResult | None, EvalResult], None]
REMEASURE_TOP = 4


@dataclass
class ShapeSummary:
    problem: Problem
    tried: int
    failures: dict[str, int]
    winner: Winner | None


@dataclass
class _Shape:
    """One problem's search while it runs: searching (proposing), then its follow-up (re-measure, profile)."""

    index: int  # its place in the run's list of problems
    problem: Problem
    state: SearchState
    deadline: float
    share_s: float
    phase: str = "search"  # -> "drain" (nothing more to propose) -> "follow-up" -> "done"
    jobs: int = 0  # its futures not yet handled: candidates, re-measurements, profiles
    halving: SuccessiveHalving | None = None
    leaders: dict[str, Candidate] = field(default_factory=dict)
    round_left: int = 0
    limit: int = 0  # candidates to try: the run's per-shape count, or a seeded bucket's budget
    seeds: list[Candidate] = field(default_factory=list)  # tried first: a bucket's neighbour's leaders
    ends: buckets.EndChecks | None = None


class SearchLoop:
    def __init__(self, store: RunStore, config: RunConfig, proposer: Proposer, arch: str,
                 evaluate: Executor | Callable[[EvalJob], EvalResult], observer: Observer | None = None,
                 profiler: Profiler | None = None, device: DeviceFacts = H200, builder: BuildPool | None = None,
                 ahead: BuildPool | None = None):
        self.store, self.config, self.proposer, self.arch, self.device = store, config, proposer, arch, device
        # a plain function is called in this thread, one job at a time; sandbox.executor.CompileOnly measures nothing
        self.executor = evaluate if isinstance(evaluate, Executor) else InlineExecutor(evaluate)
        measures = self.executor.measures
        self.builder = builder or BuildPool()
        # compiles the proposer's likely next candidates while the GPUs evaluate (None: not at all; compile-only
        # runs have no evaluation to overlap)
        self.ahead = ahead if measures else None
        # candidate id -> its problem, source and build, started ahead
        self._ahead: dict[str, tuple[Problem, str, Future]] = {}
        self._ahead_busy: list[Future] = []  # builds started ahead and not finished (stale ones too)
        self._upcoming: tuple[int, SearchState] | None = None  # the next shape's state, made before it begins
        self.observe = observer or ignore_events
        # no profiles where not wanted (config.profiles) or compiling only; switched off when ncu cannot profile
        self.profiles = LeaderProfiles(store, self.executor, profiler if measures and config.profiles else None,
                                       self.observe)
        self.remeasure_top = REMEASURE_TOP
        self.remeasure_ratios: list[float] = []  # each re-measurement's wall over its shape's mean first screen
        self.pending: dict[Future, tuple[int, _Shape | None, Callable]] = {}
        self._seq = itertools.count()

    # scheduling
    def run(self, problems: list[Problem]) -> list[ShapeSummary]:
        started = time.monotonic()
        deadline = started + self.config.budget_minutes * 60
        self.observe(RunStarted(len(problems), self.config.budget_minutes * 60, started))
        # cheapest first (by the roofline floor): what a shape leaves of its share goes to the shapes after it, so
        # the time small shapes do not need goes to the costly ones, whose evaluations take longest
        waiting = sorted(enumerate(problems), key=lambda item: floor_us(item[1], self.device))
        active, summaries, pace = [], {}, Pace(started, deadline)
        while waiting or active:
            for s in [s for s in active if s.jobs == 0 and s.phase != "search"]:
                if s.phase == "drain":
                    self._follow_up(s)
                if s.jobs == 0:  # nothing (more) to wait for
                    i = next(i for i, a in enumerate(active) if a is s)
                    summaries[s.index] = self._summary(active.pop(i))
                    if warning := pace.check(time.monotonic(), len(summaries), len(waiting)):
                        self.store.event("budget", warning)
                        self.observe(Notice("budget", warning))
            current = next((s for s in active if s.phase == "search"), None)
            if current is None and waiting and self._room():
                index, problem = waiting.pop(0)
                current = self._begin(index, problem, share(deadline - time.monotonic(), problem,
                                                            (p for _, p in waiting)))
                active.append(current)
            if current is not None:
                self._top_up(current)
                if current.phase != "search" and current.jobs == 0:
                    continue  # it ended with nothing in flight: settle it now
                self._compile_ahead(current.state)
            elif waiting:  # the last shape's follow-up holds the GPUs: the next shape's first settings compile now
                self._compile_ahead(self._next_state(*waiting[0]))
            if self.pending:
                self._wait()
        return [summaries[i] for i in range(len(problems))]

    def _depth(self) -> int:
        return 2 * self.executor.slots - 1

    def _room(self) -> bool:
        return len(self.pending) < self._depth()

    def _await(self, future: Future, shape: _Shape | None, then: Callable) -> None:
        if shape is not None:
            shape.jobs += 1
        self.pending[future] = (next(self._seq), shape, then)

    def _wait(self) -> None:
        """Handle what has come back (at least one), oldest submission first."""
        ready, _ = wait(list(self.pending), return_when=FIRST_COMPLETED)
        for future in sorted(ready, key=lambda f: self.pending[f][0]):
            _, shape, then = self.pending.pop(future)
            if shape is not None:
                shape.jobs -= 1
            then(future.result())  # raises WorkerUnavailable when no worker is left: the run stops, resumable

    # the search of one shape
    def restore(self, problem: Problem) -> SearchState:
        state = SearchState.start(problem, self.arch, self.config.seed, self.device)
        for c, r in self.store.results(problem):
            state.tried.append((c, self.store.build(c.id), r))
            state.bandit.update(arm_of(c), _reward(r))
            if (prof := self.store.profile(c.id)) is not None and prof.ok:
                state.profiles[c.id] = prof.summary
        return state

    def _next_state(self, index: int, problem: Problem) -> SearchState:
        """The search state of the shape to begin next, made once (its settings compile ahead before it begins)."""
        if self._upcoming is None or self._upcoming[0] != index or self._upcoming[1].problem != problem:
            self._upcoming = index, self.restore(problem)
        return self._upcoming[1]

    def _begin(self, index: int, problem: Problem, share_s: float) -> _Shape:
        # the last shape's builds started ahead and never proposed (still counted while busy) are forgotten
        self._ahead = {cid: v for cid, v in self._ahead.items() if v[0] == problem}
        state = self._next_state(index, problem)
        self._upcoming = None
        self.observe(ShapeStarted(problem, len(state.tried), share_s))
        seeds = buckets.seeds(self.store, problem)
        return _Shape(index, problem, state, time.monotonic() + share_s, share_s,
                      limit=buckets.budget(self.config.max_candidates, bool(seeds)), seeds=seeds)

    def _top_up(self, s: _Shape) -> None:
        """Propose while there is room in flight, until the shape's budget or candidates run out."""
        while s.phase == "search" and self._room():
            left = s.limit - len(s.state.tried) - len(s.state.pending)
            reserve = self._follow_up_reserve(s)
            if left <= 0 or time.monotonic() + reserve >= s.deadline:
                if left > 0:  # where a shape's time went, for runs that give some shapes few candidates
                    self.store.event("budget", f"{s.problem.key}: time share spent after {len(s.state.tried)} "
                                     f"candidates ({len(s.state.pending)} in flight); {reserve:.1f} s kept for "
                                     f"{self._follow_up_words(s)}")
                    self._cut(s, f"its time share was spent ({reserve:.0f} s of it kept for "
                                 f"{self._follow_up_words(s)})")
                s.phase = "drain"
                return
            n = min(left, self._depth() - len(self.pending))
            batch = [c for c in s.seeds if c.id not in s.state.tried_ids][:n] or self.proposer.propose(s.state, n=n)
            for call in self.proposer.take_calls():  # kept for `show --llm`, with what became of each proposal
                self.store.add_model_call(call)
                if call.error:
                    self.observe(Notice("llm", f"LLM call ({call.purpose}): {call.error}", s.problem))
            if not batch:
                self.store.event("search", f"{s.problem.key}: the proposer has nothing left to try")
                self._cut(s, "the proposer had nothing left to try")
                s.phase = "drain"
                return
            self.store.set_meta("proposer_stats", self.proposer.stats())
            for cand in batch[:left]:
                s.state.pending.add(cand.id)
                self._launch(cand, s, lambda build, result, cand=cand: self._searched(s, cand, build, result))

    def _compile_ahead(self, state: SearchState) -> None:
        """Start compiling what the proposer is likely to propose next for the shape (the one searching, or the next
        one while the last one's follow-up runs), at most one build a process of the ahead pool at a time: with one
        GPU NVRTC then runs while the GPU evaluates instead of between evaluations. What is proposed, and in which
        order, does not depend on it."""
        if self.ahead is None:
            return
        self._ahead_busy = [f for f in self._ahead_busy if not f.done()]
        for c in self.proposer.upcoming(state):
            if len(self._ahead_busy) >= max(1, self.ahead.processes):
                return
            if c.id in self._ahead:
                continue
            try:
                source = get_family(c.family).render(c.params, c.problem, c.template_override)
            except Exception:  # the candidate's own launch records why
                continue
            build = self.ahead.submit(source, self.arch, c.id, self.config.compile_timeout_s)
            self._ahead[c.id] = state.problem, source, build
            if not build.done():
                self._ahead_busy.append(build)

    def _cut(self, s: _Shape, why: str) -> None:
        got = len(s.state.tried) + len(s.state.pending)
        if got < s.limit:
            self.observe(ShapeCut(s.problem, got, s.limit, why))

    def _follow_up_words(self, s: _Shape) -> str:
        return follow_up_words(s.problem.m_range is not None and self.executor.measures, self.profiles.on)

    @staticmethod
    def _walls(s: _Shape) -> list[float]:
        return [r.wall_s for _, _, r in s.state.tried if r.status is Status.OK and r.wall_s > 0]

    def _follow_up_reserve(self, s: _Shape) -> float:
        walls = self._walls(s)
        probes = len(buckets.probe_ms(s.problem)) if s.problem.m_range is not None and self.executor.measures else 0
        return follow_up_reserve(walls, self.executor.slots, self.remeasure_top, probes,
                                 self.profiles.reserve_s(s) if walls else 0.0,  # no store query before
                                 remeasure_cost(self.remeasure_ratios))

    def _searched(self, s: _Shape, cand: Candidate, build: BuildResult | None, result: EvalResult) -> None:
        s.state.pending.discard(cand.id)
        s.state.tried.append((cand, build, result))
        s.state.bandit.update(arm_of(cand), _reward(result))
        self.observe(CandidateDone(s.problem, cand, build, result))
        if self.profiles.on and len(s.state.tried) == s.limit // 2:
            # so that the second half's prompts see the leader's profile
            self.profiles.start(s, [c for c, _ in self.store.leaders(s.problem)[:1]], self._await)

    def _follow_up(self, s: _Shape) -> None:
        """Successive halving over the leaders, so that one lucky timing does not decide the winner; then profiles."""
        s.phase = "follow-up"
        if time.monotonic() >= s.deadline + 60:
            return
        s.leaders = {c.id: c for c, _ in self.store.leaders(s.problem)[:self.remeasure_top]}
        if not s.leaders:
            self._settle(s)
            return
        scores = {cid: [1 / v for v in self.store.speedups(cid)] for cid in s.leaders}  # lower is better
        s.halving = SuccessiveHalving(list(s.leaders), scores)
        self._remeasure_round(s)

    def _remeasure_round(self, s: _Shape) -> None:
        items = s.halving.next_round()
        if not items:
            winner = s.halving.winner
            if winner is not None:
                self.store.set_winner(s.problem, winner)
            self.store.event("remeasure", f"{s.problem.key}: winner after re-measurement {winner}")
            self._settle(s)
            return
        s.round_left = len(items)
        for cid in items:
            c = s.leaders[cid]
            job = EvalJob.built(cid, s.problem, c.family, c.params, self.store.build(cid),
                                timeout_s=self.config.kernel_timeout_s, honest=True, honest_only=True)
            self._await(self.executor.submit(job), s, lambda r, cid=cid: self._remeasured(s, cid, r))

    def _remeasured(self, s: _Shape, cid: str, r: EvalResult) -> None:
        self.observe(Remeasured(s.problem, s.leaders[cid], r))
        if r.status is Status.OK:
            self.store.add_measurement(r)
            if (walls := self._walls(s)) and r.wall_s > 0:
                self.remeasure_ratios.append(r.wall_s * len(walls) / sum(walls))
        else:
            self.store.event("remeasure", f"{r.candidate_id} failed on re-measurement: {r.status.value} {r.reason}")
            self.store.add_result(r)  # a candidate that fails once is not a winner
        # ranked on honest re-measurements alone: the first screen's warm times only chose the leaders
        s.halving.record(cid, 1 / r.speedup if r.status is Status.OK else None, replace=True)
        s.round_left -= 1
        if s.round_left == 0:
            self._remeasure_round(s)

    def _settle(self, s: _Shape) -> None:
        """After the re-measurement: a bucket's leaders re-timed at its probe M (agent.buckets.EndChecks); then
        profiles."""
        if s.problem.m_range is not None and s.ends is None and self.executor.measures:
            s.ends = buckets.EndChecks(self.store, s.problem, self.config.kernel_timeout_s)
        jobs = s.ends.next_jobs() if s.ends is not None else []
        if not jobs:
            self.profiles.start(s, [c for c, _ in self.store.leaders(s.problem)[:PROFILE_TOP]], self._await)
            return
        s.round_left = len(jobs)
        for job in jobs:
            self._await(self.executor.submit(job), s, lambda r, job=job: self._end_timed(s, job, r))

    def _end_timed(self, s: _Shape, job: EvalJob, r: EvalResult) -> None:
        self.observe(BucketEndTimed(s.problem, self.store.candidate(job.candidate_id), job.problem.m, r))
        s.ends.record(job, r)
        s.round_left -= 1
        if s.round_left == 0:
            self._settle(s)

    def _summary(self, s: _Shape) -> ShapeSummary:
        s.phase = "done"
        self.observe(ShapeDone(s.problem, len(s.state.tried)))
        return ShapeSummary(s.problem, len(s.state.tried), self.store.failure_counts(s.problem),
                            self.store.winner(s.problem))

    # one candidate: render -> build -> evaluate, every outcome recorded
    def process(self, cand: Candidate) -> tuple[BuildResult | None, EvalResult]:
        """One candidate through render, build and evaluate, waiting for it; every outcome is recorded, none raises."""
        out: list[tuple[BuildResult | None, EvalResult]] = []
        self._launch(cand, None, lambda build, result: out.append((build, result)))
        while not out:
            self._wait()
        return out[0]

    def _launch(self, cand: Candidate, s: _Shape | None, then: Done) -> None:
        self.store.add_candidate(cand)
        _, source, ahead = self._ahead.pop(cand.id, (None, None, None))  # rendered when its build started ahead
        try:
            source = source or get_family(cand.family).render(cand.params, cand.problem, cand.template_override)
        except Exception as e:  # invalid parameters, or an edited template that does not render
            then(None, self._record(EvalResult(cand.id, Status.INVALID, f"{type(e).__name__}: {e}"[:500])))
            return
        if ahead is None:
            build = self.builder.submit(source, self.arch, cand.id, self.config.compile_timeout_s)
            self._await(build, s, lambda b: self._built(cand, s, b, then))
            return

        def built_ahead(b: BuildResult) -> None:
            if b.ok:
                self._built(cand, s, b, then)
            else:  # a compile ahead that failed (its process died, a timeout under load) is not the verdict
                again = self.builder.submit(source, self.arch, cand.id, self.config.compile_timeout_s)
                self._await(again, s, lambda b: self._built(cand, s, b, then))

        if ahead.done():  # built while the GPU evaluated: to the GPU at once (a build pool's future never raises)
            built_ahead(ahead.result())
        else:
            self._await(ahead, s, built_ahead)

    def _built(self, cand: Candidate, s: _Shape | None, build: BuildResult, then: Done) -> None:
        self.store.add_build(build)
        if not build.ok:
            then(build, self._record(EvalResult(cand.id, Status.COMPILE_ERROR, build.error)))
            return
        if build.spill_bytes:
            self.store.event("build", f"{cand.id}: {build.spill_bytes} bytes of register spills")
        job = EvalJob.built(cand.id, cand.problem, cand.family, cand.params, build,
                            timeout_s=self.config.kernel_timeout_s)
        self._await(self.executor.submit(job), s, lambda r: then(build, self._record(r)))

    # recording: a candidate's first result reaches the store here (a re-measurement's: `_remeasured`)
    def _record(self, result: EvalResult) -> EvalResult:
        self.store.add_result(result)
        if result.status is Status.OK:
            self.store.add_measurement(result)
        return result


def _reward(r: EvalResult) -> float | None:
    if r.status is Status.SKIPPED:
        return 0.0  # compile-only: no signal either way
    return math.log(r.speedup) if r.speedup else None
