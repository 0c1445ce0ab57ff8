"""The built-in proposer: walks each family's parameter space, with the bandit choosing the family to try next.

An arm is a family; within it, settings are tried in the family's own order (its cost model's best guesses
first). `RandomProposer` draws uniformly from the same space: the baseline the bandit
must beat.
"""

from __future__ import annotations

import random

from agent.proposers.base import Proposer, SearchState, arm_of
from core.records import Candidate
from templates import families_for_arch


class BuiltinProposer(Proposer):
    name = "builtin"

    def _untried(self, state: SearchState) -> list[Candidate]:
        tried = state.tried_ids
        out = []
        for family in families_for_arch(state.arch):
            for params in family.space(state.problem, state.device):
                c = Candidate(state.problem, family.name, params, origin=self.name)
                if c.id not in tried:
                    out.append(c)
        return out

    def propose(self, state: SearchState, n: int = 1) -> list[Candidate]:
        pending = self._untried(state)
        chosen: list[Candidate] = []
        while pending and len(chosen) < n:
            arms = list(dict.fromkeys(arm_of(c) for c in pending))
            arm = state.bandit.choose(arms)
            pick = next(c for c in pending if arm_of(c) == arm)
            chosen.append(pick)
            pending.remove(pick)
        return chosen


class RandomProposer(BuiltinProposer):
    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def propose(self, state: SearchState, n: int = 1) -> list[Candidate]:
        pending = self._untried(state)
        return self.rng.sample(pending, min(n, len(pending)))
