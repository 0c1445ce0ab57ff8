"""What `patch` does to decoder architectures nobody here wrote: each causal LM of the installed `transformers` built
as a tiny random model, run, fused as the export fuses it (agent/export/runtime/hgemm_fuse.py) with PyTorch's own
ops in place of the kernels, run again, and put back. Any difference in the logits is then the fusion's, not a
kernel's: a recognised layer must match the stock model to fp32 rounding, and `unfuse` must give back the same
parameters and logits bit for bit.

    python3 tools/arch_probe.py                      # every causal LM transformers has (a few minutes on a CPU)
    python3 tools/arch_probe.py --archs llama,gemma2,granite --json probe.json
    python3 tools/arch_probe.py --run cached         # a prefill and two decode steps with the KV cache
    python3 tools/arch_probe.py --run compiled       # one forward under torch.compile(fullgraph=True, aot_eager)

    python3 tools/arch_probe.py --export EXPORT --device cuda --dtype f16 --run cached   # the export's own op

One line per architecture: what was fused (counts per kind), the logits' relative error (max over elements of
|fused - stock| / max |stock|), and WRONG where it is above --tolerance or the restored model differs; architectures
that do not build tiny are listed as skipped with why. Exit 1 where any is WRONG. Needs `transformers`.

--export DIR patches with that export's hgemm_ops (`patch` / `unpatch`: its compiled op, its norm and gated kernels
where they serve, cuBLAS and PyTorch's ops where not) instead of fusing with PyTorch's ops, and `--run compiled`
then compiles with inductor, as a user's model is. In fp16 or bf16 (--dtype) the reference is the stock model in
fp32: the fused model's error against it must be within twice the stock model's own (its rounding in that dtype)
plus --tolerance.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_models import forward_arguments  # noqa: E402
from tiny_configs import causal_lms, tiny_model  # noqa: E402

from agent.export.runtime import hgemm_fuse  # noqa: E402
from core.epilogue import Epilogue, compose  # noqa: E402

TOLERANCE = 1e-5
TIMEOUT_S = 60  # an architecture's build, runs and checks; one that takes longer is skipped
MEMORY_BYTES = 6 << 30  # an architecture's address space (configs with large defaults the tiny names miss)


class TorchOps:
    """What hgemm_ops computes where no exported kernel serves: PyTorch's linear, the epilogue's composition and
    Llama's RMSNorm (norm_linear: the norm, then fused_linear); `calls` lists each call's epilogue (or "rms_norm")
    and weight shape."""

    calls: list = []

    @classmethod
    def linear(cls, x, w, bias=None):
        cls.calls.append(("none", tuple(w.shape)))
        return F.linear(x, w, bias)

    @classmethod
    def fused_linear(cls, x, w, bias, epilogue, residual):
        cls.calls.append((epilogue, tuple(w.shape)))
        return compose(F.linear(x, w, bias), Epilogue(epilogue), residual)

    @classmethod
    def rms_norm(cls, x, w, eps, kind=0, residual=None):
        cls.calls.append(("rms_norm", tuple(w.shape)))
        out = hgemm_fuse.recognise.RMS_NORMS[kind](x, w, eps)
        return out if residual is None else residual + out

    @classmethod
    def norm_linear(cls, x, norm_w, eps, kind, w, bias, epilogue, residual=None):
        return cls.fused_linear(cls.rms_norm(x, norm_w, eps, kind), w, bias, epilogue, residual)


@torch.library.custom_op("hgemm_probe::fused_linear", mutates_args=())
def _opaque_fused_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, epilogue: str,
                         residual: torch.Tensor | None) -> torch.Tensor:
    return TorchOps.fused_linear(x, w, bias, epilogue, residual).clone()


@_opaque_fused_linear.register_fake
def _(x, w, bias, epilogue, residual):
    return x.new_empty((*x.shape[:-1], Epilogue(epilogue).out_cols(w.shape[0])))


@torch.library.custom_op("hgemm_probe::rms_norm", mutates_args=())
def _opaque_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, kind: int,
                     residual: torch.Tensor | None) -> torch.Tensor:
    return TorchOps.rms_norm(x, w, eps, kind, residual).clone()


@_opaque_rms_norm.register_fake
def _(x, w, eps, kind, residual):
    return torch.empty_like(x)


class OpaqueOps(TorchOps):
    """TorchOps behind custom ops that torch.compile cannot look into, as it cannot into the exported op: each call
    a new tensor in the traced graph (an op that returns its input in eager, such as dropout outside training, gives
    a new tensor there too)."""

    @classmethod
    def linear(cls, x, w, bias=None):
        return _opaque_fused_linear(x, w, bias, "none", None)

    @classmethod
    def fused_linear(cls, x, w, bias, epilogue, residual):
        return _opaque_fused_linear(x, w, bias, epilogue, residual)

    @classmethod
    def rms_norm(cls, x, w, eps, kind=0, residual=None):
        return _opaque_rms_norm(x, w, eps, kind, residual)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def cached_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of a prefill of all but the last two tokens, then of one decode step for each of those two with
    the model's KV cache (under the name this transformers gives it), in order: the fused layers' arguments (the
    cache among them) in use."""
    cache, _ = forward_arguments(model)
    with torch.no_grad():
        out = model(input_ids=ids[:, :-2], use_cache=True)
        logits = [out.logits]
        for t in (-2, -1):
            out = model(input_ids=ids[:, t:t + 1 or None], **{cache: getattr(out, cache)}, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, 1).float()


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _patching(ops):
    """(fuse, unfuse) for `ops`: an export's hgemm_ops module (its patch / unpatch) or a class of ops that
    hgemm_fuse.fuse runs the fused layers with (TorchOps and the like)."""
    if hasattr(ops, "patch"):
        return ops.patch, ops.unpatch
    return (lambda m: hgemm_fuse.fuse(m, ops)), (lambda m: hgemm_fuse.unfuse(m))


