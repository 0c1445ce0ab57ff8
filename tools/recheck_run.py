"""Judge every candidate of a run again under today's checks (correctness only, no timing), on this machine's GPU.

    python3 tools/recheck_run.py runs/RUN/run.sqlite [--time]

For each candidate that compiled, its recorded cubin goes through the sandboxed worker (the same checks `run`
applies); prints how many pass, and every candidate whose verdict differs from the recorded one. `--time` also times
them (warm, cold and the fresh re-check where it applies), as `run` does.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.store import RunStore  # noqa: E402
from core.records import EvalJob, Status  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store", type=Path, help="a run's run.sqlite")
    ap.add_argument("--time", action="store_true", help="time them too")
    args = ap.parse_args()
    from sandbox.pool import WorkerPool

    store = RunStore(args.store.parent)
    pool = WorkerPool()
    pool.start()
    now, changed = Counter(), []
    try:
        for problem in store.problems():
            for cand, before in store.results(problem):
                build = store.build(cand.id)
                if build is None or not build.ok:
                    continue
                r = pool.evaluate(EvalJob.built(cand.id, problem, cand.family, cand.params, build, time_it=args.time))
                now[r.status.value] += 1
                if (r.status is Status.OK) != (before.status is Status.OK):
                    changed.append(f"{problem.key} {cand.id} {cand.family}: was {before.status.value}, now "
                                   f"{r.status.value} {r.reason[:160]}")
    finally:
        pool.close()
    print(f"{sum(now.values())} candidates judged again: " + ", ".join(f"{k} {v}" for k, v in sorted(now.items())))
    print("\n".join(changed) or "no verdict changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
