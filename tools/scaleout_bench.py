"""Scale-out on one host with several GPUs: the same shapes, budget and cap run on one GPU, on every GPU
(`--gpus all`), on a local Dask cluster (a scheduler and one `dask worker` per GPU, started here), and on that
cluster again with one Dask worker killed (its whole process group: nanny, worker, GPU worker) mid-run.

    . tools/gpu_env.sh && python3 tools/scaleout_bench.py [--mnk M_N_K,... | --shapes FILE] [--max-candidates 12]

Prints, per run, the candidates evaluated per minute of search (first candidate to last record, worker start-up
excluded) and its ratio to one GPU; whether candidates evaluated in several runs got the same verdict; and whether
the run that lost a worker kept every record (one result per candidate, the cap reached, state done). Writes
$OUT/scaleout_bench.json when OUT is set. Cubins are compiled into a fresh cache first, so that every run compiles
from it: what is compared is GPUs, not compile parallelism. No profiling (--no-profile).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.shapes import parse_shape_list, read_shapes_file  # noqa: E402

SHAPES = "256_1024_256,1024_1024_1024,1000_3000_2000,2048_2048_2048,256_4096_4096,4096_4096_4096"
KILL_AT = 0.3  # share of the expected results recorded before a Dask worker is killed


def prebuild(problems, cache: Path) -> str:
    from core.device import H200
    from sandbox.build_pool import BuildPool
    from templates import families_for_arch

    os.environ["HGEMM_AGENT_CACHE"] = str(cache)
    pool = BuildPool(os.cpu_count() or 1)
    t0 = time.time()
    try:
        jobs = [pool.submit(fam.render(params, p), "sm_90a", "", 120) for p in problems
                for fam in families_for_arch("sm_90a") for params in fam.space(p, H200)]
        built = [j.result() for j in jobs]
    finally:
        pool.close()
    return f"{len(built)} cubins ({sum(not b.ok for b in built)} failed) in {time.time() - t0:.0f} s"


def agent_run(label: str, args: list[str], runs: Path, logs: Path, during=None) -> Path:
    """One `python -m agent run` in a runs folder of its own; `during(store_path)` runs alongside it."""
    folder = runs / label
    log = logs / f"{label}.log"
    t0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agent", "run", *args, "--runs-dir", str(folder)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
        if during is not None:
            threading.Thread(target=during, args=(folder,), daemon=True).start()
        rc = proc.wait(timeout=420)
    stores = list(folder.glob("*/run.sqlite"))
    print(f"{label}: rc {rc}, {time.time() - t0:.0f} s" + ("" if rc == 0 else f"; see {log}"), flush=True)
    if not stores:
        raise SystemExit(f"{label}: no run store; the log ends:\n" + "".join(log.read_text().splitlines(True)[-15:]))
    return stores[0]


def summarize(store: Path) -> dict:
    db = sqlite3.connect(store)
    one = lambda q: db.execute(q).fetchone()[0]  # noqa: E731
    first = one("SELECT MIN(created) FROM candidates")
    last = max(one("SELECT MAX(created) FROM results") or 0, one("SELECT MAX(created) FROM measurements") or 0)
    results = one("SELECT COUNT(*) FROM results")
    meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
    verdicts = dict(db.execute("SELECT candidate_id, status FROM results"))
    out = {"results": results, "candidates": one("SELECT COUNT(*) FROM candidates"),
           "without_result": one("SELECT COUNT(*) FROM candidates WHERE id NOT IN (SELECT candidate_id FROM results)"),
           "ok": sum(v == "ok" for v in verdicts.values()), "search_s": last - first,
           "per_minute": 60 * results / (last - first) if last > first else 0.0,
           "state": meta.get("state"), "executor": meta.get("executor", {}), "verdicts": verdicts,
           "winners": dict(db.execute("SELECT problem_key, candidate_id FROM winners"))}
    db.close()
    return out


def start_cluster(gpus: int, logs: Path) -> tuple[str, list[subprocess.Popen]]:
    """A scheduler and one Dask worker per GPU (--nthreads 1, its own CUDA_VISIBLE_DEVICES, not daemonic), each in
    a process group of its own so that one can be killed whole."""
    from distributed import Client

    port = 8786 + os.getpid() % 1000
    address = f"tcp://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               DASK_DISTRIBUTED__WORKER__DAEMON="False")
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", str(port), "--no-dashboard"], cwd=ROOT, env=env, start_new_session=True,
                              stdout=open(logs / "dask_scheduler.log", "w"), stderr=subprocess.STDOUT)]
    for g in range(gpus):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nworkers", "1", "--nthreads", "1",
             "--name", f"gpu{g}", "--no-dashboard"], cwd=ROOT, env=dict(env, CUDA_VISIBLE_DEVICES=str(g)),
            start_new_session=True, stdout=open(logs / f"dask_worker{g}.log", "w"), stderr=subprocess.STDOUT))
    with Client(address, timeout=60, set_as_default=False) as client:
        client.wait_for_workers(gpus, timeout=120)
    return address, procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def kill_when(worker: subprocess.Popen, expected: int, killed: dict):
    """Kill the Dask worker's process group once KILL_AT of the expected results are recorded."""
    def watch(folder: Path) -> None:
        while worker.poll() is None:
            time.sleep(0.5)
            stores = list(folder.glob("*/run.sqlite"))
            if not stores:
                continue
            db = sqlite3.connect(stores[0])
            try:
                done = db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
            except sqlite3.Error:  # the run is still creating its tables
                continue
            finally:
                db.close()
            if done >= KILL_AT * expected:
                os.killpg(worker.pid, signal.SIGKILL)
                killed.update(at_results=done, at=time.time())
                return
    return watch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mnk", default=SHAPES)
    ap.add_argument("--shapes", type=Path)
    ap.add_argument("--max-candidates", type=int, default=12)
    ap.add_argument("--budget-minutes", type=float, default=4.0)
    a = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"needs a host with at least 2 GPUs (this one shows {gpus})")
    problems = read_shapes_file(a.shapes, "kn") if a.shapes else parse_shape_list(a.mnk, "kn")
    shapes = ["--shapes", str(a.shapes)] if a.shapes else ["--mnk", a.mnk]
    common = [*shapes, "--budget-minutes", str(a.budget_minutes), "--max-candidates", str(a.max_candidates),
              "--no-profile"]
    expected = len(problems) * a.max_candidates
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    work = Path(tempfile.mkdtemp(prefix="scaleout-", dir=ROOT / ".cache" if (ROOT / ".cache").is_dir() else None))
    logs = out or work
    print(f"{gpus} GPUs; {len(problems)} shapes x {a.max_candidates} candidates; prebuild: "
          f"{prebuild(problems, work / 'cubins')}", flush=True)

    runs = {"one GPU": summarize(agent_run("one_gpu", common, work / "runs", logs)),
            "--gpus all": summarize(agent_run("all_gpus", [*common, "--gpus", "all"], work / "runs", logs))}
    address, procs = start_cluster(gpus, logs)
    killed: dict = {}
    try:
        runs["dask"] = summarize(agent_run("dask", [*common, "--cluster", address], work / "runs", logs))
        runs["dask, a worker killed"] = summarize(agent_run("dask_kill", [*common, "--cluster", address],
                                                            work / "runs", logs, kill_when(procs[1], expected, killed)))
    finally:
        stop(procs)
    report(runs, expected, killed, out)


