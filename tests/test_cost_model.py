"""The learned cost model: the trees, the training set, the fallback where data is short, the order and priors it
gives the built-in proposer, and leave-one-shape-out replays (tools/compare_search.py) on synthetic measurements
whose ground truth the test sets."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from agent import gbt
from agent.bandit import ThompsonBandit
from agent.cost_model import (
    DEMOTE_MAX,
    FAILURE_PENALTY,
    MIN_PROBLEMS,
    _held_back_at_most,
    features,
    train,
    training_set,
)
from agent.proposers.base import SearchState, arm_of
from agent.proposers.builtin import ROOFLINE_SD, ROOFLINE_SLACK, BuiltinProposer, roofline_priors
from agent.tuning_db import TuningDB, TuningRow
from core.device import H200
from core.records import Candidate, EvalResult, Problem, Status, Timing
from templates import families_for_arch, get_family

_spec = importlib.util.spec_from_file_location("compare_search",
                                               Path(__file__).parents[1] / "tools" / "compare_search.py")
compare_search = importlib.util.module_from_spec(_spec)
sys.modules["compare_search"] = compare_search  # dataclasses look their module up there
_spec.loader.exec_module(compare_search)

DEVICE = "NVIDIA H200"
SHAPES = [(m, n, k) for m in (96, 640, 2000, 6000) for n, k in ((512, 4096), (3072, 1024), (12288, 2048))]


def truth(problem: Problem, family: str, p: dict) -> float:
    """A ground truth today's rules do not know: 64-column tiles and deep rings win, and 64-row tiles below
    M = 1024, 256-row tiles above; the sm80 family is far behind."""
    if family != "sm90_wgmma":
        return math.log(0.4)
    want_m = 64 if problem.m < 1024 else 256
    return (0.25 * (p["block_n"] == 64) + 0.15 * (p["stages"] >= 6) + 0.3 * (p["block_m"] == want_m)
            - 0.2 * p["persistent"] - 0.3)


def synthetic_rows(shapes=SHAPES, layouts=("kn",), noise: float = 0.01, seed: int = 0) -> list[TuningRow]:
    """Every setting of every family's space on each shape, measured with a little noise."""
    rng = random.Random(seed)
    rows = []
    for m, n, k in shapes:
        for layout in layouts:
            problem = Problem(m, n, k, layout)
            for family in families_for_arch("sm_90a"):
                for p in family.space(problem, H200):
                    speedup = math.exp(truth(problem, family.name, p) + rng.gauss(0, noise))
                    rows.append(TuningRow(DEVICE, 132, problem, family.name, p, False, Status.OK, speedup, "r1"))
    return rows


def test_trees_learn_an_interaction_and_are_deterministic():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(3000, 6))
    y = np.where(x[:, 0] > 0, x[:, 1], -x[:, 1]) + 0.05 * rng.normal(size=3000)
    a, b = gbt.fit(x, y), gbt.fit(x, y)
    test = rng.uniform(-1, 1, size=(500, 6))
    truth_test = np.where(test[:, 0] > 0, test[:, 1], -test[:, 1])
    assert np.sqrt(np.mean((a.predict(test) - truth_test) ** 2)) < 0.35 * truth_test.std()
    assert np.array_equal(a.predict(test), b.predict(test))
    other = gbt.fit(x, y, settings=gbt.Settings(seed=1))
    assert not np.array_equal(a.predict(test), other.predict(test))
    with pytest.raises(ValueError, match="one target and weight per row"):
        gbt.fit(x, y[:10])


def test_training_set_ranks_failures_last_and_weighs_problems_alike():
    p, q = Problem(512, 512, 512), Problem(64, 4096, 4096)
    base = {"block_m": 128, "block_n": 128, "stages": 4}
    rows = [TuningRow(DEVICE, 132, p, "sm90_wgmma", {**base, "stages": s}, False, Status.OK, sp, "r")
            for s, sp in ((3, 0.9), (4, 1.2), (5, 1.0))]
    rows += [TuningRow(DEVICE, 132, p, "sm90_wgmma", {**base, "stages": 6}, False, Status.WRONG, None, "r"),
             TuningRow(DEVICE, 132, p, "sm90_wgmma", {**base, "stages": 7}, True, Status.OK, 3.0, "r"),  # edited
             TuningRow(DEVICE, 132, q, "sm90_wgmma", base, False, Status.FAULT, None, "r"),  # nothing passed on q
             TuningRow(DEVICE, 132, p, "sm90_wgmma", {**base, "stages": 4}, False, Status.OK, 1.4, "r2")]
    data = training_set(rows)

    def key(stages):
        return p.key, "sm90_wgmma", json.dumps({**base, "stages": stages}, sort_keys=True)

    assert len(data.y) == 4 and set(data.known) == {key(s) for s in (3, 4, 5, 6)}
    assert data.known[key(4)] == pytest.approx((math.log(1.2) + math.log(1.4)) / 2)
    assert data.known[key(6)] == pytest.approx(math.log(0.9) - FAILURE_PENALTY)
    assert np.allclose(data.weight, 1.0) and data.x.shape[1] == len(features(p, "sm90_wgmma", base, 132))


