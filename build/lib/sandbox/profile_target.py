"""The process Nsight Compute profiles: launch one candidate kernel three times on fresh random inputs, then exit.

Usage: python -m sandbox.profile_target JOB.json, where the job (written by sandbox.profile) names the cubin file,
the family, its parameters and the problem. ncu skips the first two `hgemm` launches (first-use costs) and profiles
the third. It prints nothing on success, so ncu's CSV is all the output there is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LAUNCHES = 3


def main(argv: list[str]) -> int:
    import torch

    from core.records import Problem
    from sandbox.launch import Kernel

    job = json.loads(Path(argv[0]).read_text())
    p = Problem(**job["problem"])
    kernel = Kernel.for_family(Path(job["cubin"]).read_bytes(), job["family"], job["params"], p)
    a = torch.randn(p.m, p.k, device="cuda").half()
    b = torch.randn(*((p.k, p.n) if p.b_layout == "kn" else (p.n, p.k)), device="cuda").half()
    c = torch.empty(p.m, p.n, dtype=torch.float16, device="cuda")
    for _ in range(LAUNCHES):
        kernel(a, b, c, p.m, p.n, p.k)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
