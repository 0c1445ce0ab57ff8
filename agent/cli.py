"""Command-line verbs: run, runs, show, diff, export, bench, db. Bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.live import Live

from agent.config import LlmSettings, RunConfig
from agent.shapes import ShapeError, parse_shape_list, read_shapes_file
from agent.store import RunStore, StoreError, list_runs, new_run_id
from agent.tuning_db import default_path
from core.records import B_LAYOUTS
from core.validation import validation_message

console = Console() if sys.stdout.isatty() else Console(width=160)  # files and pipes get whole tables
EXIT_BAD_INPUT = 2
DEFAULT_DB_HINT = "~/.cache/hgemm-agent/tuning.sqlite"


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, nothing written
        raise UsageError(message)


def build_parser() -> Parser:
    p = Parser(prog="python -m agent", description="Search fast HGEMM kernels for your shapes and GPU.")
    common = Parser(add_help=False)
    common.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where runs live (default ./runs)")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    sub.add_parser = functools.partial(sub.add_parser, parents=[common])

    r = sub.add_parser("run", help="search kernels for one or more shapes")
    r.add_argument("--mnk", help="M_N_K[,M_N_K...], e.g. 4096_4096_4096")
    r.add_argument("--shapes", type=Path, help="file with one M_N_K[:layout[:dtype[:bias]]] a line, '#' comments")
    r.add_argument("--b-layout", choices=B_LAYOUTS, default="kn",
                   help="kn: B is K x N row-major (torch.matmul); nk: N x K row-major (nn.Linear weight)")
    add_dtype_bias(r)
    r.add_argument("--budget-minutes", type=float, default=5.0)
    r.add_argument("--max-candidates", type=int, default=16, help="per shape")
    r.add_argument("--proposer", choices=("builtin", "llm", "mixed"), default="builtin")
    r.add_argument("--arch", choices=("sm_90a", "sm_80"), help="default: the GPU's (sm_90a when compiling only)")
    r.add_argument("--compile-only", action="store_true", help="render and compile, no GPU needed")
    r.add_argument("--kernel-timeout", type=float, default=5.0, help="seconds beyond a phase's expected time")
    r.add_argument("--gpus", type=gpu_list, help="local GPUs to evaluate on: all, or indices 0,1,... (default: 0)")
    r.add_argument("--cluster", metavar="tcp://HOST:PORT", help="evaluate on a Dask cluster (a GPU per worker)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-profile", dest="profile", action="store_false",
                   help="do not profile the top candidates with Nsight Compute (ncu)")
    r.add_argument("--resume", metavar="RUN", help="continue an interrupted run")
    r.add_argument("--db", type=Path, help="the tuning database to learn from and add to (default "
                   f"$HGEMM_AGENT_TUNING_DB or {DEFAULT_DB_HINT})")
    r.add_argument("--no-db", action="store_true", help="neither learn from nor add to a tuning database")
    r.add_argument("--llm-model", help="model name for --proposer llm/mixed (or OPENAI_MODEL)")
    r.add_argument("--llm-base-url", help="OpenAI-compatible endpoint (or OPENAI_BASE_URL)")
    r.add_argument("--llm-max-calls", type=int, help="most LLM calls in this run")
    r.add_argument("--llm-max-prompt-tokens", type=int,
                   help="most tokens a prompt may take, estimated at 4 characters a token (default 24000: every "
                        "family's template and the search so far); what does not fit is left out, and the prompt "
                        "says what")

    sub.add_parser("runs", help="list runs")
    s = sub.add_parser("show", help="summarise a run: best per shape, ratio to cuBLAS, failures")
    s.add_argument("run")
    s.add_argument("--llm", action="store_true",
                   help="list each LLM call: tokens, proposals, and what became of each")
    d = sub.add_parser("diff", help="diff two candidates' sources, parameters and measurements")
    d.add_argument("run")
    d.add_argument("a", help="candidate id (or prefix), 'best' or 'baseline'")
    d.add_argument("b")
    d.add_argument("--shape", help="M_N_K for best/baseline when the run has several shapes")
    d.add_argument("--b-layout", choices=B_LAYOUTS, default=None)
    e = sub.add_parser("export", help="write the winners as .cu files and a PyTorch-callable module")
    e.add_argument("run")
    e.add_argument("--out", type=Path, help="default runs/<run>/export")
    e.add_argument("--no-check", action="store_true", help="skip re-checking the exported module on the GPU")
    bn = sub.add_parser("bench", help="re-time the best kernels of runs (or cuBLAS) against cuBLAS")
    bn.add_argument("runs", nargs="*", metavar="RUN")
    bn.add_argument("--shapes", type=Path, help="shapes to bench (default: the runs' shapes)")
    bn.add_argument("--b-layout", choices=B_LAYOUTS, default="kn", help="layout for --shapes")
    add_dtype_bias(bn)
    bn.add_argument("--mode", choices=("offline", "server"), default="offline")
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


def add_dtype_bias(parser: Parser) -> None:
    """Defaults for --mnk shapes and for shapes-file lines that do not name their own dtype and bias."""
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="inputs and output (default fp16)")
    parser.add_argument("--bias", action="store_true", help="C = A B + bias[N] (a fused bias epilogue)")


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
        runs_dir(args.runs_dir)
        return VERBS[args.verb](args)
    except (UsageError, ShapeError, StoreError, ValueError) as e:  # SetupError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def runs_dir(path: Path) -> Path:
    """The folder runs live in; UsageError where it cannot be one (a file, say)."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"--runs-dir {path} is a file, not a folder")
    return path


