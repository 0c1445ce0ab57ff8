"""The learned cost model: predicts a setting's log speed-up over cuBLAS on a problem from what the tuning database
measured on the same GPU model, to order each family's candidates and to set the bandit's prior for each family.

Features describe the problem (sizes, layout, alignment of rows to 128 bytes), the setting (its parameters) and
both together (tiles, CTAs, waves on this device's SMs, the last wave's fill, padding, k-tiles per CTA): the last
kind is what lets a model trained on some shapes say something about one it has never seen. The learner is
gradient-boosted trees (agent/gbt.py). Target: log(speed-up); a failed candidate counts as half as fast as the
slowest that passed on its problem, so failures are ranked last without inventing a speed. Where the same problem
and setting were measured before, the measurement is used, not the prediction.

Too little data, and the family keeps its own order: the model is trained only with at least MIN_PROBLEMS
problems measured on this GPU model, and it orders a family only where that family has at least MIN_FAMILY_ROWS
usable rows over MIN_PROBLEMS problems.

Where the learned order and the family's rules meet (`CostModel.order`, the one place; docs/decisions.md
`learned-order`): the family's own order (sm90_wgmma: its rules table) is the prior, so a setting k places later must
be predicted exp(k * RANK_WEIGHT) times faster to go ahead of one; the model may bring any setting forward but holds
none back more than DEMOTE_MAX places behind its place in the family's order; a setting measured on the same problem
is placed by its measurement and is free of that limit. Nothing else reorders a family's settings.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent import gbt
from agent.tuning_db import TuningDB, TuningRow
from core.plan import ceil_div
from core.records import Problem, Status

MIN_PROBLEMS = 4
MIN_FAMILY_ROWS = 40
FAILURE_PENALTY = math.log(2.0)
# The family's own order as a prior: a setting k places later must be predicted exp(k * RANK_WEIGHT) times faster to
# go ahead (10 places: 22%), so that where the trees cannot tell settings apart the hand-written rules decide: default
# runs measure only the first dozen or so of each shape's settings, so a database they filled knows little of the
# kinds the rules place late (clusters, deep splits). docs/decisions.md `learned-order`.
RANK_WEIGHT = 0.02
# The model may bring any setting forward, but holds none back more than this many places behind the family's own
# order (unless measured on the problem): a run's model knows little of the kinds the rules place late (few
# candidates reach them). docs/decisions.md `learned-order`.
DEMOTE_MAX = 3
PRIOR_TOP = 3  # a family's prior mean: the mean prediction of its first few settings in the model's order
PRIOR_SD = 0.3  # as sure as one measurement (the bandit's noise): the first results of the arm soon outweigh it
FAMILY_CODES = {"sm90_wgmma": 0, "sm80_mma": 1, "naive": 2, "gemv": 3}
CHOICE_CODES = {"direct": 0, "smem": 1, "tma": 2, "cp_async": 0, "n": 1}  # raster_along "m" is left out: -1
PARAMS = ("block_m", "block_n", "block_k", "stages", "consumers", "warps_m", "warps_n", "warps_k", "split_k",
          "k_groups", "min_blocks", "raster_group", "raster_along", "raster_snake", "cluster_m", "cluster_n",
          "persistent", "ping_pong", "c_panels", "tail_split", "mixed_tail", "swap_ab", "smem_epilogue", "epilogue",
          "loader", "warps", "rows", "unroll", "m_tile")  # the last four: gemv's
FEATURES = ("log2 m", "log2 n", "log2 k", "log2 mnk", "nk", "bf16", "bias", "a rows aligned", "b rows aligned",
            "m tail", "n tail", "family") + PARAMS + (
            "log2 tiles", "log2 ctas", "waves", "last wave fill", "padding", "log2 k-tiles per cta")


def features(problem: Problem, family: str, params: dict[str, Any], sms: int) -> list[float]:
    m, n, k = problem.m, problem.n, problem.k
    b_row = n if problem.b_layout == "kn" else k  # elements in a row of B as stored
    values = [math.log2(m), math.log2(n), math.log2(k), math.log2(m * n * k), float(problem.b_layout == "nk"),
              float(problem.dtype == "bf16"), float(problem.bias), float(k % 64 == 0), float(b_row % 64 == 0),
              (m % 128) / 128, (n % 128) / 128, float(FAMILY_CODES.get(family, -1))]
    for name in PARAMS:
        v = params.get(name, -1)
        values.append(float(CHOICE_CODES.get(v, -1) if isinstance(v, str) else v))
    bm, bn, bk = (max(1, int(params.get(name, d))) for name, d in (("block_m", 64), ("block_n", 64), ("block_k", 64)))
    parts = max(1, params.get("split_k", 1)) * max(1, params.get("k_groups", 1)) * max(1, params.get("warps_k", 1))
    tiles = problem.tiles(bm, bn)
    ctas = tiles * max(1, params.get("split_k", 1)) * max(1, params.get("k_groups", 1))
    slots = sms * max(1, params.get("min_blocks", 1))
    waves = ctas / slots
    values += [math.log2(tiles), math.log2(ctas), waves, waves / math.ceil(waves), m * n / (tiles * bm * bn),
               math.log2(max(1, ceil_div(k, bk * parts)))]
    return values


@dataclass
class CostModel:
    device: str
    booster: gbt.Booster
    families: frozenset[str]  # the families with enough data to be ordered
    known: dict[tuple[str, str, str], float] = field(default_factory=dict)  # measured (problem, family, params)
    rows: int = 0
    problems: int = 0
    rank_weight: float = RANK_WEIGHT

    @property
    def summary(self) -> str:
        return (f"cost model: {self.rows} measurements of {self.problems} problems on {self.device} order "
                f"{', '.join(sorted(self.families))}")

    def scores(self, problem: Problem, family: str, settings: list[dict[str, Any]], sms: int) -> np.ndarray:
        """Predicted log speed-up of each setting (measured values where the database has them)."""
        if not settings:
            return np.zeros(0)
        predicted = self.booster.predict(np.array([features(problem, family, p, sms) for p in settings]))
        for i, p in enumerate(settings):
            measured = self.known.get((problem.key, family, _params_key(p)))
            if measured is not None:
                predicted[i] = measured
        return predicted

    def order(self, problem: Problem, family: str, settings: list[dict[str, Any]], sms: int) -> list[dict[str, Any]]:
        """The family's settings, best predicted first but none held back more than DEMOTE_MAX places behind the
        family's own order unless measured on this problem; unchanged for a family the model knows too little of."""
        if family not in self.families:
            return list(settings)
        blended = self.scores(problem, family, settings, sms) - self.rank_weight * np.arange(len(settings))
        measured = {i for i, p in enumerate(settings) if (problem.key, family, _params_key(p)) in self.known}
        order = _held_back_at_most(np.argsort(-blended, kind="stable").tolist(), DEMOTE_MAX, measured)
        return [settings[i] for i in order]

    peek_order = order  # a trained model does not change: looking ahead orders as the shape's turn will

    def prior(self, problem: Problem, family: str, ordered: list[dict[str, Any]], sms: int
              ) -> tuple[float, float] | None:
        """The bandit's prior (mean, sd) of the family's reward, from its next settings; None: keep the default."""
        if family not in self.families or not ordered:
            return None
        return float(np.mean(self.scores(problem, family, ordered[:PRIOR_TOP], sms))), PRIOR_SD


