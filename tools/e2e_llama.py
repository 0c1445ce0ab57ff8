"""End to end on models nobody here wrote: Hugging Face decoders with the dimensions of public models (Llama-3-8B,
Qwen2-7B, StarCoder2-7B, Gemma-2-9B, GLM-4-9B, Phi-2, Mixtral-8x7B, OPT-6.7B: tools/e2e_models.py), a few layers,
random weights, fp16 or bf16, on the GPU.

    python tools/e2e_llama.py [--model MODEL] [--dtype f16|bf16] [--run RUN | --export DIR] [--budget-minutes 6]
        [--max-candidates 8] [--modes eager,graphs,compile,max-autotune,overlap]

1. Records the problems the patched model will run (agent.record_gemm_shapes with the model: q/k/v merged, gate/up
   as one gated GEMM, o_proj and down_proj with the residual add) for the prefills (1 x 2048 tokens; or several
   lengths, --prefill-random N more drawn from 100-4000) and a decode step per batch (1, 8, 32, 64 sequences, or
   every batch of a range such as 1-64, over a 512-token static KV cache), one shapes file each and their union;
   with --ranges, one file with each problem once over the range of M its phases run (searched in buckets of M).
2. Searches them (`python -m agent run --shapes`, in a subprocess, within the budget; --run RUN reuses a run) and
   exports the run (`python -m agent export`, which self-checks the export); --export DIR uses an export as it is.
3. Builds the compiled op, patches a copy of the model (hgemm_ops.patch: fused layers, the rest routed) and per
   phase times the forward pass of the stock and the patched model in this process, interleaved round by round:
   eager; replays of a CUDA graph of each (graphs); torch.compile default of each (compile); the stock model under
   torch.compile(mode="max-autotune-no-cudagraphs") against the patched model under torch.compile default
   (max-autotune); and the patched model in CUDA graphs with its kernels launched plainly (the stock column) against
   overlapped (overlap: `hgemm_ops.overlap`, one process, interleaved). Compares their logits with each other and
   each with the same model's in fp32 (the stock model's own rounding is the bound for the patched one's; --no-fp32
   skips it); reports the compilations' seconds.
   After compiling, inductor's compile workers are shut down before the timing (`settle`), so that nothing of a
   compilation runs beside the timed steps. The compiled decode steps are host-bound and their wall times vary by
   30-40% between runs; tools/compile_diag.py --only times each model in a process of its own.
4. Prints a table (beside each model's wall time a step, the host's time to issue it: where it is 90% of the wall
   or more, the row says that model is host-bound in this process), and per mode the geomean and the lowest
   speed-up over the prefills and over the decode steps;
   with $OUT set, writes $OUT/e2e_<model>_<dtype>.json (and the shapes files, the search's per-shape table as
   $OUT/search_<model>_<dtype>.txt, and with --tar-export the export as $OUT/export.tar.gz for --export in a later
   call).

--record-only stops after step 1 and needs no GPU (--device cpu --model tiny: a quick look).
Needs `transformers` (on the GPU image; not a dependency of the project).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from e2e_models import CONFIGS, Phase, build_model, counts, counts_or_none, make_step, settle, timed  # noqa: E402

from agent.recorder import GemmRecorder, record_gemm_shapes  # noqa: E402
from sandbox.serve_bench import load_ops  # noqa: E402

MODES = ("eager", "graphs", "compile", "max-autotune", "overlap")


@dataclass
class Row:
    phase: str
    mode: str
    ref_ms: float | None = None
    ours_ms: float | None = None
    speedup: float | None = None
    rel_err: float | None = None  # ||logits_ours - logits_ref|| / ||logits_ref||
    stock_err32: float | None = None  # the stock model's own rounding: ||logits_ref - logits_fp32|| / ||logits_fp32||
    ours_err32: float | None = None  # the patched model's against the same fp32 logits
    note: str = ""
    compile_s: tuple[float, float] | None = None  # stock's and ours', where compiled
    host_ms: tuple[float, float] | None = None  # stock's and ours': the host's time to issue a step (timed's)


def record(model, config, phases: list[Phase], folder: Path, device: str, name: str, ranges: bool = False) -> Path:
    """The shapes file of the patched model's problems over all phases (shapes_all.txt): each problem at the M of
    each phase, one shapes file per phase beside it; or, with `ranges`, each problem once with the range of M its
    phases run (LO-HI_N_K:..., searched in buckets of M) and no file per phase."""
    folder.mkdir(parents=True, exist_ok=True)
    union, merged = folder / "shapes_all.txt", GemmRecorder()
    with torch.inference_mode():
        for phase in phases:
            step = make_step(model, model, config, phase, device)  # outside the recorder: a decode's cache fill
            with record_gemm_shapes(None if ranges else folder / f"shapes_{phase.name}.txt", model=model) as rec:
                step()
            merged.problems.update(rec.problems)
            merged.skipped.update(rec.skipped)
            if not ranges:
                print(f"{phase.name}: {len(rec.problems)} problems, skipped {dict(rec.skipped) or 'none'}")
    if ranges:
        union.write_text(merged.text())
        print(f"{len(phases)} phases: {len(merged.ranges())} problems over ranges of M, skipped "
              f"{dict(merged.skipped) or 'none'}")
        return union
    union.write_text(f"# the problems of a patched {name} (fused decoder layers): prefill and decode\n"
                     + "\n".join(dict.fromkeys(p.key for p in merged.problems)) + "\n")
    return union


def phases_of(args) -> list[Phase]:
    """The prefills (--prefill-tokens, none where it is "", plus --prefill-random lengths drawn from --prefill-span)
    and decode steps (--decode-batches, none where it is ""); at least one phase."""
    tokens = counts_or_none(args.prefill_tokens)
    if args.prefill_random:
        span = counts(args.prefill_span)
        pool = sorted(set(span) - set(tokens))
        tokens = sorted(tokens + random.Random(args.seed).sample(pool, min(args.prefill_random, len(pool))))
    prefills = [Phase("prefill" if len(tokens) == 1 else f"prefill{t}", 1, t, 0) for t in tokens]
    batches = counts_or_none(args.decode_batches)
    if not prefills and not batches:
        raise ValueError('no phase: --prefill-tokens and --decode-batches are both ""')
    return prefills + [Phase(f"decode{b}", b, 1, args.context) for b in batches]


def summary(rows: list[Row]) -> dict[str, dict[str, float]]:
    """Per mode and kind of phase (prefill, decode): the geomean speed-up, the lowest and where, how many; and the
    largest ratio of the patched model's logits error to the stock model's (both against fp32), where measured."""
    out: dict[str, dict] = {}
    for r in rows:
        if r.speedup:
            kind = "decode" if r.phase.startswith("decode") else "prefill"
            out.setdefault(f"{r.mode} {kind}", {"all": [], "err": []})["all"].append((r.speedup, r.phase))
            if r.ours_err32 is not None and r.stock_err32:
                out[f"{r.mode} {kind}"]["err"].append(r.ours_err32 / r.stock_err32)
    for d in out.values():
        xs, errs = d.pop("all"), d.pop("err")
        low = min(xs)
        d.update(geomean=statistics.geometric_mean([x for x, _ in xs]), lowest=low[0], lowest_at=low[1], n=len(xs))
        if errs:
            d["err32_ratio_max"] = max(errs)
    return out


def agent_cli(*args: str, capture: bool = False) -> str:
    """`python -m agent ARGS` in a subprocess (a failure raises); with `capture`, its output (tables 200 wide)
    instead of the console."""
    print("$ python -m agent " + " ".join(args), flush=True)
    env = {**os.environ, "COLUMNS": "200"} if capture else None
    done = subprocess.run([sys.executable, "-m", "agent", *args], cwd=ROOT, check=True, capture_output=capture,
                          text=True, env=env)
    return (done.stdout or "") + (done.stderr or "") if capture else ""


def search(shapes: Path, args, out_dir: Path | None = None) -> str:
    """The run's id; with `out_dir`, the run's per-shape table (`agent show`: candidates tried, the best and its
    ratio, also where cuBLAS kept a problem) in out_dir/search_<model>_<dtype>.txt."""
    before = set(os.listdir(args.runs_dir)) if args.runs_dir.is_dir() else set()
    agent_cli("run", "--shapes", str(shapes), "--budget-minutes", str(args.budget_minutes), "--max-candidates",
              str(args.max_candidates), "--no-profile", "--runs-dir", str(args.runs_dir))
    (run,) = set(os.listdir(args.runs_dir)) - before
    if out_dir is not None:
        shown = agent_cli("show", run, "--runs-dir", str(args.runs_dir), capture=True)
        (out_dir / f"search_{args.model}_{args.dtype}.txt").write_text(shown)
    return run


def graphed(step):
    """The step captured in a CUDA graph (after warm-up on a side stream): a replay call, and its static logits."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph.replay, out


