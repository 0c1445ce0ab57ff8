"""Built-in proposer + bandit against random search, replayed on a run that measured a whole parameter space.

    python tools/compare_search.py runs/<exhaustive-run> [--seeds 20]

For each shape of the run, the recorded results are the oracle: each strategy proposes from the same space and
"evaluates" by looking the candidate up. Reported: how many candidates each needed before one came within 2% of
the best speed-up in the space (median and worst over seeds). No GPU needed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.config import RunConfig  # noqa: E402
from agent.loop import SearchLoop  # noqa: E402
from agent.proposers.builtin import BuiltinProposer, RandomProposer  # noqa: E402
from agent.store import RunStore  # noqa: E402
from core.records import EvalResult, Status  # noqa: E402


def needed(store: RunStore, problem, oracle: dict[str, EvalResult], make, seed: int, target: float) -> int:
    order: list[str] = []

    def evaluate(job):
        order.append(job.candidate_id)
        return oracle.get(job.candidate_id) or EvalResult(job.candidate_id, Status.FAULT, "not in the oracle")

    with tempfile.TemporaryDirectory() as tmp:
        sim = RunStore(Path(tmp) / "sim", create=True)
        sim.add_problems([problem])
        config = RunConfig(max_candidates=len(oracle), budget_minutes=60, seed=seed)
        loop = SearchLoop(sim, config, make(seed), store.get_meta("arch"), evaluate)
        loop.remeasure_top = 0  # only the search order matters here
        loop.run([problem])
    for i, cid in enumerate(order, 1):
        r = oracle.get(cid)
        if r and r.speedup and r.speedup >= target:
            return i
    return len(order) + 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    store = RunStore(args.run)
    print("| shape | space | best ratio | builtin+bandit median (worst) | random median (worst) |")
    print("|---|---|---|---|---|")
    for p in store.problems():
        oracle = {c.id: r for c, r in store.results(p) if c.origin == "builtin"}
        speedups = [r.speedup for r in oracle.values() if r.speedup]
        if not speedups:
            continue
        target = 0.98 * max(speedups)
        rows = {}
        for name, make in (("builtin", lambda s: BuiltinProposer()), ("random", lambda s: RandomProposer(s))):
            counts = [needed(store, p, oracle, make, seed, target) for seed in range(args.seeds)]
            rows[name] = f"{statistics.median(counts):g} ({max(counts)})"
        print(f"| {p.mnk}:{p.b_layout} | {len(oracle)} | {max(speedups):.3f}x | {rows['builtin']} | {rows['random']} |")


if __name__ == "__main__":
    main()
