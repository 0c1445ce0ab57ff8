"""Command-line verbs: run, runs, show, diff, export, bench, db. Bad input is one line on stderr and exit code 2;
Ctrl-C is exit code 130, without a traceback."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from agent import __version__, buckets
from agent.run_options import (
    DEFAULT_DB_HINT,
    EPILOGUE_HELP,
    UsageError,
    add_run_options,
    check_combinations,
    run_config,
    shapes_defaults,
)
from agent.shapes import ShapeError, parse_shape_list, read_shapes_file
from agent.store import DEFAULT_RUNS_DIR, RunStore, StoreError, list_runs, new_run_id
from agent.tuning_db import default_path
from core.epilogue import EPILOGUES
from core.records import B_LAYOUTS

console = Console() if sys.stdout.isatty() else Console(width=160)  # files and pipes get whole tables
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, nothing written
        raise UsageError(message)


class HelpFormatter(argparse.HelpFormatter):
    """Help that ends each option's text with its default, where it has one worth saying and does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default in (None, True, False)
                or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default %(default)s)"


def build_parser() -> Parser:
    p = Parser(prog="python -m agent", description="Search fast HGEMM kernels for your shapes and GPU.",
               formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"hgemm-agent {__version__}")
    common = Parser(add_help=False)
    common.add_argument("--runs-dir", type=Path, metavar="DIR", default=Path(DEFAULT_RUNS_DIR),
                        help="where runs live")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    sub.add_parser = functools.partial(sub.add_parser, parents=[common], formatter_class=HelpFormatter)

    add_run_options(sub.add_parser("run", help="search kernels for one or more shapes"), gpu_list)
    sub.add_parser("runs", help="list runs")
    s = sub.add_parser("show", help="summarise a run: best per shape, ratio to cuBLAS, failures, leading candidates")
    s.add_argument("run")
    s.add_argument("--llm", action="store_true",
                   help="list each LLM call: tokens, proposals, and what became of each")
    d = sub.add_parser("diff", help="diff two candidates' sources, parameters and measurements")
    d.add_argument("run")
    d.add_argument("a", help="candidate id or a unique prefix of one (show lists each shape's leaders), 'best' or "
                   "'baseline' (the first candidate tried)")
    d.add_argument("b", help="the same, for the other side")
    d.add_argument("--shape", help="M_N_K for best/baseline when the run has several shapes")
    d.add_argument("--b-layout", choices=B_LAYOUTS, default=None, help="the layout of --shape, where the run has both")
    e = sub.add_parser("export", help="write the winners as .cu files and a PyTorch-callable module")
    e.add_argument("run")
    e.add_argument("--out", type=Path, help="default runs/<run>/export")
    e.add_argument("--no-check", action="store_true", help="skip re-checking the exported module on the GPU")
    e.add_argument("--no-norm-variants", action="store_true",
                   help="do not build each gemv winner a second time with the RMSNorm inside (norm_linear's one "
                        "kernel at decode: docs/decisions.md `norm-variant`)")
    bn = sub.add_parser("bench", help="re-time the best kernels of runs (or cuBLAS) against cuBLAS")
    bn.add_argument("runs", nargs="*", metavar="RUN")
    bn.add_argument("--shapes", type=Path, help="shapes to bench (default: the runs' shapes)")
    bn.add_argument("--b-layout", choices=B_LAYOUTS, default="kn", help="layout for --shapes")
    bn.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="inputs and output, for --shapes")
    bn.add_argument("--bias", action="store_true", help="C = A B + bias[N], for --shapes")
    bn.add_argument("--epilogue", choices=EPILOGUES, default="none", help=f"{EPILOGUE_HELP}, for --shapes")
    bn.add_argument("--mode", choices=("offline", "server"), default="offline",
                    help="offline: graph-timed kernels; server: single calls of the exported op at random intervals")
    bn.add_argument("--target-qps", type=float, default=200.0, help="server mode: mean calls per second")
    bn.add_argument("--seconds", type=float, default=20.0, help="server mode: total duration")
    bn.add_argument("--out", type=Path, help="where bench.json / bench.png go (default: the first run's folder)")
    t = sub.add_parser("db", help="what the tuning database holds; --import adds finished runs to it")
    t.add_argument("--db", type=Path, help=f"default $HGEMM_AGENT_TUNING_DB or {DEFAULT_DB_HINT}")
    t.add_argument("--import", dest="imports", nargs="+", metavar="RUN", default=[],
                   help="run ids (in --runs-dir) or run folders whose results to add")
    return p


