"""`bench`: per shape, the best kernel the given runs found (or cuBLAS where none beat it), re-checked and re-timed
now next to cuBLAS in one worker: the honest ratio (every launch on new operands, the headline), warm and cold ratios,
the ratio of CUPTI's kernel durations, TFLOP/s, % of the roofline floor. Table, JSON, PNG. Where a problem fuses an
epilogue, "cuBLAS" is what the model runs instead (the baseline column names it).

The headline is the interleaved honest graph figure: graph timings alternate the two subjects replay by replay and
take the median of nine; CUPTI's durations are the median of six replays of each in A B B A order (docs/decisions.md
`bench-headline`, `cupti-abba`).

`--mode server` instead calls the exported op the way a serving process does (through its compiled op where that
builds): one call at a time at random (exponential) intervals, latency per call from issue to completion,
percentiles for ours and cuBLAS side by side.

A shape of one M that a run searched as part of a bucket of M (and not on its own) is benched as the export
dispatches it: the bucket's kernel, however it compares at this M, or cuBLAS where the bucket goes to cuBLAS.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from agent import buckets
from agent.store import RunStore
from core.device import H200, DeviceFacts
from core.records import BaselineJob, EvalJob, EvalResult, Problem, Status
from core.roofline import floor_pct


@dataclass(frozen=True)
class BenchRow:
    shape: str
    b_layout: str
    kernel: str  # "<run>/<candidate>" or "cuBLAS"
    ours_warm_us: float
    cublas_warm_us: float
    ours_cold_us: float
    cublas_cold_us: float
    ratio_warm: float
    ratio_cold: float
    tflops: float
    floor_pct: float
    ratio_cupti: float | None = None  # the same ratio from CUPTI kernel durations (no launch gaps)
    note: str = ""
    dtype: str = "f16"  # and "+bias" where the problem adds one, and its epilogue
    ratio_honest: float | None = None  # every launch on new operands: the headline
    baseline: str = "cuBLAS"


def best_across(stores: list[RunStore], problem: Problem) -> tuple[RunStore, str, float] | None:
    """The run and candidate with the highest median speed-up for this problem, if any beat cuBLAS (for a bucket of
    M: the candidate that serves it)."""
    found = []
    for s in stores:
        if problem.key in {p.key for p in s.problems()} and (
                win := buckets.serving(s, problem, problem.m) if problem.m_range else s.winner(problem)):
            found.append((s, win.candidate.id, win.speedup))
    top = max(found, key=lambda x: x[2], default=None)
    return top if top and top[2] > 1.0 else None


def row_from(problem: Problem, kernel: str, r: EvalResult, note: str = "", device: DeviceFacts = H200) -> BenchRow:
    ours_w, ours_c, ours_h = (r.warm, r.cold, r.honest) if r.warm else (r.cublas_warm, r.cublas_cold,
                                                                          r.cublas_honest)
    w, c = ours_w.median_us, ours_c.median_us
    cupti = r.cublas_warm.cupti_ratio(ours_w)
    honest = r.cublas_honest.median_us / ours_h.median_us if r.cublas_honest and ours_h else None
    return BenchRow(problem.mnk, problem.b_layout, kernel, w, r.cublas_warm.median_us, c, r.cublas_cold.median_us,
                    r.cublas_warm.median_us / w, r.cublas_cold.median_us / c if c > 0 else float("nan"),
                    problem.flops / w / 1e6, floor_pct(problem, device, w), cupti, note,
                    problem.dtype + ("+bias" if problem.bias else "")
                    + (f"+{problem.epilogue}" if problem.epilogue != "none" else ""), honest,
                    problem.fused.baseline)


def dispatched(stores: list[RunStore], problem: Problem) -> tuple[RunStore, str, Problem] | None:
    """For a problem of one M that no run searched as such: the first run's bucket holding its M, and the candidate
    an export of that run dispatches there ("cublas" where the bucket goes to cuBLAS)."""
    for s in stores:
        if problem.key not in {p.key for p in s.problems()} and (b := buckets.covering(s, problem)):
            served = buckets.serving(s, b, problem.m)
            return s, served.candidate.id if served else "cublas", b
    return None


def bench_offline(evaluate, stores: list[RunStore], problems: list[Problem], progress=print,
                  device: DeviceFacts = H200) -> list[BenchRow]:
    """Per problem a row: the best kernel of the runs re-checked and re-timed, or cuBLAS; `% floor` on `device`."""
    rows = []
    for p in problems:
        if (hit := dispatched(stores, p)) is not None:
            rows += _bench_bucketed(evaluate, p, *hit, progress, device)
            continue
        pick = best_across(stores, p)
        note, why = "", "no kernel of the runs beat it"
        if pick is not None:
            store, cid, _ = pick
            cand, build = store.candidate(cid), store.build(cid)
            r = evaluate(EvalJob.built(cid, p, cand.family, cand.params, build, honest=True))
            if r.status is Status.OK and r.speedup and r.speedup > 1.0:
                rows.append(row_from(p, f"{store.run_id}/{cid}", r, device=device))
                progress(f"{p.key}: {r.speedup:.3f}x")
                continue
            ratio = f" {r.speedup:.3f}x" if r.speedup else ""
            note = why = f"{cid} now {r.status.value}{ratio}: cuBLAS kept"
        r = evaluate(BaselineJob(p, honest=True))
        if r.status is not Status.OK:
            progress(f"{p.key}: cuBLAS timing failed: {r.reason}")
            continue
        rows.append(row_from(p, "cuBLAS", r, note, device))
        progress(f"{p.key}: cuBLAS ({why})")
    return rows


def _bench_bucketed(evaluate, p: Problem, store: RunStore, cid: str, b: Problem, progress,
                    device: DeviceFacts) -> list[BenchRow]:
    """A problem inside a bucket, timed as the export dispatches it: the bucket's kernel however it compares now,
    or cuBLAS where the bucket goes to cuBLAS."""
    note = f"M={p.m} in bucket {b.mnk}"
    if cid != "cublas":
        cand, build = store.candidate(cid), store.build(cid)
        r = evaluate(EvalJob.built(cid, p, cand.family, cand.params, build, honest=True))
        if r.status is Status.OK:
            progress(f"{p.key}: {r.speedup:.3f}x ({note})")
            return [row_from(p, f"{store.run_id}/{cid}", r, note, device)]
        note += f"; {cid} now {r.status.value}: cuBLAS"
    r = evaluate(BaselineJob(p, honest=True))
    if r.status is not Status.OK:
        progress(f"{p.key}: cuBLAS timing failed: {r.reason}")
        return []
    progress(f"{p.key}: cuBLAS ({note})")
    return [row_from(p, "cuBLAS", r, note, device)]


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x and x > 0]
    return statistics.geometric_mean(xs) if xs else float("nan")


def by_series(rows: list[BenchRow]) -> list[dict]:
    """Per series benched at several M (the same N, K, layout, dtype, bias and epilogue): how many M, how many ran a
    kernel, the geomean of each ratio and the lowest honest one with its M, in the rows' order."""
    groups: dict[tuple, list[BenchRow]] = {}
    for r in rows:
        groups.setdefault((r.shape.split("_", 1)[1], r.b_layout, r.dtype), []).append(r)
    out = []
    for (nk, layout, dtype), rs in groups.items():
        if len(rs) < 2:
            continue
        low = min(rs, key=lambda r: r.ratio_honest if r.ratio_honest else r.ratio_warm)
        out.append({"series": f"{nk}:{layout}:{dtype}", "m_values": len(rs),
                    "on_kernels": sum(r.kernel != "cuBLAS" for r in rs),
                    "honest": geomean([r.ratio_honest or float("nan") for r in rs]),
                    "warm": geomean([r.ratio_warm for r in rs]), "cold": geomean([r.ratio_cold for r in rs]),
                    "cupti": geomean([r.ratio_cupti or float("nan") for r in rs]),
                    "lowest": low.ratio_honest or low.ratio_warm, "lowest_m": int(low.shape.split("_")[0])})
    return out


