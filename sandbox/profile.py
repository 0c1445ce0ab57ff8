"""Profile one compiled candidate under Nsight Compute (ncu) and sum up what limits it in one line.

ncu runs `python -m sandbox.profile_target` (a short-lived process that launches the kernel three times) and
profiles the third `hgemm` launch only, at the GPU's own clocks; the GPU worker's context is not touched. ncu's
default cache control flushes caches before each replay pass, so the L2 hit rate is that of a cold launch.
Every failure (no ncu, no counter permission, metric names this ncu does not know, a timeout) is data in the
`ProfileResult`, never an exception.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from core.records import Problem, ProfileResult

NCU_ENV = "HGEMM_AGENT_NCU"  # path of the ncu to use (tests point it at a fake)
NCU_MISSING = "Nsight Compute (ncu) not found"
NO_COUNTERS = "ncu cannot read the GPU performance counters"
# ncu's words when the counters are out of reach: no permission, or a runtime (e.g. gVisor) without the profiler
NO_COUNTERS_SIGNS = ("ERR_NVGPUCTRPERM", "Failed to initialize the profiler")
REPO_ROOT = Path(__file__).resolve().parent.parent

# (our name, ncu metric): the core set every ncu since 2020 knows, then extras that depend on version and chip
CORE_METRICS: tuple[tuple[str, str], ...] = (
    ("l2_hit_pct", "lts__t_sector_hit_rate.pct"),
    ("dram_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("sm_pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("occupancy_pct", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("duration_us", "gpu__time_duration.sum"),
)
STALLS = ("long_scoreboard", "barrier", "mio_throttle", "math_pipe_throttle", "wait", "short_scoreboard",
          "not_selected", "lg_throttle", "no_instruction")
EXTRA_METRICS: tuple[tuple[str, str], ...] = (
    ("dram_pct", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("tensor_hmma_pct", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("tensor_gmma_pct", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("warp_cycles_per_issue", "smsp__average_warp_latency_per_inst_issued.ratio"),
    *((f"stall_{r}", f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio") for r in STALLS),
)
ALL_METRICS = CORE_METRICS + EXTRA_METRICS
BOUND_PCT = 60.0  # a unit busier than this share of its peak is what bounds the kernel
TIME_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
              "second": 1e6, "s": 1e6}


def find_ncu(explicit: str | None = None) -> str | None:
    """The ncu to run: an explicit path, $HGEMM_AGENT_NCU, PATH, then the usual install folders."""
    for path in (explicit, os.environ.get(NCU_ENV)):
        if path:
            return path if os.access(path, os.X_OK) else None
    candidates = [shutil.which("ncu"), "/usr/local/cuda/bin/ncu",
                  *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def profile_candidate(cubin: bytes, family: str, params: dict[str, Any], problem: Problem, timeout_s: float = 120,
                      ncu: str | None = None, device: int | None = None) -> ProfileResult:
    """Profile the candidate's kernel on fresh random inputs; ok False with the reason when that cannot be done.
    `device`: which of this process's GPUs (default the first) the profiled process sees as its only one."""
    exe = find_ncu(ncu)
    if exe is None:
        return ProfileResult(False, error=NCU_MISSING)
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="hgemm-profile-") as tmp:
        cubin_path, job_path = Path(tmp) / "kernel.cubin", Path(tmp) / "job.json"
        cubin_path.write_bytes(cubin)
        job_path.write_text(json.dumps({"cubin": str(cubin_path), "family": family, "params": params,
                                        "problem": asdict(problem)}))
        wanted = list(ALL_METRICS)
        for attempt in range(3):
            try:
                output = _run_ncu(exe, [m for _, m in wanted], job_path, deadline - time.monotonic(), device)
            except subprocess.TimeoutExpired:
                return ProfileResult(False, error=f"ncu timed out after {timeout_s:.0f} s")
            except OSError as e:
                return ProfileResult(False, error=f"ncu could not start: {e}")
            if sign := next((line for line in output.splitlines() if any(s in line for s in NO_COUNTERS_SIGNS)), ""):
                return ProfileResult(False, error=f"{NO_COUNTERS} ({sign.removeprefix('==ERROR== ')[:200]})")
            if metrics := named_metrics(parse_ncu_csv(output), wanted):
                return ProfileResult(True, metrics, summarize(metrics))
            if "metric" not in output.lower() or wanted == list(CORE_METRICS):
                break  # not a metric this ncu or chip lacks: asking for fewer will not help
            # first drop what ncu named as unknown (the tensor pipe it does not have), then fall back to the core set
            rejected = rejected_metrics(output, [m for _, m in wanted]) if attempt == 0 else set()
            kept = [w for w in wanted if w[1] not in rejected]
            wanted = kept if rejected and len(kept) < len(wanted) else list(CORE_METRICS)
    return ProfileResult(False, error=_error_text(output))


