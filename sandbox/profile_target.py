"""The process Nsight Compute profiles: launch one candidate kernel three times on fresh random inputs, then exit.

Usage: python -m sandbox.profile_target JOB.json, where the job (written by sandbox.profile, or tools/ncu_compare.py)
names the cubin file, the family, its parameters and the problem (its dtype and bias as the kernel takes them). ncu
skips the first two `hgemm` launches (first-use costs) and profiles the third. With "cublas": true in the job, cuBLAS
(as sandbox.timed calls it) then runs the same problem three times on the same inputs, and the largest
difference between the two outputs goes to stderr; otherwise it prints nothing on success, so ncu's CSV is all the
output there is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LAUNCHES = 3


def main(argv: list[str]) -> int:
    import torch

    from core.records import Problem
    from sandbox.check import TORCH_DTYPE
    from sandbox.launch import Kernel
    from sandbox.timed import cublas_launch

    job = json.loads(Path(argv[0]).read_text())
    p = Problem(**job["problem"])
    kernel = Kernel.for_family(Path(job["cubin"]).read_bytes(), job["family"], job["params"], p)
    dt = TORCH_DTYPE[p.dtype]
    a = torch.randn(p.m, p.k, device="cuda").to(dt)
    b = torch.randn(*((p.k, p.n) if p.b_layout == "kn" else (p.n, p.k)), device="cuda").to(dt)
    bias = torch.randn(p.n, device="cuda").to(dt) if p.bias else None
    r = torch.randn(p.m, p.n, device="cuda").to(dt) if p.fused.residual else None
    c = torch.empty(p.m, p.out_n, dtype=dt, device="cuda")
    for _ in range(LAUNCHES):
        kernel(a, b, c, p.m, p.n, p.k, bias, r)
    if job.get("cublas"):
        ref, cublas = torch.empty_like(c), cublas_launch(p)
        for _ in range(LAUNCHES):
            cublas(a, b, ref, p.m, p.n, p.k, bias, r)
        err = (ref.float() - c.float()).abs().max().item()  # (waits for both)
        print(f"max |ours - cuBLAS| = {err:.3g}", file=sys.stderr)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