def open_run(args) -> RunStore:
    if not args.run or "/" in args.run or args.run in (".", ".."):
        raise StoreError(f"bad run id {args.run!r}")
    return RunStore(args.runs_dir / args.run)


def cmd_run(args) -> int:
    from agent.runner import execute

    if args.resume and (args.mnk or args.shapes):
        raise UsageError("--resume continues the run's own shapes: do not pass --mnk or --shapes with it")
    if not args.resume and not (args.mnk or args.shapes):
        raise UsageError("give the shapes: --mnk M_N_K[,...] or --shapes FILE")
    if args.mnk and args.shapes:
        raise UsageError("give --mnk or --shapes, not both")
    if args.db and args.no_db:
        raise UsageError("give --db PATH or --no-db, not both")
    if args.gpus and args.cluster:
        raise UsageError("--gpus picks local GPUs, --cluster a Dask cluster's: give one of them")
    if args.compile_only and (args.gpus or args.cluster):
        raise UsageError("--compile-only uses no GPU: drop --gpus / --cluster")
    problems = (parse_shape_list(args.mnk, args.b_layout, args.dtype, args.bias) if args.mnk
                else read_shapes_file(args.shapes, args.b_layout, args.dtype, args.bias) if args.shapes else None)
    try:
        llm = LlmSettings.from_env(model=args.llm_model, base_url=args.llm_base_url, max_calls=args.llm_max_calls,
                                   max_prompt_tokens=args.llm_max_prompt_tokens)
        config = RunConfig(budget_minutes=args.budget_minutes, max_candidates=args.max_candidates,
                           proposer=args.proposer, arch=args.arch, compile_only=args.compile_only,
                           kernel_timeout_s=args.kernel_timeout, seed=args.seed, profile=args.profile,
                           tuning_db=None if args.no_db else str(args.db or default_path()), llm=llm)
    except ValidationError as e:
        raise UsageError(validation_message(e)) from None
    if config.proposer != "builtin" and (missing := llm.missing()):
        raise UsageError(missing)
    store = open_run(argparse.Namespace(run=args.resume, runs_dir=args.runs_dir)) if args.resume else None
    if store is not None and store.get_meta("state") == "done":
        console.print(f"run {store.run_id} had finished; continuing it with the new budget")
    return execute(config, problems, store, lambda: RunStore(args.runs_dir / new_run_id(), create=True), console,
                   Live if console.is_terminal else None, gpus=args.gpus, cluster=args.cluster)


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
    from agent.report import compile_only

    store = open_run(args)
    if compile_only(store):
        raise UsageError(f"run {store.run_id} is a compile-only run: nothing was checked or timed, so there is "
                         "nothing to export; run the shapes on a GPU")
    out = args.out or store.folder / "export"
    for line in export_run(store, out):
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

    stores = [open_run(argparse.Namespace(run=r, runs_dir=args.runs_dir)) for r in args.runs]
    if args.target_qps <= 0 or args.seconds <= 0:
        raise UsageError("--target-qps and --seconds must be positive")
    if args.mode == "server":
        if len(stores) != 1:
            raise UsageError("--mode server benches one run's exported op: give exactly one RUN")
        pool, _ = start_pool(None)  # no GPU: one line, before anything is written
        pool.close()
        out = stores[0].folder / "export"
        export_run(stores[0], out)
        report = bench.bench_server(out, args.target_qps, args.seconds)
        (stores[0].folder / "bench_server.json").write_text(json.dumps(report, indent=1))
        console.print(bench.server_table(report, args.target_qps))
        return 0
    problems = (read_shapes_file(args.shapes, args.b_layout, args.dtype, args.bias) if args.shapes
                else list(dict.fromkeys(p for s in stores for p in s.problems())))
    if not problems:
        raise UsageError("nothing to bench: give RUNs or --shapes FILE")
    folder = args.out or (stores[0].folder / "bench" if stores else args.runs_dir / f"bench-{new_run_id()}")
    pool, device = start_pool(None)
    try:
        rows = bench.bench_offline(pool.evaluate, stores, problems, progress=lambda s: console.print(s), device=device)
    finally:
        pool.close()
    console.print(bench.rows_table(rows, f"bench on {device.name} (device time, same process)"))
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
        for row in db.summary():
            table.add_row(*map(str, row))
        console.print(table)
    finally:
        db.close()
    return 0


VERBS = {"run": cmd_run, "runs": cmd_runs, "show": cmd_show, "diff": cmd_diff, "export": cmd_export,
         "bench": cmd_bench, "db": cmd_db}
