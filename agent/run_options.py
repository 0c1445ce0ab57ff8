"""The `run` verb's options and the RunConfig they make: for a new run, the options over RunConfig's defaults; for a
resumed run, its stored configuration with what a resume may change (budget, candidates, timeouts, profiles, the
tuning database, the LLM's limits). Options that would contradict the stored run (its shapes, proposer, arch,
compile-only, seed) are refused. Options not given are None here, so that a resume can tell them from defaults."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agent.config import LlmSettings, RunConfig
from agent.tuning_db import default_path
from core.epilogue import EPILOGUES
from core.records import B_LAYOUTS
from core.validation import validation_message

DEFAULTS = RunConfig()
DEFAULT_DB_HINT = "~/.cache/hgemm-agent/tuning.sqlite"
# RunConfig field -> the argparse dest of its option
CONFIG_OPTIONS = {"budget_minutes": "budget_minutes", "max_candidates": "max_candidates", "proposer": "proposer",
                  "arch": "arch", "compile_only": "compile_only", "kernel_timeout_s": "kernel_timeout",
                  "seed": "seed", "profile": "profile"}
LLM_OPTIONS = {"model": "llm_model", "base_url": "llm_base_url", "max_calls": "llm_max_calls",
               "max_prompt_tokens": "llm_max_prompt_tokens"}
# what errors call a field: the option that sets it
OPTION_NAMES = {"budget_minutes": "--budget-minutes", "max_candidates": "--max-candidates", "proposer": "--proposer",
                "arch": "--arch", "kernel_timeout_s": "--kernel-timeout", "seed": "--seed", "tuning_db": "--db",
                "model": "--llm-model (or OPENAI_MODEL)", "base_url": "--llm-base-url (or OPENAI_BASE_URL)",
                "max_calls": "--llm-max-calls", "max_prompt_tokens": "--llm-max-prompt-tokens"}
FIXED = ("proposer", "arch", "compile_only", "seed")  # a resumed run keeps these
SHAPE_OPTIONS = {"mnk": "--mnk", "shapes": "--shapes", "b_layout": "--b-layout", "dtype": "--dtype", "bias": "--bias",
                 "epilogue": "--epilogue"}
EPILOGUE_HELP = ("what the kernel applies to A B (+ bias) before storing C: an activation (relu, silu, gelu_tanh, "
                 "gelu: the erf GELU, relu2: relu squared), a gated one on interleaved gate/up columns (silu_mul, "
                 "gelu_mul: C has N/2 columns) or a residual add (residual: + R, an M x N tensor)")


class UsageError(Exception):
    """Bad input: one line on stderr, exit code 2, nothing written."""


def add_run_options(r: argparse.ArgumentParser, gpu_list) -> None:
    r.add_argument("--mnk", metavar="M_N_K[,...]", help="one or more shapes, e.g. 4096_4096_4096; M may be a range, "
                   "1-512_4096_4096 (searched in buckets of M)")
    r.add_argument("--shapes", type=Path, metavar="FILE",
                   help="file with one M_N_K[:layout[:dtype][:bias][:epilogue]] a line (M may be a range LO-HI), "
                        "'#' comments")
    r.add_argument("--b-layout", choices=B_LAYOUTS,
                   help="kn: B is K x N row-major (torch.matmul); nk: N x K row-major (nn.Linear weight) "
                        "(default kn; shapes-file lines may name their own)")
    r.add_argument("--dtype", choices=("fp16", "bf16"),
                   help="inputs and output (default fp16; shapes-file lines may name their own)")
    r.add_argument("--bias", action="store_true", default=None,
                   help="C = A B + bias[N] (a fused bias epilogue) for shapes that do not name their own")
    r.add_argument("--epilogue", choices=EPILOGUES,
                   help=f"{EPILOGUE_HELP} (default none; shapes-file lines may name their own)")
    r.add_argument("--budget-minutes", type=float, metavar="MIN",
                   help=f"time for the whole run (default {DEFAULTS.budget_minutes:g}; with --resume: the run's own)")
    r.add_argument("--max-candidates", type=int, metavar="N",
                   help=f"candidates per shape (default {DEFAULTS.max_candidates})")
    r.add_argument("--proposer", choices=("builtin", "llm", "mixed"),
                   help=f"where candidates come from (default {DEFAULTS.proposer})")
    r.add_argument("--arch", choices=("sm_90a", "sm_80"), help="default: the GPU's (sm_90a when compiling only)")
    r.add_argument("--compile-only", action="store_true", default=None,
                   help="render and compile, no GPU needed (nothing is checked or timed)")
    r.add_argument("--kernel-timeout", type=float, metavar="S",
                   help="seconds beyond a phase's expected time before a hung kernel is killed "
                        f"(default {DEFAULTS.kernel_timeout_s:g})")
    r.add_argument("--gpus", type=gpu_list, metavar="all|0,1,...",
                   help="local GPUs to evaluate on: all, or indices (default: 0)")
    r.add_argument("--cluster", metavar="tcp://HOST:PORT", help="evaluate on a Dask cluster (a GPU per worker)")
    r.add_argument("--seed", type=int, metavar="N", help=f"seeds the bandit and proposers (default {DEFAULTS.seed})")
    profile = r.add_mutually_exclusive_group()
    profile.add_argument("--profile", dest="profile", action="store_true", default=None,
                         help="profile each shape's leaders with Nsight Compute (ncu), charged to the shape's time "
                              "(default: only with --proposer llm or mixed, whose prompts read the profiles)")
    profile.add_argument("--no-profile", dest="profile", action="store_false", default=None,
                         help="never profile")
    r.add_argument("--resume", metavar="RUN", help="continue an interrupted or finished run: its shapes, proposer, "
                   "arch and seed; other options given change what they set")
    r.add_argument("--db", type=Path, metavar="PATH", help="the tuning database to learn from and add to (default "
                   f"$HGEMM_AGENT_TUNING_DB or {DEFAULT_DB_HINT})")
    r.add_argument("--no-db", action="store_true", help="neither learn from nor add to a tuning database")
    r.add_argument("--llm-model", metavar="NAME",
                   help=f"model name for --proposer llm/mixed (or OPENAI_MODEL; default {DEFAULTS.llm.model})")
    r.add_argument("--llm-base-url", metavar="URL",
                   help="OpenAI-compatible endpoint, an http(s) URL (or OPENAI_BASE_URL; default OpenAI's)")
    r.add_argument("--llm-max-calls", type=int, metavar="N",
                   help=f"most LLM calls in this run (default {DEFAULTS.llm.max_calls})")
    r.add_argument("--llm-max-prompt-tokens", type=int, metavar="N",
                   help="most tokens a prompt may take, estimated at 4 characters a token (default "
                        f"{DEFAULTS.llm.max_prompt_tokens}: every family's template and the search so far); what "
                        "does not fit is left out, and the prompt says what")


def check_combinations(args: argparse.Namespace) -> None:
    """Options that exclude each other, and what every run needs."""
    if args.resume and (given := [name for dest, name in SHAPE_OPTIONS.items() if getattr(args, dest)]):
        raise UsageError(f"--resume continues the run's own shapes: drop {', '.join(given)}")
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


def given_config(args: argparse.Namespace) -> dict[str, Any]:
    return {field: getattr(args, dest) for field, dest in CONFIG_OPTIONS.items() if getattr(args, dest) is not None}


def run_config(args: argparse.Namespace, stored: dict[str, Any] | None = None, run_arch: str | None = None,
               run_id: str = "") -> RunConfig:
    """The configuration of a new run (stored None), or of the resumed run whose stored configuration and arch are
    given; UsageError naming the option where a value is bad or contradicts the stored run."""
    given = given_config(args)
    llm_given = {field: getattr(args, dest) for field, dest in LLM_OPTIONS.items() if getattr(args, dest) is not None}
    base: dict[str, Any] = {}
    if stored is not None:
        base = {**stored, "arch": run_arch or stored.get("arch")}
        for field in FIXED:
            if field in given and given[field] != base.get(field, getattr(DEFAULTS, field)):
                raise UsageError(contradiction(run_id, field, base.get(field), given[field]))
    if args.no_db:
        tuning_db = None
    elif args.db:
        tuning_db = str(args.db)
    else:
        tuning_db = base["tuning_db"] if "tuning_db" in base else str(default_path())
    try:
        llm = (LlmSettings.from_env(**llm_given) if stored is None
               else LlmSettings(**{**(stored.get("llm") or {}), **llm_given}))
        return RunConfig(**{**base, **given, "tuning_db": tuning_db, "llm": llm})
    except ValidationError as e:
        raise UsageError(validation_message(e, OPTION_NAMES)) from None


def contradiction(run_id: str, field: str, was: Any, given: Any) -> str:
    if field == "compile_only":
        what = "a compile-only run" if was else "a run on a GPU"
        return f"run {run_id} is {what}: --resume keeps that (drop --compile-only, or start a new run)"
    option = OPTION_NAMES[field]
    return (f"run {run_id} was started with {option} {was}: --resume keeps it, so {option} {given} contradicts it "
            "(drop it, or start a new run)")


def shapes_defaults(args: argparse.Namespace) -> tuple[str, str, bool, str]:
    """The layout, dtype, bias and epilogue for --mnk shapes and shapes-file lines that do not name their own."""
    return args.b_layout or "kn", args.dtype or "fp16", bool(args.bias), args.epilogue or "none"