def check(model: torch.nn.Module, run, ops=TorchOps, tolerance: float = TOLERANCE,
          reference: torch.Tensor | None = None) -> dict:
    """Fuse `model` with `ops` (an ops class, or an export's hgemm_ops: _patching), compare `run(model)` (its logits)
    with the stock model's, unfuse, and compare the parameters and logits with the stock ones bit for bit. With a
    `reference` (the stock model's logits in fp32, for a model in fp16 or bf16), the fused model's error is taken
    against it and may be twice the stock model's own (`own`) plus `tolerance`. The record: status (ok or WRONG),
    fused (counts per kind), error, own, restored, why."""
    record = {"status": "ok", "fused": {}, "error": None, "own": None, "restored": None, "why": ""}
    stock = run(model)
    ref = stock.float() if reference is None else reference
    record["own"] = _error(stock, ref)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fuse, unfuse = _patching(ops)
    problems = []
    try:
        counts = fuse(model)
        record["fused"] = {k: v for k, v in counts.items() if v}
        record["error"] = _error(run(model), ref)
        if not record["error"] <= 2 * record["own"] + tolerance:
            problems.append(f"logits off by {record['error']:.2g}"
                            + (f" (the stock model's own rounding: {record['own']:.2g})" if record["own"] else ""))
    except Exception as e:
        problems.append(f"fused model raised {type(e).__name__}: {_first_line(e)}")
    finally:
        unfuse(model)
    params = dict(model.named_parameters())
    record["restored"] = (params.keys() == before.keys() and all(torch.equal(params[n], t) for n, t in before.items())
                          and torch.equal(run(model), stock))
    if not record["restored"]:
        problems.append("unfuse did not restore the model bit for bit")
    record["status"] = "WRONG" if problems else "ok"
    record["why"] = "; ".join(problems)
    return record


