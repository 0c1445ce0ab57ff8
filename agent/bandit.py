"""Which source of candidates to draw from next (Thompson sampling), and who really won (successive halving).

Rewards are log speed-ups over cuBLAS (log t_cuBLAS/t_candidate): 0 means parity. Each arm's mean reward has a
normal prior and a normal likelihood whose variance is the measurement noise plus the spread between candidates of
one arm; a failed candidate is observed as FAILURE_REWARD, so an arm that keeps failing is drawn less.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

FAILURE_REWARD = math.log(0.05)


@dataclass
class ArmStats:
    rewards: list[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.rewards)

    @property
    def mean(self) -> float:
        return sum(self.rewards) / self.n if self.n else math.nan

    @property
    def best(self) -> float:
        return max(self.rewards, default=-math.inf)


class ThompsonBandit:
    def __init__(self, prior_mean: float = math.log(0.7), prior_sd: float = 1.0, noise_sd: float = 0.3,
                 seed: int = 0):
        self.prior_mean, self.prior_sd, self.noise_sd = prior_mean, prior_sd, noise_sd
        self.arms: dict[Hashable, ArmStats] = {}
        self.priors: dict[Hashable, tuple[float, float]] = {}  # per-arm (mean, sd) where something is known
        self.rng = random.Random(seed)

    def set_prior(self, arm: Hashable, mean: float, sd: float) -> None:
        """What is expected of an arm before (or besides) its own rewards, e.g. a cost model's prediction."""
        self.priors[arm] = (mean, sd)

    def posterior(self, arm: Hashable) -> tuple[float, float]:
        """Mean and standard deviation of the arm's mean reward (conjugate normal update)."""
        s = self.arms.get(arm, ArmStats())
        prior_mean, prior_sd = self.priors.get(arm, (self.prior_mean, self.prior_sd))
        precision = 1 / prior_sd**2 + s.n / self.noise_sd**2
        mean = (prior_mean / prior_sd**2 + sum(s.rewards) / self.noise_sd**2) / precision
        return mean, math.sqrt(1 / precision)

    def choose(self, available: Sequence[Hashable]) -> Hashable:
        if not available:
            raise ValueError("no arm to choose from")
        draws = {arm: self.rng.gauss(*self.posterior(arm)) for arm in available}
        return max(draws, key=draws.get)

    def update(self, arm: Hashable, reward: float | None) -> None:
        """reward None records a failure."""
        self.arms.setdefault(arm, ArmStats()).rewards.append(FAILURE_REWARD if reward is None else reward)

    def ranking(self) -> list[tuple[Hashable, float, float, int]]:
        """Arms by posterior mean: (arm, mean, sd, observations)."""
        rows = [(arm, *self.posterior(arm), s.n) for arm, s in self.arms.items()]
        return sorted(rows, key=lambda r: -r[1])


def successive_halving(items: Sequence[Hashable], measure: Callable[[Hashable], float | None],
                       scores: dict[Hashable, list[float]], rounds: int = 2) -> Hashable | None:
    """Re-measure the leaders, keep the faster half each round; a lucky first timing cannot win alone.

    `scores` holds each item's times so far (lower is better) and is extended in place; `measure` returns a new
    time or None if the item failed on re-measurement (then it is dropped).
    """
    alive = [i for i in items if scores.get(i)]
    for _ in range(rounds):
        if len(alive) <= 1:
            break
        for item in alive:
            t = measure(item)
            if t is None:
                scores[item] = []
            else:
                scores[item].append(t)
        alive = [i for i in alive if scores[i]]
        alive.sort(key=lambda i: _median(scores[i]))
        alive = alive[: max(1, (len(alive) + 1) // 2)]
    return min(alive, key=lambda i: _median(scores[i]), default=None)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