def test_too_little_data_keeps_the_families_own_order():
    few = synthetic_rows(SHAPES[: MIN_PROBLEMS - 1])
    model, note = train(few, DEVICE)
    assert model is None and "families' own order" in note
    model, note = train(synthetic_rows(), "NVIDIA A100")  # nothing measured on this GPU model
    assert model is None
    only_sm90 = [r for r in synthetic_rows() if r.family == "sm90_wgmma"]
    model, note = train(only_sm90, DEVICE)
    assert model is not None and model.families == {"sm90_wgmma"} and "sm90_wgmma" in note
    problem = Problem(1234, 2048, 1024)
    sm80 = get_family("sm80_mma").space(problem, H200)
    assert model.order(problem, "sm80_mma", sm80, 132) == sm80  # no data for it: its own order


def test_measured_settings_go_first_and_ties_keep_the_rules_order():
    rows = synthetic_rows()
    problem = Problem(*SHAPES[0])
    space = get_family("sm90_wgmma").space(problem, H200)
    flat = [TuningRow(r.device, r.sms, r.problem, r.family, r.params, False, Status.OK, 1.0, "r") for r in rows]
    flat_model, _ = train(flat, DEVICE)
    assert flat_model.order(problem, "sm90_wgmma", space, 132) == space  # nothing to tell them apart
    model, _ = train(rows, DEVICE)
    ordered = model.order(problem, "sm90_wgmma", space, 132)
    best_measured = max(space, key=lambda p: truth(problem, "sm90_wgmma", p))
    assert ordered[0] == best_measured and sorted(map(str, ordered)) == sorted(map(str, space))


def test_the_learned_order_holds_no_setting_back_more_than_a_few_places(monkeypatch):
    problem = Problem(3000, 1024, 1024)  # never measured
    space = get_family("sm90_wgmma").space(problem, H200)
    model, _ = train(synthetic_rows(), DEVICE, rank_weight=0.0)  # the trees alone

    def delays():
        ordered = model.order(problem, "sm90_wgmma", space, 132)
        place = {json.dumps(p, sort_keys=True): i for i, p in enumerate(ordered)}
        assert sorted(place.values()) == list(range(len(space)))
        return ordered, max(place[json.dumps(p, sort_keys=True)] - i for i, p in enumerate(space))

    ordered, most = delays()
    assert most <= DEMOTE_MAX
    assert ordered[:DEMOTE_MAX] != space[:DEMOTE_MAX]  # the model still brings its own picks forward
    monkeypatch.setattr("agent.cost_model.DEMOTE_MAX", len(space))
    assert delays()[1] > DEMOTE_MAX + 5  # what the trees alone would have done


def test_the_hold_back_keeps_every_setting_once_and_frees_the_measured_ones():
    rng = random.Random(0)
    for _ in range(500):
        n, most = rng.randint(1, 40), rng.randint(0, 5)
        order = rng.sample(range(n), n)
        free = set(rng.sample(range(n), rng.randint(0, n)))
        out = _held_back_at_most(order, most, free)
        place = {v: i for i, v in enumerate(out)}
        assert sorted(out) == list(range(n)) and all(place[i] <= i + most for i in range(n) if i not in free)
    assert _held_back_at_most([5, 6, 7, 8, 9, 0, 1, 2, 3, 4], 3) == [5, 6, 7, 0, 1, 2, 3, 4, 8, 9]
    # settings measured on the problem before (0, 1: known slow there) may stay at the back
    assert _held_back_at_most([5, 6, 7, 8, 9, 2, 3, 4, 0, 1], 3, {0, 1})[-2:] == [0, 1]


def test_compiling_ahead_peeks_at_the_order_without_retraining_or_fixing_it():
    class Counting:  # a Learner's calls: order may retrain, peek_order never does
        def __init__(self):
            self.calls = []

        def order(self, problem, family, settings, sms):
            self.calls.append(("order", family))
            return list(reversed(settings))

        def peek_order(self, problem, family, settings, sms):
            self.calls.append(("peek", family))
            return list(reversed(settings))

        def prior(self, problem, family, ordered, sms):
            return None

    model = Counting()
    proposer = BuiltinProposer(model)
    state = SearchState(Problem(3000, 1024, 1024), "sm_90a", ThompsonBandit(seed=0), device=H200)
    ahead = proposer.upcoming(state)
    proposer.upcoming(state)  # peeked orders are kept for the next look ahead
    assert {kind for kind, _ in model.calls} == {"peek"} and len(model.calls) == 2
    first = proposer.propose(state)[0]
    assert [kind for kind, _ in model.calls[2:]] == ["order", "order"]  # the shape's own order, fixed now
    assert first.id in {c.id for c in ahead}
    proposer.upcoming(state)
    assert len(model.calls) == 4  # once fixed, looking ahead reads it


