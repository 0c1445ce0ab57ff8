"""Which source of candidates to draw from next (Thompson sampling), and who really won (successive halving).

Rewards are log speed-ups over cuBLAS (log t_cuBLAS/t_candidate): 0 means parity. Each arm's mean reward has a
normal prior and a normal likelihood whose variance is the measurement noise plus the spread between candidates of
one arm; a failed candidate is observed as FAILURE_REWARD, so an arm that keeps failing is drawn less.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Hashable, Sequence
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


def stream_seed(seed: int, key: str) -> int:
    """A problem's own bandit seed: the run's seed and the problem's key (crc32, the same in every process), so that
    the problems of a run do not all replay one sequence of draws (docs/decisions.md `bandit-seeds`)."""
    return zlib.crc32(f"{seed}:{key}".encode())


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


class SuccessiveHalving:
    """Re-measure the leaders, keep the faster half each round: a lucky first timing cannot win alone.

    Round by round, so that a round's measurements can run at once on several GPUs: `next_round()` names the items
    to measure, `record()` takes each new time (lower is better) or None for an item that failed on re-measurement
    (it is dropped), and once a round is recorded the next `next_round()` keeps the faster half. `scores` holds each
    item's times so far and is extended in place.
    """

    def __init__(self, items: Sequence[Hashable], scores: dict[Hashable, list[float]], rounds: int = 2):
        self.scores, self.rounds_left = scores, rounds
        self.alive = [i for i in items if scores.get(i)]
        self.measuring: list[Hashable] = []
        self.started = False  # the first round measures every item, even a single one
        self.replaced: set[Hashable] = set()

    def next_round(self) -> list[Hashable]:
        """The items to measure now; empty once the winner is decided."""
        if self.measuring:
            self.alive = sorted((i for i in self.alive if self.scores[i]), key=lambda i: _median(self.scores[i]))
            self.alive = self.alive[: max(1, (len(self.alive) + 1) // 2)]
            self.measuring = []
        if self.rounds_left == 0 or (len(self.alive) <= 1 and self.started) or not self.alive:
            return []
        self.rounds_left -= 1
        self.started = True
        self.measuring = list(self.alive)
        return list(self.measuring)

    def record(self, item: Hashable, t: float | None, replace: bool = False) -> None:
        """A new time for the item (None: it failed and is dropped). With `replace`, the item's first such time
        replaces the scores it started with (re-measurements of another kind than the first screen's)."""
        if t is None:
            self.scores[item] = []
            return
        if replace and item not in self.replaced:
            self.replaced.add(item)
            self.scores[item] = []
        self.scores[item].append(t)

    @property
    def winner(self) -> Hashable | None:
        alive = [i for i in self.alive if self.scores[i]]
        return min(alive, key=lambda i: _median(self.scores[i]), default=None)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
