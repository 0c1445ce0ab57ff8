"""Serving-style latency of the exported op (run as its own process: python -m sandbox.serve_bench DIR QPS SECONDS).

Single calls at random (exponential) intervals, as a serving process issues them, through `hgemm_ops.mm` /
`hgemm_ops.linear` exactly as a user calls them; cuBLAS (`torch.matmul`) called the same way, interleaved.
Latency is host time from the call to the end of `torch.cuda.synchronize()`: launch overhead counts here.
Prints one JSON line: per shape, p50/p90/p99 in microseconds for ours and cuBLAS.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

import torch


def percentiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "n": len(s)}


def main(folder: str, qps: float, seconds: float) -> dict:
    spec = importlib.util.spec_from_file_location("hgemm_ops", Path(folder) / "hgemm_ops.py")
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    keys = list(ops.MANIFEST["kernels"]) + list(ops.MANIFEST.get("cublas", []))
    rng = random.Random(0)
    report = {}
    for key in keys:
        mnk, layout = key.split(":")[:2]
        m, n, k = (int(x) for x in mnk.split("_"))
        a = torch.randn(m, k, device="cuda").half()
        b = torch.randn(k, n, device="cuda").half() if layout == "kn" else torch.randn(n, k, device="cuda").half()
        ours_op, ref_op = (ops.mm, torch.matmul) if layout == "kn" else (ops.linear, torch.nn.functional.linear)
        ours, ref = functools.partial(ours_op, a, b), functools.partial(ref_op, a, b)
        for f in (ours, ref):  # load and warm up outside the measurement
            f()
        torch.cuda.synchronize()
        lat = {"ours": [], "cublas": []}
        end = time.perf_counter() + seconds / max(1, len(keys))
        while time.perf_counter() < end:
            for name, f in (("ours", ours), ("cublas", ref)):
                time.sleep(rng.expovariate(qps))
                t0 = time.perf_counter()
                f()
                torch.cuda.synchronize()
                lat[name].append((time.perf_counter() - t0) * 1e6)
        report[key] = {name: percentiles(v) for name, v in lat.items()}
        report[key]["kernel"] = key in ops.MANIFEST["kernels"]
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))))