def compiled_logits(model: torch.nn.Module, ids: torch.Tensor, backend: str = "aot_eager") -> torch.Tensor:
    """logits() compiled whole (fullgraph; aot_eager: traced as inductor traces, run by PyTorch's eager kernels), from
    a fresh compile cache so that a fused model is traced anew; a graph break raises."""
    torch._dynamo.reset()
    return torch.compile(logits, fullgraph=True, backend=backend)(model, ids)


RUNS = {"forward": logits, "cached": cached_logits, "compiled": compiled_logits}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def probe(model_type: str, tolerance: float = TOLERANCE, run: str = "forward", export=None, device: str = "cpu",
          dtype: str = "f32") -> dict:
    """One architecture built tiny and checked (`check`) with one of RUNS: one forward, a prefill and two cached
    decode steps, or one forward compiled; skipped, with why, where the stock model does not build or run so.
    `export` (an export's hgemm_ops module) patches in place of PyTorch's ops, and a compiled run then compiles with
    inductor; the model runs on `device` in `dtype`, against its fp32 self where that is not f32."""
    backend = {"backend": "inductor"} if export is not None and run == "compiled" else {}
    for every_kind in (True, False):  # one layer of each type; where that does not build or run, as configured
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = tiny_model(model_type, every_kind).to(device)
                vocab = model.get_input_embeddings().num_embeddings
                ids = torch.randint(min(vocab, 200), (1, 9), generator=torch.Generator().manual_seed(1)).to(device)

                def go(m, ids=ids):
                    return RUNS[run](m, ids, **backend)
                reference = None if dtype == "f32" else go(model).float()
                model.to(DTYPES[dtype])
                go(model)
                break
        except Exception as e:  # configs that need more than the tiny dimensions, remote code, vision towers
            if not every_kind:
                return _skipped(model_type, f"{type(e).__name__}: {_first_line(e)}")
    ops = export if export is not None else OpaqueOps if run == "compiled" else TorchOps
    return {"type": model_type, **check(model, go, ops, tolerance, reference)}


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:120] if str(e) else ""


def _skipped(model_type: str, why: str) -> dict:
    return {"type": model_type, "status": "skipped", "fused": {}, "error": None, "own": None, "restored": None,
            "why": why}


def _child(model_type: str, tolerance: float, run: str, options: dict, conn) -> None:
    if options.get("device", "cpu") == "cpu":  # CUDA reserves more address space than the limit allows
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    warnings.simplefilter("ignore")  # a deprecated argument's warning on every call of a model
    try:
        if isinstance(options.get("export"), Path):  # a spawned child (CUDA) loads the export itself
            from sandbox.serve_bench import load_ops

            options = {**options, "export": load_ops(options["export"])}
        conn.send(probe(model_type, tolerance, run, **options))
    except BaseException as e:  # MemoryError included: the parent reports it
        conn.send(_skipped(model_type, f"{type(e).__name__} outside the checks"))