def _held_back_at_most(order: list[int], most: int, free: set[int] = frozenset()) -> list[int]:
    """`order` (a permutation of the family's own order 0..n-1), changed so that setting i comes no later than place
    i + most, unless i is in `free`: where one is due, it goes next; otherwise the next of `order`."""
    out: list[int] = []
    out_set: set[int] = set()
    placed: set[int] = set(free)  # placed, or never due
    pending = iter(order)
    due = 0  # every setting before it is placed (or free)
    while len(out) < len(order):
        while due in placed:
            due += 1
        if due + most <= len(out):
            pick = due
        else:
            pick = next(i for i in pending if i not in out_set)
        out.append(pick)
        out_set.add(pick)
        placed.add(pick)
    return out


def _params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


@dataclass(frozen=True)
class TrainingSet:
    x: np.ndarray  # features, one row per problem and setting
    y: np.ndarray  # targets
    weight: np.ndarray  # each problem weighs the same in total
    known: dict[tuple[str, str, str], float]  # the targets by (problem key, family, params)


def training_set(rows: list[TuningRow]) -> TrainingSet:
    """One row per problem and setting (measurements averaged), from the usable rows: rows from edited templates
    and problems where nothing passed are left out."""
    by_setting: dict[tuple[str, str, str], list[float | None]] = defaultdict(list)
    problems: dict[str, tuple[Problem, int]] = {}
    for r in rows:
        if r.edited or r.status is Status.SKIPPED:
            continue
        key = (r.problem.key, r.family, _params_key(r.params))
        by_setting[key].append(math.log(r.speedup) if r.status is Status.OK and r.speedup else None)
        problems[r.problem.key] = (r.problem, r.sms)
    worst: dict[str, float] = {}
    for (pkey, _, _), values in by_setting.items():
        for v in values:
            if v is not None:
                worst[pkey] = min(worst.get(pkey, v), v)
    known: dict[tuple[str, str, str], float] = {}
    for key, values in by_setting.items():
        if key[0] in worst:
            ok = [v for v in values if v is not None]
            # a setting that failed in most of its runs is treated as failing
            known[key] = float(np.mean(ok)) if len(ok) * 2 > len(values) else worst[key[0]] - FAILURE_PENALTY
    per_problem = defaultdict(int)
    for pkey, _, _ in known:
        per_problem[pkey] += 1
    x, y, w = [], [], []
    for (pkey, family, params), target in known.items():
        problem, device_sms = problems[pkey]
        x.append(features(problem, family, json.loads(params), device_sms))
        y.append(target)
        w.append(len(known) / (len(per_problem) * per_problem[pkey]))
    return TrainingSet(np.array(x).reshape(len(x), len(FEATURES)), np.array(y), np.array(w), known)


