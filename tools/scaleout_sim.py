"""The scale-out of the search loop itself, without a GPU: the same shapes and cap searched with 1 and with 2 (or
more) stand-in GPU workers, each evaluation a fixed sleep, through the real loop, store, build pool and worker pool.

    python tools/scaleout_sim.py [--gpus 1,2] [--seconds 0.22] [--max-candidates 16] [--mnk M_N_K,...]

Prints candidates per minute of search and the ratio to the first count of GPUs. Where the ratio falls short of the
GPU count here, the loop (proposing, rendering, recording, dispatching) is what holds the GPUs back; where it does
not and `tools/scaleout_bench.py` on real GPUs does, look at the GPU workers. The first pass compiles every
candidate into --cache (NVRTC, minutes on two cores), so that the timed passes read cubins from it as a prebuilt
run would.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = "256_1024_256,1024_1024_1024,1000_3000_2000,2048_2048_2048,256_4096_4096,4096_4096_4096"


def search(problems, gpus: int, seconds: float, cap: int) -> tuple[int, float]:
    """Results recorded and seconds taken by one search on `gpus` stand-in workers."""
    from agent.config import RunConfig
    from agent.loop import SearchLoop
    from agent.proposers.builtin import BuiltinProposer
    from agent.runner import build_pools
    from agent.store import RunStore
    from sandbox.pool import WorkerPool
    from tests import fake_workers

    os.environ["FAKE_SLEEP"] = str(seconds)
    with tempfile.TemporaryDirectory() as tmp, WorkerPool(tuple(range(gpus)),
                                                         target=fake_workers.timed_like_fake_evaluate) as pool:
        pool.start()
        store = RunStore(Path(tmp) / "run", create=True)
        store.add_problems(problems)
        builder, ahead = build_pools(gpus, compile_only=False)  # as a run has them
        t0 = time.monotonic()
        try:
            SearchLoop(store, RunConfig(max_candidates=cap, profile=False, budget_minutes=60), BuiltinProposer(),
                       "sm_90a", pool, builder=builder, ahead=ahead).run(problems)
        finally:
            builder.close()
            ahead.close()
        return sum(len(store.results(p)) for p in problems), time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1,2", help="counts of stand-in GPUs to compare, the first is the baseline")
    ap.add_argument("--seconds", type=float, default=0.22, help="one evaluation (0.22: a small kernel on the H200)")
    ap.add_argument("--max-candidates", type=int, default=16)
    ap.add_argument("--mnk", default=SHAPES)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "hgemm-scaleout-sim-cubins")
    args = ap.parse_args(argv)
    try:
        counts = [int(g) for g in args.gpus.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        print(f"error: --gpus takes counts like 1,2 (got {args.gpus!r})", file=sys.stderr)
        return 2
    os.environ["HGEMM_AGENT_CACHE"] = str(args.cache)  # read by sandbox.build at import, here and in build processes
    from agent.shapes import ShapeError, parse_shape_list

    try:
        problems = parse_shape_list(args.mnk)
    except ShapeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    search(problems, 1, 0.0, args.max_candidates)  # compiles into the cache; not timed
    base = None
    for gpus in counts:
        n, seconds = search(problems, gpus, args.seconds, args.max_candidates)
        rate = n / seconds * 60
        base = base or rate
        print(f"{gpus} stand-in GPU(s), {args.seconds} s an evaluation: {n} results in {seconds:.1f} s, "
              f"{rate:.0f} candidates/min, {rate / base:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
