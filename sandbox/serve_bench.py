"""Serving-style latency of the exported op (run as its own process: python -m sandbox.serve_bench DIR QPS SECONDS).

Single calls at random (exponential) intervals, as a serving process issues them, through `hgemm_ops.mm` /
`hgemm_ops.linear` exactly as a user calls them (the compiled op where it builds, else the Python launch path: the
report names which); cuBLAS (`torch.matmul` / `F.linear`) called the same way, interleaved. Latency is host time
from the call to the end of `torch.cuda.synchronize()`: launch overhead counts here. Prints one JSON line: the launch
path, and per problem p50/p90/p99 in microseconds for ours and cuBLAS.
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


def load_ops(folder: Path):
    """The export's hgemm_ops, registered as `import hgemm_ops` would (torch.compile looks modules up by name)."""
    spec = importlib.util.spec_from_file_location("hgemm_ops", folder / "hgemm_ops.py")
    ops = sys.modules["hgemm_ops"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    return ops


def gpu_ops(folder: Path):
    """load_ops(folder) where a CUDA GPU is present; None where not, with a one-line error on stderr (a timing tool
    then exits 2)."""
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return None
    return load_ops(folder)


def main(folder: str, qps: float, seconds: float) -> dict:
    ops = load_ops(Path(folder))
    keys = list(ops.MANIFEST["kernels"]) + list(ops.MANIFEST.get("cublas", []))
    rng = random.Random(0)
    shapes = {}
    check = ops._sibling("hgemm_selfcheck")
    for key in keys:
        args = check.operands(ops, key)
        ours = functools.partial(check.call, ops, ops, *args)  # hgemm_ops' calls, as a user makes them
        ref = functools.partial(ops.fallback, *args)  # what PyTorch computes for the call
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
        shapes[key] = {name: percentiles(v) for name, v in lat.items()}
        shapes[key]["kernel"] = key in ops.MANIFEST["kernels"]
    return {"path": ops.path(), "shapes": shapes}


if __name__ == "__main__":
    with torch.inference_mode():
        print(json.dumps(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))))