def series_table(series: list[dict]):
    from rich.table import Table

    t = Table(title="per series benched at several M (geomeans; lowest by the honest ratio)")
    for col in ("series", "M values", "on our kernels", "honest", "lowest (at M)", "warm", "cold", "CUPTI"):
        t.add_column(col)
    for s in series:
        t.add_row(s["series"], str(s["m_values"]), str(s["on_kernels"]), f"{s['honest']:.3f}x",
                  f"{s['lowest']:.3f}x ({s['lowest_m']})", f"{s['warm']:.3f}x", f"{s['cold']:.3f}x",
                  f"{s['cupti']:.3f}x")
    return t


def write_outputs(rows: list[BenchRow], folder: Path, device: dict) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"device": device, "rows": [asdict(r) for r in rows],
            "geomean_honest": geomean([r.ratio_honest or float("nan") for r in rows]),
            "geomean_warm": geomean([r.ratio_warm for r in rows]),
            "geomean_cold": geomean([r.ratio_cold for r in rows]),
            "geomean_cupti": geomean([r.ratio_cupti or float("nan") for r in rows]), "series": by_series(rows)}
    out = [folder / "bench.json"]
    out[0].write_text(json.dumps(data, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return out
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows)), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.ratio_warm for r in rows], 0.4, label="warm L2")
    ax.bar([x + 0.2 for x in xs], [r.ratio_cold for r in rows], 0.4, label="cold L2")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), [f"{r.shape}:{r.b_layout}:{r.dtype}" for r in rows], rotation=70, fontsize=7)
    ax.set_ylabel("t_cuBLAS / t_ours")
    ax.set_title(f"{device.get('name', 'GPU')}: speed-up over cuBLAS (device time)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "bench.png", dpi=120)
    out.append(folder / "bench.png")
    return out


def bench_server(export_dir: Path, qps: float, seconds: float, timeout_s: float = 900) -> dict:
    """Runs sandbox.serve_bench in a fresh process on the exported op; returns its JSON report."""
    cmd = [sys.executable, "-m", "sandbox.serve_bench", str(export_dir), str(qps), str(seconds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr or proc.stdout).strip().splitlines()[-1] if (proc.stderr or proc.stdout)
                           else f"serve bench exited {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rows_table(rows: list[BenchRow], title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("shape", "B", "dtype", "kernel", "baseline", "ours µs", "baseline µs", "ratio (honest)", "warm",
                "cold", "CUPTI", "TFLOP/s", "% floor"):
        t.add_column(col)
    for r in rows:
        t.add_row(r.shape, r.b_layout, r.dtype, r.kernel, r.baseline, f"{r.ours_warm_us:,.2f}",
                  f"{r.cublas_warm_us:,.2f}", f"{r.ratio_honest:.3f}x" if r.ratio_honest else "-",
                  f"{r.ratio_warm:.3f}x", f"{r.ratio_cold:.3f}x", f"{r.ratio_cupti:.3f}x" if r.ratio_cupti else "-",
                  f"{r.tflops:.0f}", f"{r.floor_pct:.0f}%")
    honest, warm, cold, cupti = (geomean([x or float("nan") for x in xs]) for xs in (
        [r.ratio_honest for r in rows], [r.ratio_warm for r in rows], [r.ratio_cold for r in rows],
        [r.ratio_cupti for r in rows]))
    t.caption = f"geomean ratio: honest {honest:.3f}x (the headline), warm {warm:.3f}x, cold {cold:.3f}x, " \
                f"CUPTI {cupti:.3f}x"
    return t


def server_table(report: dict, qps: float):
    from rich.table import Table

    path = {"compiled": "compiled op", "python": "Python launch path"}.get(report["path"], report["path"])
    t = Table(title=f"server mode: single calls at {qps:g}/s (exponential gaps), latency µs incl. launch; ours "
                    f"through the {path}")
    for col in ("problem", "op", "ours p50", "p90", "p99", "cuBLAS p50", "p90", "p99"):
        t.add_column(col)
    for key, r in report["shapes"].items():
        o, c = r["ours"], r["cublas"]
        t.add_row(key, "kernel" if r["kernel"] else "cuBLAS", *(f"{o[q]:.1f}" for q in ("p50", "p90", "p99")),
                  *(f"{c[q]:.1f}" for q in ("p50", "p90", "p99")))
    return t
