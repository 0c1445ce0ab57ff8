"""Where a candidate's evaluation spends its time: cProfile over the GPU worker's evaluate (in this process), for the
family's first setting on each shape, after one evaluation to warm up.

    python3 tools/prof_eval.py [--shapes 64_64_64,1024_1024_1024,4096_4096_4096] [--repeat 4] [--top 28] [--honest]

(--honest: the evaluation a re-measurement runs: the honest timing alone, every operand refilled before each launch.)

Prints per shape the wall seconds of each evaluation and the functions with the most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.shapes import parse_shape_list  # noqa: E402
from core.records import EvalJob  # noqa: E402
from sandbox.build import compile_cuda  # noqa: E402
from sandbox.worker import GpuContext  # noqa: E402
from templates import get_family  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="64_64_64,1024_1024_1024,4096_4096_4096")
    ap.add_argument("--family", default="sm90_wgmma")
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--top", type=int, default=28)
    ap.add_argument("--honest", action="store_true", help="profile the honest re-measurement's evaluation")
    args = ap.parse_args(argv)
    ctx = GpuContext(0)
    family = get_family(args.family)
    for problem in parse_shape_list(args.shapes):
        params = family.space(problem, ctx.facts)[0]
        job = EvalJob("profiled", problem, family.name, params, compile_cuda(family.render(params, problem)).cubin,
                      honest=args.honest, honest_only=args.honest)
        ctx.evaluate(job, lambda s: None)
        prof, walls = cProfile.Profile(), []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            prof.enable()
            result, _ = ctx.evaluate(job, lambda s: None)
            prof.disable()
            walls.append(round(time.perf_counter() - t0, 3))
        print(f"== {problem.key}: {result.status.value}, wall s {walls}")
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.top)
        print("\n".join(line[:150] for line in text.getvalue().splitlines()[6:]))


if __name__ == "__main__":
    main()