def test_the_model_sets_priors_and_the_better_family_goes_first():
    model, _ = train(synthetic_rows(), DEVICE, rank_weight=0.003)  # a weak prior: the trees' own first choice
    problem = Problem(3000, 1024, 1024)  # never measured
    proposer = BuiltinProposer(model)
    state = SearchState(problem, "sm_90a", ThompsonBandit(seed=0), device=H200)
    first = proposer.propose(state, n=1)[0]
    sm90, sm80 = state.bandit.priors["builtin:sm90_wgmma"], state.bandit.priors["builtin:sm80_mma"]
    assert sm90[0] > sm80[0] + 0.3 and first.family == "sm90_wgmma"
    # what the truth favours (64-column tiles first), far ahead of the rules' first guess
    space = get_family("sm90_wgmma").space(problem, H200)
    best = max(truth(problem, "sm90_wgmma", p) for p in space)
    assert first.params["block_n"] == 64 and truth(problem, "sm90_wgmma", first.params) > best - 0.2
    assert truth(problem, "sm90_wgmma", first.params) >= truth(problem, "sm90_wgmma", space[0]) + 0.3
    # without a model the priors are the families' rooflines, level with the bandit's default where fastest
    plain = SearchState(problem, "sm_90a", ThompsonBandit(seed=0), device=H200)
    BuiltinProposer().propose(plain, n=1)
    roof90, roof80 = plain.bandit.priors["builtin:sm90_wgmma"], plain.bandit.priors["builtin:sm80_mma"]
    assert roof90[0] == plain.bandit.prior_mean and roof80[0] < roof90[0] - 0.5


@pytest.mark.parametrize("shape, lower", [
    ((4096, 4096, 4096), (0.7, 0.8)),  # compute-bound: mma.sync's reach of Hopper's tensor rate, log 0.4 / 0.85
    ((64, 64, 64), (0.0, 0.0)),  # a launch: level
    ((57, 28672, 4096), (0.0, 0.0)),  # reading B at the memory's rate: level
    ((131, 400, 5632), (0.01, 0.3)),  # between
])
def test_roofline_priors_lower_a_family_by_its_reach_where_the_problem_is_compute_bound(shape, lower):
    families = families_for_arch("sm_90a")
    priors = roofline_priors(Problem(*shape), families, H200, {}, -0.3)
    assert priors["sm90_wgmma"] == (-0.3, ROOFLINE_SD)
    assert lower[0] <= -0.3 - priors["sm80_mma"][0] <= lower[1] + 1e-9
    # a family whose mean is known (from the learned model) sets the level of the others by its own roofline
    anchored = roofline_priors(Problem(*shape), families, H200, {"sm90_wgmma": 0.1}, -0.3)
    assert anchored["sm80_mma"][0] == pytest.approx(priors["sm80_mma"][0] + 0.4)
    assert roofline_priors(Problem(*shape), [f for f in families if not f.tensor_share], H200, {}, 0.0) == {}


def test_a_model_that_rates_a_slow_family_high_is_held_to_its_roofline():
    class Flattering:  # a model trained where sm80_mma was tried only on small problems, where it was fast
        def order(self, problem, family, settings, sms):
            return settings

        def prior(self, problem, family, ordered, sms):
            return (0.2 if family == "sm80_mma" else 0.0), 0.3

    big = SearchState(Problem(4096, 4096, 4096), "sm_90a", ThompsonBandit(seed=0), device=H200)
    BuiltinProposer(Flattering()).propose(big)
    assert big.bandit.priors["builtin:sm90_wgmma"] == (0.0, 0.3)
    assert big.bandit.priors["builtin:sm80_mma"][0] == pytest.approx(math.log(0.4 / 0.85) + ROOFLINE_SLACK, abs=0.05)
    tiny = SearchState(Problem(64, 64, 64), "sm_90a", ThompsonBandit(seed=0), device=H200)
    BuiltinProposer(Flattering()).propose(tiny)
    # level by the roofline: the model may rate it above sm90_wgmma's by the slack, no more
    assert tiny.bandit.priors["builtin:sm80_mma"] == (ROOFLINE_SLACK, 0.3)


def test_the_roofline_prior_sends_a_large_problem_to_the_hopper_family_first():
    problem = Problem(4096, 4096, 4096)
    firsts = [BuiltinProposer().propose(SearchState(problem, "sm_90a", ThompsonBandit(seed=s), device=H200))[0]
              for s in range(40)]
    assert sum(c.family == "sm90_wgmma" for c in firsts) >= 36  # level priors: half each


