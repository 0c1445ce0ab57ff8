"""Sweep a kernel family's settings over shapes on the GPU: render, compile, check and time, one table.

    python3 tools/sweep.py --family sm90_wgmma --shapes 1024_1024_1024,64_1024_16384:nk --top 4
    python3 tools/sweep.py --shapes 4096_4096_4096:both --top 2 --update '{"epilogue": "tma"}'
    python3 tools/sweep.py --shapes-file FILE --top 0 --params '{"block_m": 64, "block_n": 128, "split_k": 2}'
    python3 tools/sweep.py --shapes 4096_4096_4096 --template OLD.cu.j2    # the same sweep on another template
    python3 tools/sweep.py --top 0 --settings FILE.json    # each shape's own settings (tools/compare_orders.py)

Per shape (M_N_K[:kn|nk|both], or lines of a shapes file): space()'s first --top settings and each --params setting,
each followed by every --update applied to it (with a shallower ring where its own no longer fits); with --settings,
also the settings a JSON file lists for the shape (an object {"M_N_K:layout": [setting, ...]}; its shapes are swept
too). Each is rendered,
compiled by sandbox.build.compile_cuda in a BuildPool (NVRTC, the cubin cache, --jobs processes) and evaluated by the
sandboxed GPU worker (sandbox.pool.WorkerPool): the full correctness checks, then warm and cold-L2 device time next
to cuBLAS in the same process. Rows print as they finish; everything goes to --json (default $OUT/sweep.json where
$OUT is set).
Exit code 1 where a setting failed to render or compile, was wrong, faulted or hung; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.shapes import ShapeError, parse_shape  # noqa: E402
from core.device import H200, DeviceFacts  # noqa: E402
from core.records import BuildResult, Candidate, EvalJob, EvalResult, Problem, Status  # noqa: E402
from sandbox.build import DEFAULT_CACHE  # noqa: E402
from sandbox.build_pool import BuildPool  # noqa: E402
from templates import get_family  # noqa: E402
from templates.family import Family  # noqa: E402

FAILED = (Status.COMPILE_ERROR, Status.WRONG, Status.FAULT, Status.TIMEOUT)
HEADER = (f"{'shape':>15} {'B':>2} {'setting':<40} {'status':<13} {'µs':>8} {'cuBLAS µs':>9} {'warm':>6} {'cold':>6} "
          f"{'CUPTI':>6} {'regs/spill':>10}")

COMPILE_TIMEOUT_S = 120.0


@dataclass
class Row:
    problem: Problem
    label: str  # where the setting came from: "#3" space()'s fourth, "p1" the first --params, "+u1" the first --update
    params: dict[str, Any] | None  # None: no valid setting (the reason is in result)
    candidate_id: str = ""
    source: str = ""
    build: BuildResult | None = None
    result: EvalResult | None = None


def parse_shapes(text: str, default_layout: str) -> list[Problem]:
    """Comma- or line-separated M_N_K[:kn|nk|both], or whole problem keys (M_N_K:layout:dtype[:bias][:epilogue]);
    `#` starts a comment."""
    problems = []
    for item in (s.split("#", 1)[0].strip() for line in text.splitlines() for s in line.split(",")):
        if item.count(":") > 1:
            problems.append(parse_shape(item))
        elif item:
            mnk, _, layout = item.partition(":")
            layout = layout or default_layout
            if layout not in ("kn", "nk", "both"):
                raise ShapeError(f"{item!r}: the layout after ':' is kn, nk or both")
            problems += [parse_shape(mnk, lay) for lay in (("kn", "nk") if layout == "both" else (layout,))]
    if not problems:
        raise ShapeError("no shape given")
    return list(dict.fromkeys(problems))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="sm90_wgmma")
    ap.add_argument("--shapes", default="", help="M_N_K[:kn|nk|both][,...]")
    ap.add_argument("--shapes-file", type=Path)
    ap.add_argument("--b-layout", choices=("kn", "nk", "both"), default="kn", help="for shapes without a suffix")
    ap.add_argument("--top", type=int, default=4, help="space()'s first N settings per shape (0: none)")
    ap.add_argument("--params", type=json.loads, action="append", default=[], help="a setting as JSON (repeatable)")
    ap.add_argument("--update", type=json.loads, action="append", default=[],
                    help="JSON fields changed in every setting, compared beside it (repeatable)")
    ap.add_argument("--settings", type=Path, help='JSON {"M_N_K:layout": [setting, ...]}: settings of one shape each')
    ap.add_argument("--template", type=Path, help="render from this template file instead of the family's")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="cubin cache folder")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--kernel-timeout", type=float, default=5.0, help="seconds beyond a phase's expected time")
    ap.add_argument("--budget-s", type=float, help="evaluate no further setting after this many seconds")
    ap.add_argument("--json", type=Path, help="default: $OUT/sweep.json where $OUT is set")
    ap.add_argument("--compile-only", action="store_true", help="render and compile (no GPU)")
    args = ap.parse_args(argv)
    try:
        own = json.loads(args.settings.read_text()) if args.settings else {}
        if not isinstance(own, dict) or not all(isinstance(v, list) for v in own.values()):
            raise ValueError(f"{args.settings}: expected an object of lists of settings by shape")
        args.own = {parse_shape(key): value for key, value in own.items()}
        text = args.shapes + ("\n" + args.shapes_file.read_text() if args.shapes_file else "")
        listed = parse_shapes(text, args.b_layout) if text.strip() or not args.own else []  # none: an error
        args.problems = list(dict.fromkeys(listed + list(args.own)))
        args.family = get_family(args.family)
        args.template_text = args.template.read_text() if args.template else None
    except (ValueError, OSError) as e:
        ap.error(str(e))
    if any(not isinstance(p, dict) for p in args.params + args.update + [q for v in args.own.values() for q in v]):
        ap.error("--params, --update and --settings take JSON objects (in --settings, a list of them per shape)")
    if args.json is None and os.environ.get("OUT"):
        args.json = Path(os.environ["OUT"]) / "sweep.json"
    return args


def fit(family: Family, problem: Problem, params: dict, update: dict | None = None) -> tuple[dict | None, str]:
    """params changed by update and validated for the problem, else None and why. An update can make the ring too
    big for shared memory (a TMA-store epilogue's staging buffer): then the deepest ring that still fits."""
    merged = {**params, **(update or {})}
    tries = [merged]
    if update and "stages" in merged and "stages" not in update:
        tries += [{**merged, "stages": s} for s in range(merged["stages"] - 1, 1, -1)]
    why = ""  # the first refusal: the update's own, not a shallower ring's
    for p in tries:
        try:
            return family.parse(p, problem).model_dump(), ""
        except ValueError as e:
            why = why or str(e)
    return None, why


def expand(family: Family, problem: Problem, top: int, given: list[dict], updates: list[dict],
           device: DeviceFacts, template: str | None, own: list[dict] = ()) -> list[Row]:
    """The rows of one shape: space()'s first `top`, the given settings and the shape's own, each followed by its
    updates; a setting reached twice is kept once (the first label)."""
    found = [(f"#{i}", p, "") for i, p in enumerate(family.space(problem, device)[:top])]
    found += [(f"p{j}", *fit(family, problem, g)) for j, g in enumerate(given, 1)]
    found += [(f"s{j}", *fit(family, problem, g)) for j, g in enumerate(own, 1)]
    rows: list[Row] = []
    seen: set[str] = set()
    for label, params, why in found:
        variants = [(label, params, why)]
        if params is not None:
            variants += [(f"{label}+u{j}", *fit(family, problem, params, u)) for j, u in enumerate(updates, 1)]
        for name, p, reason in variants:
            if p is None:
                rows.append(Row(problem, name, None, result=EvalResult("", Status.INVALID, reason)))
            elif (key := json.dumps(p, sort_keys=True)) not in seen:
                seen.add(key)
                cid = Candidate(problem, family.name, p, origin="sweep", template_override=template).id
                rows.append(Row(problem, name, p, cid))
    return rows


def build(rows: list[Row], family: Family, template: str | None, arch: str, cache: Path, jobs: int) -> None:
    """Render every row and compile each distinct source once (M, N, K are kernel arguments, so shapes share)."""
    for row in rows:
        if row.result is None:
            try:
                row.source = family.render(row.params, row.problem, template)
            except ValueError as e:
                row.result = EvalResult(row.candidate_id, Status.INVALID, str(e))
    sources = list(dict.fromkeys(r.source for r in rows if r.result is None))
    os.environ["HGEMM_AGENT_CACHE"] = str(cache)  # the build processes' cache (they start after this)
    pool = BuildPool(max(1, min(jobs, len(sources))))
    try:
        futures = {s: pool.submit(s, arch, "", COMPILE_TIMEOUT_S) for s in sources}
        built = {s: f.result() for s, f in futures.items()}
    finally:
        pool.close()
    for row in rows:
        if row.result is None:
            row.build = built[row.source]
            if not row.build.ok:
                row.result = EvalResult(row.candidate_id, Status.COMPILE_ERROR, row.build.error)


def abbrev(name: str) -> str:
    return "".join(part[0] for part in name.split("_"))


def summary(family: Family, row: Row) -> str:
    """The label, the tile, then the fields that differ from the model's defaults, abbreviated (see report())."""
    if row.params is None:
        return row.label
    defaults = {name: f.default for name, f in family.params_model.model_fields.items()}
    p = dict(row.params)
    parts = [row.label]
    if "block_m" in p and "block_n" in p:
        parts.append(f"{p.pop('block_m')}x{p.pop('block_n')}")
    for name, value in p.items():
        if value != defaults.get(name):
            if isinstance(value, bool):
                parts.append(abbrev(name) if value else "!" + abbrev(name))
            else:
                parts.append(f"{abbrev(name)}{'=' if isinstance(value, str) else ''}{value}")
    return " ".join(parts)


def line(family: Family, row: Row) -> str:
    """One table row: warm µs, cuBLAS's warm µs, the warm and cold ratios t_cuBLAS / t, the ratio of CUPTI's kernel
    durations (warm), registers/spill bytes."""
    r = row.result
    us = f"{r.warm.median_us:8.1f}" if r.warm else f"{'':8}"
    cublas = f"{r.cublas_warm.median_us:9.1f}" if r.cublas_warm else f"{'':9}"
    warm = f"{r.speedup:6.3f}" if r.speedup else f"{'':6}"
    ok_cold = r.status is Status.OK and r.cold and r.cublas_cold
    cold = f"{r.cublas_cold.median_us / r.cold.median_us:6.3f}" if ok_cold else f"{'':6}"
    ratio = r.cublas_warm.cupti_ratio(r.warm) if r.status is Status.OK and r.cublas_warm else None
    cupti = f"{ratio:6.3f}" if ratio else f"{'':6}"
    regs = f"{row.build.registers}/{row.build.spill_bytes or 0}" if row.build and row.build.ok else ""
    return (f"{row.problem.mnk:>15} {row.problem.b_layout:>2} {summary(family, row):<40} {r.status.value:<13} {us} "
            f"{cublas} {warm} {cold} {cupti} {regs:>10}")


def report(rows: list[Row], family: Family, updates: list[dict]) -> list[str]:
    """What follows the table: why rows failed or were slowed, the legend, the best setting per shape, the counts."""
    def name(r: Row) -> str:
        return f"{r.problem.mnk}:{r.problem.b_layout} {r.label}"

    # an update that does not apply to a setting is one line per update, not one per setting
    missed = [r for r in rows if r.params is None and "+u" in r.label]
    out = [f"  {name(r)}: {r.result.status.value}: {r.result.reason[:300]}"
           for r in rows if r.result.reason and r.result.status is not Status.OK and r not in missed]
    # ptxas's "wgmma.mma_async instructions are serialized" warning: correct, but the overlap the kernel is for is gone
    out += [f"  {name(r)}: ptxas: {next(x for x in r.build.log.splitlines() if 'serialized' in x).strip()[:300]}"
            for r in rows if r.build and r.build.ok and "serialized" in r.build.log]
    for k in range(1, len(updates) + 1):
        if found := [r for r in missed if r.label.endswith(f"+u{k}")]:
            out.append(f"  u{k} does not apply to {len(found)} settings, e.g. {name(found[0])}: "
                       f"{found[0].result.reason[:300]}")
    fields = ", ".join(f"{abbrev(n)}={n}" for n in family.params_model.model_fields if n not in ("block_m", "block_n"))
    out.append(f"setting: where from (#i space() rank, pj --params, sj --settings, +uk --update), block_m x block_n, "
               "then the fields "
               f"other than {family.name}'s defaults ({fields})")
    out += [f"  u{k} = {json.dumps(u)}" for k, u in enumerate(updates, 1)]
    for problem in dict.fromkeys(r.problem for r in rows):
        if ok := [r for r in rows if r.problem == problem and r.result.speedup]:
            b = max(ok, key=lambda r: r.result.speedup)
            out.append(f"best {problem.mnk}:{problem.b_layout}: {summary(family, b)}, {b.result.speedup:.3f}x cuBLAS")
    counts = Counter(r.result.status.value for r in rows)
    out.append(f"{len(rows)} settings: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return out


def sweep(args: argparse.Namespace, device: DeviceFacts, evaluate: Callable[[EvalJob], EvalResult]) -> list[Row]:
    """Expand, build, then evaluate the rows in order, one at a time, each printed as it finishes; then the report."""
    t0 = time.monotonic()
    family: Family = args.family
    rows = [row for p in args.problems
            for row in expand(family, p, args.top, args.params, args.update, device, args.template_text,
                              args.own.get(p, []))]
    build(rows, family, args.template_text, device.arch, args.cache, args.jobs)
    built = [r.build for r in rows if r.build]
    print(f"{family.name} for {device.name} ({device.arch}): {len(rows)} settings over {len(args.problems)} shapes, "
          f"{sum(b.ok for b in built)} built ({sum(b.cached for b in built)} from the cache) in "
          f"{time.monotonic() - t0:.0f} s" + (f"; template {args.template}" if args.template else ""), flush=True)
    print(HEADER, flush=True)
    t0 = time.monotonic()
    for row in rows:
        if row.result is None:
            if args.budget_s is not None and time.monotonic() - t0 >= args.budget_s:
                row.result = EvalResult(row.candidate_id, Status.SKIPPED, f"past --budget-s {args.budget_s:g}")
            else:
                row.result = evaluate(EvalJob.built(row.candidate_id, row.problem, family.name, row.params,
                                                    row.build, timeout_s=args.kernel_timeout))
        print(line(family, row), flush=True)
    print("\n".join(report(rows, family, args.update)))
    if args.json:  # every field of every setting; the sources and cubins stay in the cache
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "family": family.name, "device": device.to_dict(), "template": args.template and str(args.template),
            "rows": [{"problem": r.problem.key, "label": r.label, "setting": summary(family, r), "params": r.params,
                      "build": r.build and {k: v for k, v in asdict(r.build).items() if k not in ("source", "cubin")},
                      "result": json.loads(r.result.to_json())} for r in rows]}, indent=1))
        print(f"wrote {args.json}")
    return rows


def main(argv: list[str] | None = None, evaluate: Callable[[EvalJob], EvalResult] | None = None) -> int:
    """`evaluate` stands in for the GPU worker (tests); --compile-only needs neither."""
    args = parse_args(argv)
    if args.compile_only or evaluate is not None:  # no GPU: spaces ordered for the H200 we measure on
        rows = sweep(args, H200, evaluate or (lambda job: EvalResult(job.candidate_id, Status.SKIPPED, "")))
    else:
        from sandbox.pool import WorkerPool, WorkerUnavailable

        with WorkerPool() as pool:
            try:
                pool.start()
            except WorkerUnavailable as e:
                raise SystemExit(f"no usable GPU ({e}); --compile-only renders and compiles without one") from None
            if pool.facts.arch not in args.family.arches:
                raise SystemExit(f"{args.family.name} does not build for {pool.facts.name} ({pool.facts.arch})")
            rows = sweep(args, pool.facts, pool.evaluate)
    # a valid setting that did not render (an edited template) fails too; an update that does not apply does not
    return 1 if any(r.result.status in FAILED or (r.params and r.result.status is Status.INVALID) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