def train(rows: list[TuningRow], device: str, seed: int = 0, rank_weight: float = RANK_WEIGHT
          ) -> tuple[CostModel | None, str]:
    """A model of this GPU model's rows, or None and why not (too little data)."""
    data = training_set([r for r in rows if r.device == device])
    known = data.known
    n_problems = len({key[0] for key in known})
    if n_problems < MIN_PROBLEMS:
        return None, (f"cost model: {len(known)} usable measurements of {n_problems} problems on {device} (needs "
                      f"{MIN_PROBLEMS} problems): the families' own order")
    families = set()
    for family in {key[1] for key in known}:
        keys = [key for key in known if key[1] == family]
        if len(keys) >= MIN_FAMILY_ROWS and len({key[0] for key in keys}) >= MIN_PROBLEMS:
            families.add(family)
    if not families:
        return None, f"cost model: no family has {MIN_FAMILY_ROWS} measurements on {device}: the families' own order"
    booster = gbt.fit(data.x, data.y, data.weight, gbt.Settings(seed=seed))
    model = CostModel(device, booster, frozenset(families), known, len(known), n_problems, rank_weight)
    return model, model.summary


RETRAIN_GROWTH = 1.25  # a run's model is retrained once the database holds a quarter more problems (at least one)


class Learner:
    """The cost model a run orders by, kept current: retrained from the tuning database when the database holds
    measurements of RETRAIN_GROWTH times the problems (at least one more) of this GPU model than the last training
    saw, checked as each new problem's settings are ordered. So every shape of a run is ordered by everything measured
    before it, the run's own earlier shapes included: a first run on an empty database learns as it goes. Orders and
    priors as `CostModel` does; where it has no model, the family's own order and no prior."""

    def __init__(self, db: TuningDB, device: str, seed: int = 0,
                 notify: Callable[[str], None] | None = None):
        self.db: TuningDB | None = db  # None once reading it failed
        self.device, self.seed, self.notify = device, seed, notify
        self.model: CostModel | None = None
        self.trained_on = 0  # problems the last training saw
        self.note = self._train(db.problem_count(device))

    def _train(self, problems: int) -> str:
        assert self.db is not None
        model, note = train(self.db.rows(self.device), self.device, seed=self.seed)
        self.trained_on, self.model = problems, model or self.model
        return note

    def _refresh(self) -> None:
        if self.db is None:
            return
        try:
            problems = self.db.problem_count(self.device)
            if problems < max(MIN_PROBLEMS, self.trained_on + 1, RETRAIN_GROWTH * self.trained_on):
                return
            note = f"retrained on {problems} problems: {self._train(problems)}"
        except sqlite3.Error as e:  # the database never stops a run: keep the model as it is
            self.db, note = None, f"cost model no longer retrained: reading the tuning database failed: {e}"
        if self.notify is not None:
            self.notify(note)

    def order(self, problem: Problem, family: str, settings: list[dict[str, Any]], sms: int) -> list[dict[str, Any]]:
        self._refresh()
        return self.peek_order(problem, family, settings, sms)

    def peek_order(self, problem: Problem, family: str, settings: list[dict[str, Any]], sms: int
                   ) -> list[dict[str, Any]]:
        """The order by the model as it is, never retraining it (to compile a shape's settings ahead of its turn
        without moving when the model retrains, and so what it orders by)."""
        return self.model.order(problem, family, settings, sms) if self.model else list(settings)

    def prior(self, problem: Problem, family: str, ordered: list[dict[str, Any]], sms: int
              ) -> tuple[float, float] | None:
        return self.model.prior(problem, family, ordered, sms) if self.model else None
