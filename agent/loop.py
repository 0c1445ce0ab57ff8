"""The search loop: propose -> render -> build -> evaluate -> record -> rank, under budgets, resumable.

Each candidate's records are written to the store as soon as they exist; on resume, candidates that already have
a result are loaded back (into the bandit and the proposer's view) instead of being redone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.bandit import ThompsonBandit, successive_halving
from agent.config import RunConfig
from agent.proposers.base import Proposer, SearchState, arm_of
from agent.store import RunStore, Winner
from core.device import H200, DeviceFacts
from core.records import BuildResult, Candidate, EvalJob, EvalResult, Problem, ProfileResult, Status
from sandbox.build import compile_cuda
from sandbox.profile import NCU_MISSING, NO_COUNTERS
from templates import get_family

Observer = Callable[[str, dict], None]
Profiler = Callable[[bytes, str, dict, Problem], ProfileResult]  # sandbox.profile.profile_candidate
REMEASURE_TOP = 4
PROFILE_TOP = 2


@dataclass
class ShapeSummary:
    problem: Problem
    tried: int
    failures: dict[str, int]
    winner: Winner | None


class SearchLoop:
    def __init__(self, store: RunStore, config: RunConfig, proposer: Proposer, arch: str,
                 evaluate: Callable[[EvalJob], EvalResult] | None, observer: Observer | None = None,
                 profiler: Profiler | None = None, device: DeviceFacts = H200):
        self.store, self.config, self.proposer, self.arch, self.device = store, config, proposer, arch, device
        self.evaluate = evaluate  # None: compile only
        self.observe = observer or (lambda kind, data: None)
        # None, compile-only or --no-profile: no profiles; switched off for the run when ncu cannot profile
        self.profiler = profiler if evaluate is not None and config.profile else None
        self.profile_failures = 0  # in a row

    def run(self, problems: list[Problem]) -> list[ShapeSummary]:
        deadline = time.monotonic() + self.config.budget_minutes * 60
        summaries = []
        for i, problem in enumerate(problems):
            share = (deadline - time.monotonic()) / (len(problems) - i)
            summaries.append(self.search(problem, time.monotonic() + max(share, 0.0)))
        return summaries

    def restore(self, problem: Problem) -> SearchState:
        state = SearchState(problem, self.arch, ThompsonBandit(seed=self.config.seed), device=self.device)
        for c, r in self.store.results(problem):
            state.tried.append((c, self.store.build(c.id), r))
            state.bandit.update(arm_of(c), _reward(r))
            if (prof := self.store.profile(c.id)) is not None and prof.ok:
                state.profiles[c.id] = prof.summary
        return state

    def search(self, problem: Problem, deadline: float) -> ShapeSummary:
        state = self.restore(problem)
        self.observe("shape", {"problem": problem, "resumed": len(state.tried)})
        while len(state.tried) < self.config.max_candidates and time.monotonic() < deadline:
            batch = self.proposer.propose(state, n=1)
            for call in self.proposer.take_calls():  # kept for `show --llm`, with what became of each proposal
                self.store.add_model_call(call)
            if not batch:
                self.store.event("search", f"{problem.key}: the proposer has nothing left to try")
                break
            self.store.set_meta("proposer_stats", self.proposer.stats())
            for cand in batch:
                build, result = self.process(cand)
                state.tried.append((cand, build, result))
                state.bandit.update(arm_of(cand), _reward(result))
                self.observe("result", {"problem": problem, "candidate": cand, "build": build, "result": result})
            if self.profiler and len(state.tried) == self.config.max_candidates // 2 and time.monotonic() < deadline:
                self.profile_leaders(problem, state, 1)  # so that the second half's prompts see the leader's profile
        if self.evaluate is not None and time.monotonic() < deadline + 60:
            self.remeasure(problem)
            self.profile_leaders(problem, state, PROFILE_TOP)
        return ShapeSummary(problem, len(state.tried), self.store.failure_counts(problem),
                            self.store.winner(problem))

    def process(self, cand: Candidate) -> tuple[BuildResult | None, EvalResult]:
        """One candidate through render, build and evaluate; every outcome is recorded, none raises."""
        self.store.add_candidate(cand)
        family = get_family(cand.family)
        try:
            source = family.render(cand.params, cand.problem, cand.template_override)
        except Exception as e:  # invalid parameters, or an edited template that does not render
            return None, self._record(EvalResult(cand.id, Status.INVALID, f"{type(e).__name__}: {e}"[:500]))
        build = compile_cuda(source, self.arch, candidate_id=cand.id, timeout_s=self.config.compile_timeout_s)
        self.store.add_build(build)
        if not build.ok:
            return build, self._record(EvalResult(cand.id, Status.COMPILE_ERROR, build.error))
        if build.spill_bytes:
            self.store.event("build", f"{cand.id}: {build.spill_bytes} bytes of register spills")
        if self.evaluate is None:
            return build, self._record(EvalResult(cand.id, Status.SKIPPED, "compile only"))
        job = EvalJob(cand.id, cand.problem, cand.family, cand.params, build.cubin,
                      timeout_s=self.config.kernel_timeout_s)
        return build, self._record(self.evaluate(job))

    def _record(self, result: EvalResult) -> EvalResult:
        self.store.add_result(result)
        if result.status is Status.OK:
            self.store.add_measurement(result)
        return result

    def remeasure(self, problem: Problem) -> None:
        """Successive halving over the leaders, so that one lucky timing does not decide the winner."""
        leaders = {c.id: c for c, _ in self.store.leaders(problem)[:REMEASURE_TOP]}
        if len(leaders) < 2:
            return
        scores = {cid: self.store.speedups(cid) for cid in leaders}
        scores = {cid: [1 / s for s in v] for cid, v in scores.items()}  # lower is better

        def measure(cid: str) -> float | None:
            c = leaders[cid]
            build = self.store.build(cid)
            job = EvalJob(cid, problem, c.family, c.params, build.cubin, timeout_s=self.config.kernel_timeout_s)
            r = self.evaluate(job)
            self.observe("remeasure", {"problem": problem, "candidate": c, "result": r})
            if r.status is not Status.OK:
                self.store.event("remeasure", f"{cid} failed on re-measurement: {r.status.value} {r.reason}")
                self.store.add_result(r)  # a candidate that fails once is not a winner
                return None
            self.store.add_measurement(r)
            return 1 / r.speedup

        winner = successive_halving(list(leaders), measure, scores)
        if winner is not None:
            self.store.set_winner(problem, winner)
        self.store.event("remeasure", f"{problem.key}: winner after re-measurement {winner}")

    def profile_leaders(self, problem: Problem, state: SearchState, top: int) -> None:
        """Nsight Compute's view of the shape's leaders (by median speed-up), kept for `show` and the prompts."""
        for c, _ in self.store.leaders(problem)[:top]:
            if self.profiler is None:
                return
            if self.store.profile(c.id) is not None:
                continue
            self.observe("profile", {"problem": problem, "candidate": c})
            prof = self.profiler(self.store.build(c.id).cubin, c.family, c.params, problem)
            if not prof.ok and prof.error.startswith((NCU_MISSING, NO_COUNTERS)):
                why = "ncu not found" if prof.error.startswith(NCU_MISSING) else prof.error
                self.store.event("profile", f"profiling skipped: {why}")
                self.profiler = None  # said once per run, not once per shape
                return
            self.store.add_profile(c.id, prof)
            self.profile_failures = 0 if prof.ok else self.profile_failures + 1
            if prof.ok:
                state.profiles[c.id] = prof.summary
                continue
            self.store.event("profile", f"{c.id}: {prof.error[:300]}")
            if self.profile_failures >= 2:  # a broken ncu costs its timeout every time: stop paying it
                self.store.event("profile", "profiling skipped: two profiles in a row failed")
                self.profiler = None


def _reward(r: EvalResult) -> float | None:
    if r.status is Status.SKIPPED:
        return 0.0  # compile-only: no signal either way
    return math.log(r.speedup) if r.speedup else None