@pytest.mark.parametrize("seed", range(8))
def test_every_family_level_by_the_roofline_gets_one_try_first_whatever_the_first_rewards(seed):
    """M = 1 (memory-bound): the three families level, each tried within the first three whatever the draws and the
    first rewards (high ones: the arm tried first would otherwise keep winning the draws); a family the roofline
    puts well below (sm80_mma on 4096 cubed) gets no such try."""
    for problem, want in ((Problem(1, 6144, 4096, b_layout="nk"), {"sm90_wgmma", "sm80_mma", "gemv"}),
                          (Problem(4096, 4096, 4096), {"sm90_wgmma"})):
        state, proposer, seen = SearchState(problem, "sm_90a", ThompsonBandit(seed=seed), device=H200), \
            BuiltinProposer(), []
        for _ in range(3):
            c = proposer.propose(state)[0]
            seen.append(c.family)
            state.pending.add(c.id)
            state.bandit.update(arm_of(c), 0.3)
        assert set(seen) == want
    # several at once (compiling ahead): the untried level families come first, once each
    many = BuiltinProposer().propose(SearchState(Problem(1, 6144, 4096, b_layout="nk"), "sm_90a",
                                                 ThompsonBandit(seed=seed), device=H200), n=3)
    assert {c.family for c in many} == {"sm90_wgmma", "sm80_mma", "gemv"}


def test_leave_one_shape_out_needs_fewer_candidates_than_todays_order_and_random():
    outcomes = compare_search.compare(synthetic_rows(layouts=("kn", "nk")), DEVICE, seeds=3)
    assert len(outcomes) == 2 * len(SHAPES)

    def mean_of_medians(name):
        return np.mean([np.median(o.needed[name]) for o in outcomes])

    learned, today, rand = (mean_of_medians(n) for n in ("learned", "today", "random"))
    assert learned <= 5 and learned < 0.5 * today and learned < 0.5 * rand
    assert "| learned |" in compare_search.table(outcomes)


def test_a_first_run_replayed_learns_from_what_it_tried_once_it_has_enough_problems():
    """compare_search --first-run: 16 candidates a shape, the model trained only on what the replay itself tried."""
    outcomes = compare_search.first_run(synthetic_rows(), DEVICE, seeds=3)
    assert len(outcomes) == len(SHAPES)
    for o in outcomes[:MIN_PROBLEMS]:  # no model yet: the learned order is today's
        assert o.needed["learned"] == o.needed["today"]
    later = outcomes[MIN_PROBLEMS + 2:]
    learned = np.mean([np.median(o.needed["learned"]) for o in later])
    assert learned < 0.5 * np.mean([np.median(o.needed["today"]) for o in later])
    assert all(max(o.needed[name]) <= compare_search.BUDGET + 1 for o in outcomes for name in o.needed)


def test_leave_one_shape_out_learns_nothing_from_noise():
    """Where speed-ups are noise unrelated to any feature, the learned order is no better than random."""
    rng = random.Random(5)
    rows = [TuningRow(r.device, r.sms, r.problem, r.family, r.params, False, Status.OK, math.exp(rng.gauss(0, 0.3)),
                      "r") for r in synthetic_rows(SHAPES[:8])]
    outcomes = compare_search.compare(rows, DEVICE, seeds=3)
    learned = np.mean([np.median(o.needed["learned"]) for o in outcomes])
    rand = np.mean([np.median(o.needed["random"]) for o in outcomes])
    assert learned > 0.5 * rand


def test_compare_tool_reads_run_stores_and_a_db(tmp_path, capsys):
    db = TuningDB(tmp_path / "t.sqlite")
    device = H200
    for r in synthetic_rows(SHAPES[:6]):
        c = Candidate(r.problem, r.family, r.params)
        t = Timing(10 / r.speedup, 9, 11, 100)
        db.record("r1", device, "sm_90a", c, EvalResult(c.id, Status.OK, warm=t, cublas_warm=Timing(10, 9, 11, 100)),
                  [r.speedup])
    db.close()
    assert compare_search.main(["--db", str(tmp_path / "t.sqlite"), "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and out.count(":kn |") == 6
    assert compare_search.main(["--db", str(tmp_path / "t.sqlite"), "--min-space", "1000"]) == 2


def test_gemv_settings_have_features_of_their_own():
    from agent.cost_model import FEATURES, features
    from templates import get_family

    problem = Problem(1, 4096, 4096, "nk")
    space = get_family("gemv").space(problem)
    assert len({tuple(features(problem, "gemv", s, 132)) for s in space}) == len(space) > 1
    assert features(problem, "gemv", space[0], 132)[FEATURES.index("family")] == 3
