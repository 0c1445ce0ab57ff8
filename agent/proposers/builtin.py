"""The built-in proposer: walks each family's parameter space, with the bandit choosing the family to try next.

An arm is a family; within it, settings are tried in the family's own order (its cost model's best guesses
first), or in the learned cost model's order where the tuning database holds enough measurements of the family on
this GPU model (a run's `Learner` retrains as the run measures new problems), which then also sets the arm's
prior. `RandomProposer` draws uniformly from the same space: the baseline the bandit must beat.
"""

from __future__ import annotations

import random

from agent.cost_model import CostModel, Learner
from agent.proposers.base import Proposer, SearchState, arm_of
from core.records import Candidate
from templates import families_for_arch
from templates.family import Family


class BuiltinProposer(Proposer):
    name = "builtin"

    def __init__(self, model: CostModel | Learner | None = None):
        self.model = model
        self._spaces: dict[tuple, list[tuple[str, Candidate]]] = {}

    def _space(self, state: SearchState, family: Family) -> list[tuple[str, Candidate]]:
        """The family's settings for the problem as (id, candidate), in the order they are tried (computed once:
        ids are hashes, and the untried ones are looked up for every proposal)."""
        key = (state.problem, state.arch, state.device.name, state.device.sms, family.name)
        if key not in self._spaces:
            settings = family.space(state.problem, state.device)
            if self.model is not None:
                settings = self.model.order(state.problem, family.name, settings, state.device.sms)
            candidates = [Candidate(state.problem, family.name, p, origin=self.name) for p in settings]
            self._spaces[key] = [(c.id, c) for c in candidates]
        return self._spaces[key]

    def _untried(self, state: SearchState) -> list[Candidate]:
        tried = state.tried_ids
        return [c for family in families_for_arch(state.arch) for cid, c in self._space(state, family)
                if cid not in tried]

    def upcoming(self, state: SearchState, per_family: int = 2) -> list[Candidate]:
        """The next untried settings of each family in its order: the bandit picks one of these families next."""
        tried = state.tried_ids
        out = []
        for family in families_for_arch(state.arch):
            out += [c for cid, c in self._space(state, family) if cid not in tried][:per_family]
        return out

    def propose(self, state: SearchState, n: int = 1) -> list[Candidate]:
        pending = self._untried(state)
        if self.model is not None:
            self._set_priors(state, pending)
        chosen: list[Candidate] = []
        while pending and len(chosen) < n:
            arms = list(dict.fromkeys(arm_of(c) for c in pending))
            arm = state.bandit.choose(arms)
            pick = next(c for c in pending if arm_of(c) == arm)
            chosen.append(pick)
            pending.remove(pick)
        return chosen

    def _set_priors(self, state: SearchState, pending: list[Candidate]) -> None:
        """Each arm's prior from the model's view of its first untried settings, once per arm and problem."""
        for arm in dict.fromkeys(arm_of(c) for c in pending):
            if arm in state.bandit.priors:
                continue
            first = [c for c in pending if arm_of(c) == arm]
            prior = self.model.prior(state.problem, first[0].family, [c.params for c in first], state.device.sms)
            if prior is not None:
                state.bandit.set_prior(arm, *prior)


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
