"""Compile every family's parameter space for a set of shapes into the cubin cache, ahead of a GPU session.

    python tools/prebuild.py ../shared/shapes/dev.txt --arch sm_90a --cache .cache/cubins

The cache key includes the NVRTC version, so prebuilt cubins are used only where the same NVRTC would build them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.shapes import read_shapes_file  # noqa: E402
from sandbox.build_pool import BuildPool  # noqa: E402
from templates import families_for_arch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", type=Path)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--cache", type=Path, default=Path(".cache/cubins"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--b-layout", choices=("kn", "nk", "both"), default="both")
    ap.add_argument("--top", type=int, default=0, help="only each family's first N settings a shape (0: all)")
    args = ap.parse_args()
    sources = set()
    for layout in ("kn", "nk") if args.b_layout == "both" else (args.b_layout,):
        for p in read_shapes_file(args.shapes, layout):
            for fam in families_for_arch(args.arch):
                settings = fam.space(p)
                sources.update(fam.render(params, p) for params in settings[: args.top or len(settings)])
    t0 = time.time()
    os.environ["HGEMM_AGENT_CACHE"] = str(args.cache)  # the build processes' cache (they start after this)
    pool = BuildPool(max(1, args.jobs))
    try:
        builds = [f.result() for f in [pool.submit(s, args.arch, "", 120.0) for s in sorted(sources)]]
    finally:
        pool.close()
    bad = [b for b in builds if not b.ok]
    print(f"{len(builds)} sources, {sum(b.cached for b in builds)} cached, {len(bad)} failed, {time.time() - t0:.0f} s")
    for b in bad:
        print(b.error)


if __name__ == "__main__":
    main()