def isolated(model_type: str, tolerance: float = TOLERANCE, timeout_s: float = TIMEOUT_S,
             run: str = "forward", **options) -> dict:
    """probe() in a process of its own (`options`: probe's export, as a loaded module or as its folder; device and
    dtype), with a time limit and on the CPU a memory limit: a model that hangs, runs out of memory or crashes the
    interpreter is skipped with why. Forked where the export is a module (or none); spawned where it is a folder,
    which the child loads itself (for CUDA, which a forked child cannot use once the parent has)."""
    ctx = multiprocessing.get_context("spawn" if isinstance(options.get("export"), Path) else "fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(model_type, tolerance, run, options, send), daemon=True)
    proc.start()
    send.close()
    try:
        record = recv.recv() if recv.poll(timeout_s) else None
    except EOFError:  # the process ended without a record
        record = None
    proc.join(1)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if record is None:
        why = f"took over {timeout_s:.0f} s" if proc.exitcode in (None, -9) else f"the process died ({proc.exitcode})"
        record = _skipped(model_type, why)
    return record


def _cuda_in_a_child() -> bool:
    """Whether CUDA works here, asked in a forked process: the parent stays unused by CUDA, so later children can."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(torch.cuda.is_available)


def line(r: dict) -> str:
    if r["status"] == "skipped":
        return f"{r['type']:<28} skipped  {r['why']}"
    fused = ", ".join(f"{k} {v}" for k, v in r["fused"].items()) or "nothing recognised"
    err = "-" if r["error"] is None else f"{r['error']:.1e}"
    own = f" (stock {r['own']:.1e})" if r.get("own") else ""
    return f"{r['type']:<28} {r['status']:<8} {err:>8}{own}  {fused}" + (f"  ({r['why']})" if r["why"] else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--archs", help="model types, comma-separated (default: every causal LM transformers has)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="largest relative logits error of a fused "
                    f"model (default {TOLERANCE})")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds an architecture may take (default "
                    f"{TIMEOUT_S}); it runs in a process of its own")
    ap.add_argument("--json", help="also write the records here (rewritten after each architecture)")
    ap.add_argument("--run", choices=sorted(RUNS), default="forward", help="what is compared: one forward (default), "
                    "a prefill and two decode steps with the KV cache (the layers' cache arguments in use), or one "
                    "forward compiled whole (graph breaks in a fused forward fail it); give compiled a --timeout of "
                    "a few minutes")
    ap.add_argument("--export", type=Path, help="patch with this export's hgemm_ops (its op and kernels) instead of "
                    "PyTorch's ops")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the models run (default cpu)")
    ap.add_argument("--dtype", default="f32", choices=sorted(DTYPES), help="the models' dtype (default f32); in f16 "
                    "or bf16 the fused model may be off its fp32 self by twice the stock model's own error")
    args = ap.parse_args(argv)
    try:
        known = causal_lms()
    except ImportError:
        print("arch_probe: needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    if not (args.tolerance > 0 and args.timeout > 0):
        print("arch_probe: --tolerance and --timeout must be positive", file=sys.stderr)
        return 2
    if args.device == "cuda" and not _cuda_in_a_child():
        print("arch_probe: --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if args.export is not None and not (args.export / "hgemm_ops.py").is_file():
        print(f"arch_probe: --export {args.export}: not an export (no hgemm_ops.py)", file=sys.stderr)
        return 2
    archs = [a.strip() for a in args.archs.split(",") if a.strip()] if args.archs else known
    if unknown := [a for a in archs if a not in known]:
        print(f"arch_probe: not a causal LM of this transformers: {', '.join(unknown)}", file=sys.stderr)
        return 2
    options = {"device": args.device, "dtype": args.dtype, "export": None}
    if args.export is not None:  # loaded and its op built here, once; forked children use it, spawned ones load it
        from sandbox.serve_bench import load_ops

        ops = load_ops(args.export)
        print(f"export {args.export}: launch path {'compiled' if ops.compiled() else 'python'}", flush=True)
        options["export"] = args.export.resolve() if args.device == "cuda" else ops
    records, t0 = [], time.time()
    for i, arch in enumerate(archs, 1):
        records.append(isolated(arch, args.tolerance, args.timeout, args.run, **options))
        print(f"[{i}/{len(archs)} {time.time() - t0:5.0f}s] " + line(records[-1]), flush=True)
        if args.json:  # after each architecture: an interrupted run keeps what it has
            Path(args.json).write_text(json.dumps(records, indent=1))
    status = [r["status"] for r in records]
    print(f"\n{len(records)} architectures: {status.count('ok')} ok "
          f"({sum(1 for r in records if r['status'] == 'ok' and r['fused'])} with something fused), "
          f"{status.count('WRONG')} WRONG, {status.count('skipped')} skipped")
    return 1 if "WRONG" in status else 0


if __name__ == "__main__":
    sys.exit(main())