def report(runs: dict, expected: int, killed: dict, out: Path | None) -> None:
    base = runs["one GPU"]["per_minute"]
    print(f"\n{'run':24} {'results':>7} {'ok':>4} {'search s':>8} {'cand/min':>8} {'ratio':>6}  state    workers")
    for label, r in runs.items():
        ex = r["executor"]
        where = f"{ex.get('serving', '?')} serving, {ex.get('retried', 0)} retried, " \
                f"{ex.get('lost_workers', 0)} lost"
        print(f"{label:24} {r['results']:7d} {r['ok']:4d} {r['search_s']:8.1f} {r['per_minute']:8.1f} "
              f"{r['per_minute'] / base if base else 0:6.2f}  {r['state']:8} {where}")
    ids = [set(r["verdicts"]) for r in runs.values()]
    shared = set.union(*[a & b for i, a in enumerate(ids) for b in ids[i + 1:]])
    differ = {cid: {label: r["verdicts"].get(cid) for label, r in runs.items()} for cid in shared
              if len({r["verdicts"][cid] for r in runs.values() if cid in r["verdicts"]}) > 1}
    print(f"\nverdicts: {len(shared)} candidates evaluated in more than one run, {len(differ)} disagree"
          + "".join(f"\n  {cid}: {v}" for cid, v in sorted(differ.items())))
    k = runs["dask, a worker killed"]
    kept = k["without_result"] == 0 and k["results"] == k["candidates"] == expected and k["state"] == "done"
    print(f"killed worker: at {killed.get('at_results', 'never')} of {expected} results; afterwards "
          f"{k['results']} results for {k['candidates']} candidates, {k['without_result']} without a result, "
          f"state {k['state']}: {'nothing lost' if kept else 'RECORDS MISSING'}")
    if out is not None:
        kept_runs = {label: {**{k: v for k, v in r.items() if k != "verdicts"},
                             "verdict_counts": Counter(r["verdicts"].values())} for label, r in runs.items()}
        (out / "scaleout_bench.json").write_text(json.dumps(
            {"runs": kept_runs, "expected": expected, "killed": killed, "disagree": differ, "shared": len(shared),
             "nothing_lost": kept}, indent=1))


if __name__ == "__main__":
    main()
