"""Search orders compared on measured sweeps: how many candidates each strategy needs before one comes within 2% of
the best speed-up measured for a shape, on shapes the learned model was not trained on.

    python tools/compare_search.py --db tuning.sqlite [--device "NVIDIA H200"] [--seeds 10]
    python tools/compare_search.py --runs runs/RUN_A runs/RUN_B      (run stores, imported into a scratch database)
    python tools/compare_search.py --db tuning.sqlite --first-run    (a first run replayed, learning as it goes)

Every problem with at least --min-space measured settings is held out in turn, together with the other layout of
its M_N_K (leave one shape out): a cost model is trained on the rest of the device's rows, and three strategies
replay the search against the recorded results (each only proposes settings that were measured): the learned order
(model-ordered families, model priors for the bandit), today's order (the families' rules, default priors) and
random. Median and worst over seeds (the bandit's, or random's). No GPU needed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.cost_model import RANK_WEIGHT, train  # noqa: E402
from agent.proposers.base import SearchState, arm_of  # noqa: E402
from agent.proposers.builtin import BuiltinProposer, RandomProposer  # noqa: E402
from agent.store import RunStore  # noqa: E402
from agent.tuning_db import TuningDB, TuningRow  # noqa: E402
from core.device import DeviceFacts  # noqa: E402
from core.records import Candidate, Problem, Status  # noqa: E402

WITHIN = 0.98  # "within 2% of the best"
BUDGET = 16  # the default candidates a shape


@dataclass(frozen=True)
class Outcome:
    problem: Problem
    space: int
    best: float  # best speed-up measured
    best_setting: str
    needed: dict[str, list[int]]  # strategy -> candidates needed, one per seed


def describe(family: str, p: dict) -> str:
    """A setting in a few characters: family, tile, ring, then what differs from the plain kind."""
    text = f"{family.split('_')[0]} {p.get('block_m')}x{p.get('block_n')} s{p.get('stages')}"
    marks = [("split_k", "k"), ("k_groups", "G"), ("warps_k", "wk"), ("min_blocks", "b")]
    text += "".join(f" {m}{p[k]}" for k, m in marks if p.get(k, 1) != 1)
    flags = [("persistent", "P"), ("swap_ab", "swap"), ("cluster_m", "mc")]
    text += "".join(f" {m}" for k, m in flags if p.get(k) not in (None, False, 1))
    return text + (" cp" if p.get("loader") == "cp_async" else "")


def oracle(rows: list[TuningRow]) -> dict[Problem, dict[str, float | None]]:
    """Per problem, each measured setting's log speed-up (mean over runs; None where it failed in most runs)."""
    seen: dict[Problem, dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.edited or r.status is Status.SKIPPED:
            continue
        cid = Candidate(r.problem, r.family, r.params).id
        seen[r.problem][cid].append(math.log(r.speedup) if r.status is Status.OK and r.speedup else None)
    return {p: {cid: (statistics.mean(ok) if len(ok := [v for v in vs if v is not None]) * 2 > len(vs) else None)
                for cid, vs in by_id.items()} for p, by_id in seen.items()}


def outcome(problem: Problem, results: dict[str, float | None], names: dict[str, str],
            runs: dict[str, list[int]]) -> Outcome:
    """A scored problem's row: its measured space, its best setting and speed-up, what each strategy needed."""
    best = max((cid for cid, v in results.items() if v is not None), key=results.get)
    return Outcome(problem, len(results), math.exp(results[best]), names[best], runs)


def _only(cls: type[BuiltinProposer], measured: set[str]) -> type[BuiltinProposer]:
    """The proposer, restricted to settings that were measured."""

    class Only(cls):
        def _space(self, state: SearchState, family) -> list[tuple[str, Candidate]]:
            return [(cid, c) for cid, c in super()._space(state, family) if cid in measured]

    return Only


def search(problem: Problem, results: dict[str, float | None], proposer: BuiltinProposer, seed: int, arch: str,
           device: DeviceFacts, budget: int | None = None) -> tuple[int, list[Candidate]]:
    """One search replayed against the measurements: the candidates proposed until one is within 2% of the best (the
    space's size + 1 if none ever is; with a budget, budget + 1 if none within it), and the candidates tried (all of
    the budget where one is given)."""
    target = max(v for v in results.values() if v is not None) + math.log(WITHIN)
    state = SearchState.start(problem, arch, seed, device)
    hit = None
    while (budget is None or len(state.tried) < budget) and (batch := proposer.propose(state, n=1)):
        for c in batch:
            reward = results[c.id]
            state.tried.append((c, None, None))
            state.bandit.update(arm_of(c), reward)
            if hit is None and reward is not None and reward >= target:
                hit = len(state.tried)
                if budget is None:
                    return hit, [c for c, _, _ in state.tried]
    return hit or (len(results) if budget is None else budget) + 1, [c for c, _, _ in state.tried]


def needed(problem: Problem, results: dict[str, float | None], proposer: BuiltinProposer, seed: int, arch: str,
           device: DeviceFacts) -> int:
    """Candidates proposed until one is within 2% of the best (the space's size + 1 if none ever is)."""
    return search(problem, results, proposer, seed, arch, device)[0]


def first_run(rows: list[TuningRow], device: str, seeds: int = 10, min_space: int = 20, arch: str = "sm_90a",
              rank_weight: float = RANK_WEIGHT, budget: int = BUDGET) -> list[Outcome]:
    """A first run on an empty database, replayed: the shapes with at least min_space measured settings, in the order
    they were first measured, each searched with `budget` candidates. The learned order's model is trained only on
    what its own replay tried on the shapes before (as a run's Learner retrains, here before every shape); today's
    order and random search run beside it. Per shape, the candidates until one is within 2% of the best (budget + 1
    if none was), one per seed."""
    mine = [r for r in rows if r.device == device]
    if not mine:
        return []
    facts = DeviceFacts.from_dict({"name": device, "sms": mine[0].sms})
    measured = oracle(mine)
    row_of = {(r.problem, Candidate(r.problem, r.family, r.params).id): r for r in mine}
    names = {cid: describe(r.family, r.params) for (_, cid), r in row_of.items()}
    shapes = [p for p in dict.fromkeys(r.problem for r in mine)
              if sum(v is not None for v in measured[p].values()) >= min_space]
    runs: dict[str, list[list[int]]] = {name: [[] for _ in shapes] for name in ("learned", "today", "random")}
    for seed in range(seeds):
        learned_rows: list[TuningRow] = []
        for i, problem in enumerate(shapes):
            results = measured[problem]
            walk, draw = _only(BuiltinProposer, set(results)), _only(RandomProposer, set(results))
            model, _ = train(learned_rows, device, rank_weight=rank_weight)
            n, tried = search(problem, results, walk(model), seed, arch, facts, budget)
            runs["learned"][i].append(n)
            learned_rows += [row_of[(problem, c.id)] for c in tried]
            runs["today"][i].append(search(problem, results, walk(), seed, arch, facts, budget)[0])
            runs["random"][i].append(search(problem, results, draw(seed), seed, arch, facts, budget)[0])
    return [outcome(problem, measured[problem], names, {name: counts[i] for name, counts in runs.items()})
            for i, problem in enumerate(shapes)]


def compare(rows: list[TuningRow], device: str, seeds: int = 10, min_space: int = 20, arch: str = "sm_90a",
            rank_weight: float = RANK_WEIGHT) -> list[Outcome]:
    """Per scored problem, the candidates each strategy needed, the model trained on every other shape."""
    mine = [r for r in rows if r.device == device]
    if not mine:
        return []
    facts = DeviceFacts.from_dict({"name": device, "sms": mine[0].sms})
    names = {Candidate(r.problem, r.family, r.params).id: describe(r.family, r.params) for r in mine}
    outcomes = []
    for problem, results in oracle(mine).items():
        ok = [v for v in results.values() if v is not None]
        if len(ok) < min_space:
            continue
        rest = [r for r in mine if r.problem.mnk != problem.mnk]  # both layouts of the shape held out
        model, _ = train(rest, device, rank_weight=rank_weight)
        walk, draw = _only(BuiltinProposer, set(results)), _only(RandomProposer, set(results))
        learned, today = walk(model), walk()
        runs = {
            # too little data without this shape: nothing learned to compare
            "learned": [needed(problem, results, learned, s, arch, facts) for s in range(seeds)] if model else [],
            "today": [needed(problem, results, today, s, arch, facts) for s in range(seeds)],
            "random": [needed(problem, results, draw(s), s, arch, facts) for s in range(seeds)],
        }
        outcomes.append(outcome(problem, results, names, runs))
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    def cell(counts: list[int]) -> str:
        return f"{statistics.median(counts):g} ({max(counts)})" if counts else "-"

    lines = ["| shape | space | best ratio | best setting | learned | today's order | random |",
             "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.problem.mnk}:{o.problem.b_layout} | {o.space} | {o.best:.3f}x | {o.best_setting} | "
                     f"{cell(o.needed['learned'])} | {cell(o.needed['today'])} | {cell(o.needed['random'])} |")
    lines.append("")
    for name in ("learned", "today", "random"):
        medians = [statistics.median(o.needed[name]) for o in outcomes if o.needed[name]]
        if medians:
            within = sum(max(o.needed[name]) <= BUDGET for o in outcomes if o.needed[name])
            lines.append(f"{name}: mean of the medians {statistics.mean(medians):.1f} candidates over "
                         f"{len(medians)} shapes; within {BUDGET} candidates on every seed: {within}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", type=Path, help="a tuning database")
    ap.add_argument("--runs", type=Path, nargs="*", default=[], help="run folders (imported into a scratch db)")
    ap.add_argument("--device", help="GPU model name (default: the one with most rows)")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--min-space", type=int, default=20, help="least passed settings for a shape to be scored")
    ap.add_argument("--rank-weight", type=float, default=RANK_WEIGHT, help="the rules' order as the model's prior")
    ap.add_argument("--first-run", action="store_true",
                    help=f"replay a first run instead: shapes in order, {BUDGET} candidates each, the model "
                         "trained only on what the replay tried before")
    args = ap.parse_args(argv)
    if bool(args.db) == bool(args.runs):
        print("error: give --db FILE or --runs RUN...", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        db = TuningDB(args.db) if args.db else TuningDB(Path(tmp) / "scratch.sqlite")
        for folder in args.runs:
            db.import_run(RunStore(folder))
        rows = db.rows()
        db.close()
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[r.device] += 1
    device = args.device or max(counts, key=counts.get, default=None)
    replay = first_run if args.first_run else compare
    outcomes = replay(rows, device, args.seeds, args.min_space, rank_weight=args.rank_weight) if device else []
    if not outcomes:
        print(f"error: no shape with {args.min_space} measured settings on {device or 'any GPU'}", file=sys.stderr)
        return 2
    print(f"{device}: candidates until one is within 2% of the best measured, median (worst) over {args.seeds} seeds;"
          + (f" a first run replayed, {BUDGET} candidates a shape ({BUDGET + 1}: none within them), the model trained "
             "on what it tried before" if args.first_run else " each shape held out of the model's training"))
    print(table(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