def visible_device(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES value under which a child process sees only this process's GPU `index`."""
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is None:
        return str(index)
    entries = [d.strip() for d in visible.split(",") if d.strip()]
    return entries[index] if index < len(entries) else str(index)


def _run_ncu(exe: str, metrics: list[str], job_path: Path, timeout_s: float, device: int | None = None) -> str:
    if timeout_s <= 0:
        raise subprocess.TimeoutExpired(exe, 0)
    cmd = [exe, "--clock-control", "none", "--target-processes", "all", "--kernel-name", "hgemm",
           "--launch-skip", "2", "--launch-count", "1", "--csv", "--page", "raw", "--print-units", "base",
           "--metrics", ",".join(metrics), sys.executable, "-m", "sandbox.profile_target", str(job_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    if device is not None:  # the profiled kernel runs on the GPU whose worker holds no other job meanwhile
        env["CUDA_VISIBLE_DEVICES"] = visible_device(device)
    # a session of its own, so that a timeout kills ncu and the process it profiles together
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return out


def parse_ncu_csv(text: str) -> dict[str, float]:
    """ncu metric name -> value (time in µs) from `--csv` output, wide (`--page raw`) or long (details) layout."""
    lines = [line for line in text.splitlines() if line.startswith('"')]  # drops ==PROF== lines and the target's
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return {}
    rows = list(csv.reader(lines[start:]))
    header, body = rows[0], rows[1:]
    out: dict[str, float] = {}
    if "Metric Name" in header:
        name_i, unit_i, value_i = (header.index(c) for c in ("Metric Name", "Metric Unit", "Metric Value"))
        for row in body:
            if len(row) > value_i and (v := _number(row[value_i], row[unit_i])) is not None:
                out[row[name_i]] = v
        return out
    units = body[0] if body and not body[0][0] else [""] * len(header)
    data = [row for row in body if row and row[0]]
    if not data:
        return {}
    for name, unit, value in zip(header, units, data[-1], strict=False):  # the last profiled launch
        if "__" in name and (v := _number(value, unit)) is not None:
            out[name] = v
    return out


def _number(value: str, unit: str) -> float | None:
    try:
        v = float(value.replace(",", ""))
    except ValueError:  # "n/a", empty
        return None
    return v * TIME_UNITS.get(unit.strip(), 1.0) if unit else v


def named_metrics(raw: dict[str, float], wanted: list[tuple[str, str]]) -> dict[str, float]:
    """Our names for what came back; tensor pipe = the busier of the mma and wgmma pipes; stalls as shares."""
    out: dict[str, float] = {}
    for name, metric in wanted:
        if metric in raw and name not in out:
            out[name] = raw[metric]
    if not any(name in out for name, _ in CORE_METRICS[:3]):
        return {}
    pipes = [out[k] for k in ("tensor_hmma_pct", "tensor_gmma_pct") if k in out]
    if pipes:
        out["tensor_pct"] = max(pipes)
    stalls = {k: out.pop(k) for k in [k for k in out if k.startswith("stall_")]}
    total = out.get("warp_cycles_per_issue") or sum(stalls.values())
    if total > 0:
        out.update({f"{k}_pct": 100.0 * v / total for k, v in stalls.items()})
    return out


def classify(metrics: dict[str, float]) -> str:
    dram, sm = metrics.get("dram_pct"), metrics.get("sm_pct")
    if dram is None and sm is None:
        return ""
    dram, sm = dram or 0.0, sm or 0.0
    if max(dram, sm) < BOUND_PCT:
        return "latency-bound (neither DRAM nor SM busy)"
    return "memory-bound" if dram >= sm else "compute-bound"


def top_stalls(metrics: dict[str, float], n: int = 2) -> list[tuple[str, float]]:
    stalls = [(k[len("stall_"):-len("_pct")], v) for k, v in metrics.items() if k.startswith("stall_")]
    return sorted(stalls, key=lambda s: -s[1])[:n]


def summarize(metrics: dict[str, float]) -> str:
    """One line a human and a prompt can read: the busy units, the verdict, the main stall reasons."""
    labels = (("l2_hit_pct", "L2 hit {:.0f}%"), ("dram_pct", "DRAM {:.0f}% busy"), ("sm_pct", "SM {:.0f}%"),
              ("tensor_pct", "tensor pipe {:.0f}%"), ("occupancy_pct", "occupancy {:.0f}%"))
    text = ", ".join(fmt.format(metrics[k]) for k, fmt in labels if k in metrics)
    if verdict := classify(metrics):
        text += f": {verdict}"
    if stalls := top_stalls(metrics):
        text += "; top stalls " + ", ".join(f"{name} {pct:.0f}%" for name, pct in stalls)
    return text


def rejected_metrics(output: str, requested: list[str]) -> set[str]:
    """The requested metrics that ncu's error lines name (it reports unknown ones as `metric regex:^name...`)."""
    errors = "\n".join(line for line in output.splitlines() if "ERROR" in line or "metric" in line.lower())
    return {m for m in requested if re.search(re.escape(m.split(".")[0]) + r"\b", errors)}


def _error_text(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("==ERROR==")] or output.strip().splitlines()
    text = "\n".join(lines[-6:]) or "ncu produced no output"
    return "ncu gave no metrics: " + (text if len(text) <= 500 else text[:485] + " ...[truncated]")