def gpu_list(text: str) -> str | tuple[int, ...]:
    """--gpus: "all", or distinct GPU indices separated by commas."""
    if text == "all":
        return text
    parts = text.split(",")
    if not all(p.strip().isdigit() for p in parts) or len({int(p) for p in parts}) != len(parts):
        raise argparse.ArgumentTypeError(f"expected 'all' or distinct GPU indices like 0,1 - got {text!r}")
    return tuple(int(p) for p in parts)


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--mnk -1_64_64` would read as an unknown option; join it so the shape parser names the problem."""
    out: list[str] = []
    for token in argv:
        if out and out[-1] in ("--mnk", "--shape") and token[:1] == "-" and token[1:2].isdigit():
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
        runs_dir(args.runs_dir, writes=args.verb in ("run", "bench"))
        return VERBS[args.verb](args)
    except (UsageError, ShapeError, StoreError, ValueError) as e:  # SetupError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # before a run folder exists, or in a verb that writes nothing to resume
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def runs_dir(path: Path, writes: bool = False) -> Path:
    """The folder runs live in; UsageError where it cannot be one (a file, a path through a file) or, for verbs that
    write runs, where no folder can be made in it (a read-only or virtual file system). The check leaves nothing."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"--runs-dir {path} is a file, not a folder")
    if not writes:
        return path
    near = path
    while not near.exists() and near != near.parent:
        near = near.parent
    if not near.is_dir():
        raise UsageError(f"--runs-dir {path}: {near} is not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hgemm-agent-", dir=near))
    except OSError as e:
        raise UsageError(f"--runs-dir {path}: cannot create folders in {near} ({e.strerror or e})") from None
    return path


def open_run(args) -> RunStore:
    if not args.run or "/" in args.run or args.run in (".", ".."):
        raise StoreError(f"bad run id {args.run!r}")
    return RunStore(args.runs_dir / args.run)


def cmd_run(args) -> int:
    from agent.report import next_steps, resume_command, show_run
    from agent.runner import EXIT_DONE, EXIT_LOST, execute
    from agent.view import progress_view

    check_combinations(args)
    store = open_run(argparse.Namespace(run=args.resume, runs_dir=args.runs_dir)) if args.resume else None
    if store is None:
        defaults = shapes_defaults(args)
        problems = (parse_shape_list(args.mnk, *defaults) if args.mnk else read_shapes_file(args.shapes, *defaults))
        problems = buckets.plan(problems)  # ranges of M -> buckets
        config = run_config(args)
    else:
        problems = None
        config = run_config(args, store.get_meta("config") or {}, store.get_meta("arch"), store.run_id)
    if config.proposer != "builtin" and (missing := config.llm.missing()):
        raise UsageError(missing)
    if store is not None and store.get_meta("state") == "done":
        console.print(f"run {store.run_id} had finished; " + (
            f"continuing it with the new budget ({config.budget_minutes:g} minutes)" if args.budget_minutes
            else f"continuing it for another {config.budget_minutes:g} minutes, its own budget "
                 "(--budget-minutes gives another)"))
    outcome = execute(config, problems, store, lambda: RunStore(args.runs_dir / new_run_id(), create=True),
                      functools.partial(progress_view, console), gpus=args.gpus, cluster=args.cluster)
    if outcome.code == EXIT_DONE:
        console.print(show_run(outcome.store))
        console.print(next_steps(outcome.store), soft_wrap=True)
    elif outcome.code == EXIT_LOST:
        console.print(f"stopped: {outcome.reason}; {resume_command(outcome.store)} continues it", soft_wrap=True)
    else:
        console.print(f"interrupted: {resume_command(outcome.store)} continues it", soft_wrap=True)
    return outcome.code


def cmd_runs(args) -> int:
    from agent.report import runs_table

    stores = list_runs(args.runs_dir)
    if not stores:
        console.print(f"no runs in {args.runs_dir}")
        return 0
    console.print(runs_table(stores))
    return 0


def cmd_show(args) -> int:
    from agent.report import model_calls_view, show_run

    store = open_run(args)
    console.print(show_run(store))
    if args.llm:
        console.print(model_calls_view(store))
    return 0


def cmd_diff(args) -> int:
    from agent.report import diff_view, resolve_candidate
    from agent.shapes import parse_shape

    store = open_run(args)
    problem = None
    if args.shape:
        layouts = {p.b_layout for p in store.problems() if p.mnk == args.shape}
        layout = args.b_layout or (layouts.pop() if len(layouts) == 1 else "kn")
        problem = parse_shape(args.shape, layout)
    a, b = resolve_candidate(store, args.a, problem), resolve_candidate(store, args.b, problem)
    console.print(diff_view(store, a, b))
    return 0


def cmd_export(args) -> int:
    from agent.export import export_run, recheck

    store = open_run(args)
    if store.compile_only:
        raise UsageError(f"run {store.run_id} is a compile-only run: nothing was checked or timed, so there is "
                         "nothing to export; run the shapes on a GPU")
    out = args.out or store.folder / "export"
    for line in export_run(store, out, norm_variants=not args.no_norm_variants):
        console.print(f"{line.problem.key}: {line.kernel_file or 'cuBLAS'} - {line.note}")
    console.print(f"written to {out} (import hgemm_ops; hgemm_ops.mm(a, b, bias=None), hgemm_ops.linear(x, w, bias), "
                  "hgemm_ops.patch(model))")
    if args.no_check:
        return 0
    status, text = recheck(out)
    console.print(text)
    return 1 if status == "failed" else 0


def cmd_bench(args) -> int:
    from agent import bench
    from agent.export import export_run
    from agent.runner import start_pool

    no_gpu = "bench re-times kernels on a GPU; run it on a machine with one"
    stores = [open_run(argparse.Namespace(run=r, runs_dir=args.runs_dir)) for r in args.runs]
    if args.target_qps <= 0 or args.seconds <= 0:
        raise UsageError("--target-qps and --seconds must be positive")
    if args.mode == "server":
        if len(stores) != 1:
            raise UsageError("--mode server benches one run's exported op: give exactly one RUN")
        pool, _ = start_pool(None, no_gpu=no_gpu)  # no GPU: one line, before anything is written
        pool.close()
        out = stores[0].folder / "export"
        export_run(stores[0], out)
        report = bench.bench_server(out, args.target_qps, args.seconds)
        (stores[0].folder / "bench_server.json").write_text(json.dumps(report, indent=1))
        console.print(bench.server_table(report, args.target_qps))
        return 0
    problems = (read_shapes_file(args.shapes, args.b_layout, args.dtype, args.bias, args.epilogue) if args.shapes
                else list(dict.fromkeys(p for s in stores for p in s.problems())))
    if not problems:
        raise UsageError("nothing to bench: give RUNs or --shapes FILE")
    if args.shapes and (ranged := next((p for p in problems if p.m_range), None)):
        raise UsageError(f"bench times shapes of one M, not the range {ranged.mnk}: list the M values to bench "
                         "(tools/range_bench.py writes such a file)")
    folder = args.out or (stores[0].folder / "bench" if stores else args.runs_dir / f"bench-{new_run_id()}")
    pool, device = start_pool(None, no_gpu=no_gpu)
    try:
        rows = bench.bench_offline(pool.evaluate, stores, problems, progress=lambda s: console.print(s), device=device)
    finally:
        pool.close()
    console.print(bench.rows_table(rows, f"bench on {device.name} (device time, same process)"))
    if series := bench.by_series(rows):
        console.print(bench.series_table(series))
    for path in bench.write_outputs(rows, folder, device.to_dict()):
        console.print(f"wrote {path}")
    return 0


def cmd_db(args) -> int:
    from rich.table import Table

    from agent.tuning_db import TuningDB, TuningDbError

    folders = [Path(r) if Path(r).is_dir() else args.runs_dir / r for r in args.imports]
    stores = [RunStore(f) for f in folders]  # every run checked before anything is written
    path = args.db or default_path()
    if not stores and not path.exists():
        console.print(f"no tuning database at {path} yet: runs create it, or db --import RUN")
        return 0
    try:
        db = TuningDB(path)
    except TuningDbError as e:
        raise UsageError(str(e)) from None
    try:
        for store in stores:
            try:
                console.print(f"{store.run_id}: {db.import_run(store)} results added")
            except TuningDbError as e:
                console.print(f"{store.run_id}: {e}")
        table = Table(title=f"tuning database {db.path}")
        for name in ("GPU", "family", "results", "passed", "problems"):
            table.add_column(name)
        rows = db.summary()
        for row in rows:
            table.add_row(*map(str, row))
        console.print(table if rows else f"tuning database {db.path} is empty: runs on a GPU add to it, or "
                      "db --import RUN")
    finally:
        db.close()
    return 0


VERBS = {"run": cmd_run, "runs": cmd_runs, "show": cmd_show, "diff": cmd_diff, "export": cmd_export,
         "bench": cmd_bench, "db": cmd_db}
