"""The built-in proposer: walks each family's parameter space, with the bandit choosing the family to try next.

An arm is a family; within it, settings are tried in the family's own order (its cost model's best guesses
first), or in the learned cost model's order where the tuning database holds enough measurements of the family on
this GPU model (a run's `Learner` retrains as the run measures new problems), which then also sets the arm's
prior, held to a roofline of each family's reach on the device (`roofline_priors`), which alone sets the prior
where the model sets none.
`RandomProposer` draws uniformly from the same space: the baseline the bandit must beat.
"""

from __future__ import annotations

import math
import random

from agent.cost_model import CostModel, Learner
from agent.proposers.base import Proposer, SearchState, arm_of
from core.device import DeviceFacts
from core.records import Candidate, Problem
from core.roofline import floor_us
from templates import families_for_arch
from templates.family import Family

# The roofline prior: a launch's fixed cost, and how sure the prior is (as sure as one measurement: the arm's first
# results soon outweigh it; the roofline's own error in log speed-up). docs/decisions.md `tensor-share`.
LAUNCH_US = 0.5
ROOFLINE_SD = 0.3
# How far above its roofline the learned model may rate a family (docs/decisions.md `tensor-share`)
ROOFLINE_SLACK = 0.1
# Families whose priors lie this close to the best one's (log speed-up) each get one try before the bandit draws:
# on memory-bound problems every roofline is level (docs/decisions.md `first-try`)
LEVEL = 0.1


def roofline_us(problem: Problem, family: Family, device: DeviceFacts) -> float | None:
    """The family's time for the problem at its reach of the device's tensor rate, or at the memory bandwidth,
    whichever is slower, plus a launch; None for a family without a reach on this arch."""
    share = family.tensor_share.get(device.arch)
    return LAUNCH_US + floor_us(problem, device, share) if share else None


def roofline_priors(problem: Problem, families: list[Family], device: DeviceFacts, known: dict[str, float],
                    default_mean: float) -> dict[str, tuple[float, float]]:
    """Each family's prior (mean, sd) by the name, for those with a reach on the device: a family slower by the
    roofline is lower by the log of its time over the fastest's (sm80_mma on a large Hopper problem: about log 0.47
    lower; on tiny or memory-bound ones: level). The fastest family's mean is `default_mean`, or where `known` holds
    means already set (by the learned model), what the known one fastest by the roofline says of it."""
    times = {f.name: t for f in families if (t := roofline_us(problem, f, device)) is not None}
    if not times:
        return {}
    best = min(times.values())
    anchor = min((name for name in times if name in known), key=times.get, default=None)
    level = default_mean if anchor is None else known[anchor] + math.log(times[anchor] / best)
    return {name: (level + math.log(best / t), ROOFLINE_SD) for name, t in times.items()}