def plain_launches(ops, step):
    """`step` with the export's kernels launched plainly (not overlapped) during each call: what a CUDA graph captures
    of it keeps them so."""
    def call():
        was = ops.overlap(False)
        try:
            return step()
        finally:
            ops.overlap(was)
    return call


def warmed(step) -> tuple[float, torch.Tensor]:
    """Seconds of the first call (the compilation, where compiled) and the second call's logits."""
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, step()


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.norm((x.float() - ref.float()).reshape(-1)) / torch.linalg.norm(ref.float().reshape(-1)))


def fp32_logits(args, config, phases: list[Phase]) -> dict[str, torch.Tensor]:
    """Per phase, the logits of the same model (same seed, same weights) in fp32: the reference both the stock and
    the patched model's rounding are measured against."""
    model32, _ = build_model(args.model, args.layers, "f32", args.device)
    with torch.inference_mode():
        out = {ph.name: make_step(model32, model32, config, ph, args.device)().float() for ph in phases}
    del model32
    torch.cuda.empty_cache()
    return out


def compare(phase: Phase, mode: str, ref, ours, args, ref32: torch.Tensor | None = None) -> Row:
    """ref and ours: zero-argument calls returning logits; ref32: the fp32 model's logits for this phase."""
    compile_s = None
    try:
        if mode in ("graphs", "overlap"):
            (ref, ref_out), (ours, ours_out) = graphed(ref), graphed(ours)
            ref(), ours()
        else:
            (ref_s, ref_out), (ours_s, ours_out) = warmed(ref), warmed(ours)
            compile_s = (ref_s, ours_s) if mode in ("compile", "max-autotune") else None
            if compile_s:
                print(f"{phase.name:>10} {mode:>12}: compiled; workers: {settle()}", flush=True)
        err = rel(ours_out, ref_out)
        errs32 = (rel(ref_out, ref32), rel(ours_out, ref32)) if ref32 is not None else (None, None)
        inner = 2 if phase.context == 0 else 10
        t = timed({"ref": ref, "ours": ours}, args.rounds, inner)  # each: (wall, host) ms a step
        (ref_ms, ref_host), (ours_ms, ours_host) = t["ref"], t["ours"]
    except Exception as e:  # a mode that cannot run this model here is a row saying why, not the end of the tool
        return Row(phase.name, mode, note=f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
    return Row(phase.name, mode, ref_ms, ours_ms, ref_ms / ours_ms, err, *errs32, compile_s=compile_s,
               host_ms=(ref_host, ours_host))


def kernel_calls(ops, step) -> tuple[int, int]:
    """(calls that ran an exported kernel, calls through the export) in one call of `step`."""
    hits = [0, 0]
    inner = ops._eager  # resolved by patch()

    class Count:
        def __getattr__(self, name):
            def call(*args):
                if name == "rms_norm":  # no GEMM: (x, weight, eps, kind, residual)
                    return inner.rms_norm(*args)
                hits[1] += 1
                if name == "norm_linear":  # (x, norm_w, eps, kind, w, bias, epilogue, residual): the GEMM's x is x
                    x, _, _, _, w, bias, epi, residual = args
                    hits[0] += ops.explain(x, w, bias, "nk", ops.epilogue.EPILOGUES[epi], residual).startswith("kernel")
                elif name == "fused_linear":
                    a, b, bias, epi, residual = args
                    hits[0] += ops.explain(a, b, bias, "nk", ops.epilogue.EPILOGUES[epi], residual).startswith("kernel")
                else:
                    a, b, bias = (*args, None)[:3]
                    hits[0] += ops.explain(a, b, bias, "nk" if name == "linear" else "kn").startswith("kernel")
                return getattr(inner, name)(*args)
            return call

    ops._eager = Count()
    try:
        step()
    finally:
        ops._eager = inner
    return hits[0], hits[1]


HOST_BOUND = 0.9  # a model whose host takes this share of its step's wall time or more to issue it is host-bound


def host_bound(r: Row) -> str:
    """", host-bound: stock / ours / both" where that model's host time a step is HOST_BOUND of its wall or more."""
    if not r.host_ms or r.ref_ms is None or r.ours_ms is None:
        return ""
    sides = [name for name, host, wall in (("stock", r.host_ms[0], r.ref_ms), ("ours", r.host_ms[1], r.ours_ms))
             if host >= HOST_BOUND * wall]
    return f", host-bound: {'both' if len(sides) == 2 else sides[0]}" if sides else ""


def said(r: Row) -> str:
    """A row as the log line printed when it is timed."""
    if r.note:
        return f"{r.phase:>10} {r.mode:>12}: {r.note}"
    e32 = f" (vs fp32: stock {r.stock_err32:.1e}, ours {r.ours_err32:.1e})" if r.ours_err32 is not None else ""
    comp = f", compile {r.compile_s[0]:.0f} s / {r.compile_s[1]:.0f} s" if r.compile_s else ""
    host = f"; host a step {r.host_ms[0]:.3f} / {r.host_ms[1]:.3f} ms{host_bound(r)}" if r.host_ms else ""
    return (f"{r.phase:>10} {r.mode:>12}: stock {r.ref_ms:.3f} ms, ours {r.ours_ms:.3f} ms, {r.speedup:.3f}x, "
            f"rel err {r.rel_err:.1e}{e32}{comp}{host}")


def markdown(rows: list[Row]) -> str:
    """The table docs/notebook.md keeps."""
    lines = ["| phase | mode | stock ms | patched ms | speed-up | logits rel. diff | stock vs fp32 | patched vs fp32 "
             "| compile s (stock, ours) | host ms a step (stock, ours) |", "|---" * 10 + "|"]
    for r in rows:
        comp = f"{r.compile_s[0]:.0f}, {r.compile_s[1]:.0f}" if r.compile_s else ""
        host = f"{r.host_ms[0]:.3f}, {r.host_ms[1]:.3f}{host_bound(r)}" if r.host_ms else ""
        e32 = " | ".join(f"{e:.1e}" if e is not None else "" for e in (r.stock_err32, r.ours_err32))
        lines.append(f"| {r.phase} | {r.mode} | " + (f"{r.note} | | | | | | | |" if r.note else
                     f"{r.ref_ms:.3f} | {r.ours_ms:.3f} | {r.speedup:.3f}x | {r.rel_err:.1e} | {e32} | {comp} "
                     f"| {host} |"))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(CONFIGS), default="llama3-8b")
    p.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    p.add_argument("--run", help="reuse this run's kernels instead of searching")
    p.add_argument("--export", type=Path, help="use this export as it is (no search, no export)")
    p.add_argument("--tar-export", action="store_true", help="write the export to $OUT/export.tar.gz")
    p.add_argument("--budget-minutes", type=float, default=6.0, help="the search's budget over all shapes")
    p.add_argument("--max-candidates", type=int, default=8, help="per shape")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs")
    p.add_argument("--work", type=Path, help="shapes files and the export (default runs/e2e-<model>)")
    p.add_argument("--no-check", action="store_true", help="skip the export's self-check")
    p.add_argument("--no-norm-variants", action="store_true", help="export with `agent export --no-norm-variants`")
    p.add_argument("--no-norms", action="store_true", help="patch without the RMSNorm kernel (patch(norms=False))")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill-tokens", default="2048",
                   help="prefill lengths: 2048, or 512,2048, or 100-110, or \"\" for none")
    p.add_argument("--prefill-random", type=int, default=0, help="this many more prefill lengths, drawn at random")
    p.add_argument("--prefill-span", default="100-4000", help="where --prefill-random draws from")
    p.add_argument("--seed", type=int, default=0, help="for --prefill-random")
    p.add_argument("--decode-batches", default="1,8,32,64",
                   help='decode batch sizes: 1,8,32,64, or 1-64 (each), or "" for none')
    p.add_argument("--ranges", action="store_true",
                   help="record each problem once with the range of M its phases run (searched in buckets of M)")
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache at a decode step")
    p.add_argument("--modes", default="eager,graphs,compile", help=f"of {', '.join(MODES)}")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--no-fp32", action="store_true",
                   help="skip the fp32 model's logits (what both models' rounding is measured against)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--record-only", action="store_true", help="write the shapes files and stop (no GPU needed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.record_only and not torch.cuda.is_available():
        print("error: timing needs a CUDA GPU (--record-only writes the shapes files without one)", file=sys.stderr)
        return 2
    if bad := set(args.modes.split(",")) - set(MODES):
        print(f"error: --modes: unknown {', '.join(sorted(bad))} (of {', '.join(MODES)})", file=sys.stderr)
        return 2
    work = args.work or args.runs_dir / f"e2e-{args.model}"
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    try:
        phases = phases_of(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model, config = build_model(args.model, args.layers, args.dtype, args.device)
    if args.export is None:
        shapes = record(model, config, phases, out_dir or work, args.device, args.model, args.ranges)
        if args.record_only:
            print(f"shapes written to {shapes.parent}")
            return 0
        run = args.run or search(shapes, args, out_dir)
        export = work / f"export-{run}"
        agent_cli("export", run, "--out", str(export), "--runs-dir", str(args.runs_dir),
                  *(["--no-check"] if args.no_check else []),
                  *(["--no-norm-variants"] if args.no_norm_variants else []))
    else:
        run, export = "(given export)", args.export
    if args.tar_export and out_dir:
        with tarfile.open(out_dir / "export.tar.gz", "w:gz") as tar:
            tar.add(export, arcname="export", filter=lambda t: None if "/build" in t.name else t)
    ops = load_ops(export)
    ours = copy.deepcopy(model)
    done = ops.patch(ours, norms=not args.no_norms)
    print(f"launch path: {ops.path()}; patch: {done}; run {run}")
    print("\n".join(ops.explain_model(ours)[:1]))
    rows, facts = [], {}
    with torch.inference_mode():
        for phase in phases:
            hit, calls = kernel_calls(ops, make_step(ours, ours, config, phase, args.device))
            facts[phase.name] = {"kernel_calls": hit, "export_calls": calls}
            print(f"{phase.name:>10}: {hit} of {calls} calls through the export ran an exported kernel", flush=True)
        ref32 = {} if args.no_fp32 else fp32_logits(args, config, phases)
        eager = {"ref": model, "ours": ours}
        for mode in args.modes.split(","):
            for phase in phases:
                torch._dynamo.reset()
                models = fillers = eager  # fillers: the eager models that fill a decode's cache
                if mode == "compile":
                    models = {n: torch.compile(m) for n, m in eager.items()}
                elif mode == "max-autotune":
                    models = {"ref": torch.compile(model, mode="max-autotune-no-cudagraphs"),
                              "ours": torch.compile(ours)}
                elif mode == "overlap":  # the patched model twice: plainly (the stock column) and overlapped
                    models = fillers = {"ref": ours, "ours": ours}
                ref, our = (make_step(models[n], fillers[n], config, phase, args.device) for n in ("ref", "ours"))
                if mode == "overlap":
                    ref = plain_launches(ops, ref)
                rows.append(compare(phase, mode, ref, our, args, ref32.get(phase.name)))
                print(said(rows[-1]), flush=True)
    print(markdown(rows))
    totals = summary(rows)
    for key, d in totals.items():
        print(f"{key}: geomean {d['geomean']:.3f}x over {d['n']} phases, lowest {d['lowest']:.3f}x ({d['lowest_at']})"
              + (f"; logits error against fp32, patched / stock: at most {d['err32_ratio_max']:.2f}"
                 if "err32_ratio_max" in d else ""))
    report = {"summary": totals, "model": args.model, "dtype": args.dtype, "layers": args.layers, "run": run,
              "path": ops.path(), "patch": done, "device": torch.cuda.get_device_name(),
              "phases": [asdict(p) for p in phases], "facts": facts, "rows": [asdict(r) for r in rows]}
    if out_dir:
        (out_dir / f"e2e_{args.model}_{args.dtype}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
