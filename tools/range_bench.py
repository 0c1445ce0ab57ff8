"""The shapes files of issue 34's benchmark: Llama-3-8B's projections as ranges of M to search, and M values that
are no bucket's middle to bench them at. The same seed always writes the same files.

    python tools/range_bench.py --out DIR [--seed 0] [--hi 256] [--per-series 64]
    python -m agent run --shapes DIR/ranges.txt --no-profile        # on the GPU
    python -m agent export RUN
    python -m agent bench RUN --shapes DIR/bench.txt               # geomean of ours (kernel or cuBLAS) / cuBLAS,
                                                                   # and a line per (N, K, dtype)

ranges.txt: `1-HI_N_K:nk:DTYPE` for each (N, K) of Llama-3-8B's projections (q/o 4096 x 4096, k/v 1024 x 4096,
gate/up 14336 x 4096, down 4096 x 14336), fp16 and bf16. bench.txt: per (N, K, dtype) `--per-series` M values,
none the middle of a bucket of more than one M: every M from 1 to 32 that is not, then distinct random ones up to HI.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent import buckets  # noqa: E402
from core.records import Problem  # noqa: E402

LLAMA3_8B = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336))  # (N, K) of q/o, k/v, gate/up, down
DTYPES = ("f16", "bf16")


def middles(hi: int) -> set[int]:
    """The M each bucket of 1-hi with more than one M is searched at."""
    return {buckets.representative(a, b) for a, b in buckets.split(1, hi) if b > a}


def bench_ms(hi: int, count: int, rng: random.Random) -> list[int]:
    skip = middles(hi)
    ms = [m for m in range(1, min(32, hi) + 1) if m not in skip][:count]
    rest = [m for m in range(33, hi + 1) if m not in skip]
    return sorted(ms + rng.sample(rest, min(len(rest), count - len(ms))))


def write(out: Path, seed: int, hi: int, count: int) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    series = [(n, k, dtype) for n, k in LLAMA3_8B for dtype in DTYPES]
    ranges = [Problem(buckets.representative(1, hi), n, k, "nk", dtype, m_range=(1, hi)) for n, k, dtype in series]
    bench = [Problem(m, n, k, "nk", dtype) for n, k, dtype in series for m in bench_ms(hi, count, rng)]
    head = f"# issue 34: Llama-3-8B projections, M 1-{hi} (tools/range_bench.py --seed {seed})\n"
    paths = out / "ranges.txt", out / "bench.txt"
    paths[0].write_text(head + "".join(f"{p.key}\n" for p in ranges))
    paths[1].write_text(head + "# M values that are no bucket's middle\n" + "".join(f"{p.key}\n" for p in bench))
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hi", type=int, default=256, help="the ranges' upper end")
    p.add_argument("--per-series", type=int, default=64, help="bench M values per (N, K, dtype)")
    args = p.parse_args(argv)
    for path in write(args.out, args.seed, args.hi, args.per_series):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