class BuiltinProposer(Proposer):
    name = "builtin"

    def __init__(self, model: CostModel | Learner | None = None):
        self.model = model
        self._spaces: dict[tuple, list[tuple[str, Candidate]]] = {}
        self._peeked: dict[tuple, list[tuple[str, Candidate]]] = {}  # orders seen ahead of a shape's turn

    def _space(self, state: SearchState, family: Family, peek: bool = False) -> list[tuple[str, Candidate]]:
        """The family's settings for the problem as (id, candidate), in the order they are tried (computed once:
        ids are hashes, and the untried ones are looked up for every proposal). peek: before the shape's first
        proposal (compiling ahead), an order that neither retrains the model nor fixes the shape's order."""
        key = (state.problem, state.arch, state.device.name, state.device.sms, family.name)
        if key in self._spaces:
            return self._spaces[key]
        if peek and key in self._peeked:
            return self._peeked[key]
        settings = family.space(state.problem, state.device)
        if self.model is not None and settings:  # a family with nothing for the problem has nothing to order
            order = self.model.peek_order if peek else self.model.order
            settings = order(state.problem, family.name, settings, state.device.sms)
        space = [(c.id, c) for c in (Candidate(state.problem, family.name, p, origin=self.name) for p in settings)]
        if peek:
            self._peeked[key] = space
        else:
            self._peeked.pop(key, None)
            self._spaces[key] = space
        return space

    def _untried(self, state: SearchState) -> list[Candidate]:
        tried = state.tried_ids
        return [c for family in families_for_arch(state.arch) for cid, c in self._space(state, family)
                if cid not in tried]

    def upcoming(self, state: SearchState, per_family: int = 2) -> list[Candidate]:
        """The next untried settings of each family in its order: the bandit picks one of these families next."""
        tried = state.tried_ids
        out = []
        for family in families_for_arch(state.arch):
            out += [c for cid, c in self._space(state, family, peek=True) if cid not in tried][:per_family]
        return out

    def propose(self, state: SearchState, n: int = 1) -> list[Candidate]:
        pending = self._untried(state)
        self._set_priors(state, pending)
        chosen: list[Candidate] = []
        untouched = self._untouched(state)
        while pending and len(chosen) < n:
            arms = list(dict.fromkeys(arm_of(c) for c in pending))
            arm = state.bandit.choose(self._level(state, [a for a in arms if a in untouched]) or arms)
            untouched.discard(arm)
            pick = next(c for c in pending if arm_of(c) == arm)
            chosen.append(pick)
            pending.remove(pick)
        return chosen

    def _untouched(self, state: SearchState) -> set[str]:
        """The arms of the problem's families with no setting tried or in flight."""
        tried = state.tried_ids
        return {arm_of(space[0][1]) for family in families_for_arch(state.arch)
                if (space := self._space(state, family)) and not any(cid in tried for cid, _ in space)}

    @staticmethod
    def _level(state: SearchState, arms: list[str]) -> list[str]:
        """Of `arms`, those whose prior mean is within LEVEL of the best prior among all the bandit's priors."""
        mean = {a: state.bandit.priors.get(a, (state.bandit.prior_mean, 0.0))[0] for a in arms}
        best = max([m for m, _ in state.bandit.priors.values()] + list(mean.values()), default=None)
        return [a for a in arms if best is not None and mean[a] >= best - LEVEL]

    def _set_priors(self, state: SearchState, pending: list[Candidate]) -> None:
        """Each arm's prior, once per arm and problem: the model's view of its first untried settings, no higher
        than the family's roofline says, give or take its error (a model trained by runs that tried a slow family
        only where it was fast, on small problems, rated it high everywhere: on the H200 sm80_mma went first on
        large problems), or the roofline alone where the model has none (too little data on the family, or no
        model)."""
        arms: dict[str, list[Candidate]] = {}
        for c in pending:
            arms.setdefault(arm_of(c), []).append(c)
        new = {arm: first for arm, first in arms.items() if arm not in state.bandit.priors}
        if not new:
            return
        model = {arm: prior for arm, first in new.items() if self.model is not None and (prior := self.model.prior(
            state.problem, first[0].family, [c.params for c in first], state.device.sms)) is not None}
        family_of = {first[0].family: arm for arm, first in arms.items()}
        known = {name: (model.get(arm) or state.bandit.priors[arm])[0] for name, arm in family_of.items()
                 if arm in model or arm in state.bandit.priors}
        roofline = roofline_priors(state.problem, families_for_arch(state.arch), state.device, known,
                                   state.bandit.prior_mean)
        for arm, first in new.items():
            bound = roofline.get(first[0].family)
            if arm in model:  # the roofline's bound, give or take its error
                mean, sd = model[arm]
                state.bandit.set_prior(arm, min(mean, bound[0] + ROOFLINE_SLACK) if bound else mean, sd)
            elif bound is not None:
                state.bandit.set_prior(arm, *bound)


class RandomProposer(BuiltinProposer):
    name = "random"

    def __init__(self, seed: int = 0):
        super().__init__()
        self.rng = random.Random(seed)

    def upcoming(self, state: SearchState, per_family: int = 2) -> list[Candidate]:
        return []  # a random draw: nothing to compile ahead

    def propose(self, state: SearchState, n: int = 1) -> list[Candidate]:
        pending = self._untried(state)
        return self.rng.sample(pending, min(n, len(pending)))
