"""End to end on a model nobody here wrote: Hugging Face LlamaForCausalLM with Llama-3-8B dimensions (hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, vocabulary 128256), 4 layers, random weights, fp16, on the GPU.

    python tools/e2e_llama.py [--run RUN] [--budget-minutes 6] [--max-candidates 8] [--modes eager,graphs,compile]

1. Records the model's GEMMs (agent.record_gemm_shapes) for a prefill (1 x 2048 tokens) and a decode step per batch
   (1, 8, 32, 64 sequences over a 512-token static KV cache), one shapes file each and their union.
2. Searches them (`python -m agent run --shapes`, in a subprocess, within the budget; --run RUN reuses a run) and
   exports the run (`python -m agent export`, which self-checks the export).
3. Builds the compiled op, patches a copy of the model (hgemm_ops.patch), and per phase times the forward pass of
   the unpatched and the patched model in this process, interleaved round by round: eager, replays of a CUDA graph
   of each, and torch.compile (default mode) of each; compares their logits.
4. Prints a table; with $OUT set, writes $OUT/e2e_llama.json (and the shapes files).

--record-only stops after step 1 and needs no GPU (--device cpu --tiny: a small config for a quick look).
Needs `transformers` (on the GPU image; not a dependency of the project).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.recorder import record_gemm_shapes  # noqa: E402
from sandbox.serve_bench import load_ops  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
            max_position_embeddings=4096)


@dataclass(frozen=True)
class Phase:
    name: str
    batch: int
    tokens: int  # new tokens per sequence in the timed forward
    context: int  # tokens already in the KV cache (0: a prefill without a cache)


@dataclass
class Row:
    phase: str
    mode: str
    ref_ms: float | None = None
    ours_ms: float | None = None
    speedup: float | None = None
    rel_err: float | None = None  # ||logits_ours - logits_ref|| / ||logits_ref||
    note: str = ""


def build_model(layers: int, tiny: bool, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, **(TINY if tiny else LLAMA3_8B))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.half().eval(), config


def forward_arguments(model) -> tuple[str, dict]:
    """The name the model's forward takes its KV cache by (past_key_values before transformers 5: cache), and the
    argument that keeps only the last position's logits, as generation does (where this version has it)."""
    params = inspect.signature(getattr(model, "_orig_mod", model).forward).parameters
    last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return ("past_key_values" if "past_key_values" in params else "cache"), last


def static_cache(config, batch: int, length: int, device: str):
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    wanted = {"config": config, "max_cache_len": length, "max_batch_size": batch, "batch_size": batch,
              "device": device, "dtype": torch.float16}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # newer: shaped lazily, on the first update
        return StaticCache(config=config, max_cache_len=length)
    return StaticCache(**{k: v for k, v in wanted.items() if k in params})


def make_step(model, eager_model, config, phase: Phase, device: str):
    """A call running the phase's forward through `model` (the same one each time: a decode step writes the same
    cache slot) and returning its logits; a decode's cache is filled with its context by `eager_model` first."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(config.vocab_size, (phase.batch, phase.context + phase.tokens), generator=g).to(device)
    key, last = forward_arguments(eager_model)
    if phase.context == 0:
        return lambda: model(input_ids=ids, use_cache=False, **last).logits
    cache = static_cache(config, phase.batch, phase.context + phase.tokens, device)
    prompt = torch.arange(phase.context, device=device)
    eager_model(input_ids=ids[:, :phase.context], use_cache=True, cache_position=prompt, **{key: cache})
    step_ids = ids[:, phase.context:]
    position = torch.arange(phase.context, phase.context + phase.tokens, device=device)
    positions = position.expand(phase.batch, -1)
    # transformers 5 counts the tokens a static layer holds on the device and writes where the count says: set it
    # back after each step (one small kernel), so that every step writes the same slot
    counts = [c for layer in getattr(cache, "layers", []) if torch.is_tensor(c := getattr(layer, "cumulative_length",
                                                                                          None))]

    def step():
        logits = model(input_ids=step_ids, use_cache=True, cache_position=position, position_ids=positions, **last,
                       **{key: cache}).logits
        if counts:
            torch._foreach_sub_(counts, phase.tokens)
        return logits

    return step


def record(model, config, phases: list[Phase], folder: Path, device: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines: dict[str, None] = {}
    with torch.inference_mode():
        for phase in phases:
            step = make_step(model, model, config, phase, device)
            with record_gemm_shapes(folder / f"shapes_{phase.name}.txt") as rec:
                step()
            lines.update(dict.fromkeys(p.key for p in rec.problems))
            print(f"{phase.name}: {len(rec.problems)} problems, skipped {dict(rec.skipped) or 'none'}")
    union = folder / "shapes_all.txt"
    union.write_text("# GEMMs of LlamaForCausalLM (Llama-3-8B dimensions): prefill and decode\n" + "\n".join(lines)
                     + "\n")
    return union


def agent_cli(*args: str) -> None:
    print("$ python -m agent " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "agent", *args], cwd=ROOT, check=True)


def search(shapes: Path, args) -> str:
    before = set(os.listdir(args.runs_dir)) if args.runs_dir.is_dir() else set()
    agent_cli("run", "--shapes", str(shapes), "--budget-minutes", str(args.budget_minutes), "--max-candidates",
              str(args.max_candidates), "--no-profile", "--runs-dir", str(args.runs_dir))
    (run,) = set(os.listdir(args.runs_dir)) - before
    return run


def timed(fns: dict[str, callable], rounds: int, inner: int) -> dict[str, float]:
    """Milliseconds per call of each function (host clock around `inner` calls and a synchronize), interleaved
    round by round; the median round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3 / inner)
    return {name: statistics.median(ts) for name, ts in times.items()}


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


def compare(phase: Phase, mode: str, ref, ours, args) -> Row:
    """ref and ours: zero-argument calls returning logits."""
    try:
        if mode == "graphs":
            (ref, ref_out), (ours, ours_out) = graphed(ref), graphed(ours)
            ref(), ours()
        else:
            for _ in range(2):  # warm-up (and compilation)
                ref_out, ours_out = ref(), ours()
        err = float(torch.linalg.norm((ours_out - ref_out).float()) / torch.linalg.norm(ref_out.float()))
        inner = 2 if phase.context == 0 else 10
        t = timed({"ref": ref, "ours": ours}, args.rounds, inner)
    except Exception as e:  # a mode that cannot run this model here is a row saying why, not the end of the tool
        return Row(phase.name, mode, note=f"{type(e).__name__}: {str(e).splitlines()[0][:150]}")
    return Row(phase.name, mode, t["ref"], t["ours"], t["ref"] / t["ours"], err)


def routed_calls(ops, model, step) -> tuple[int, int]:
    """(nn.Linear calls that ran an exported kernel, nn.Linear calls) in one call of `step` through `model`."""
    hits = [0, 0]

    def look(module, inputs):
        hits[1] += 1
        hits[0] += ops.explain(inputs[0], module.weight, module.bias, "nk").startswith("kernel")

    handles = [m.register_forward_pre_hook(look) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return hits[0], hits[1]


GEMM_OPS = ("aten::mm", "aten::addmm")  # where F.linear / torch.matmul on 2-D weights launch their kernels


def gemm_share(step) -> float:
    """The share of one step's GPU kernel time spent in GEMM kernels (those launched under aten::mm / aten::addmm),
    by the PyTorch profiler: what replacing GEMMs can move at most (Amdahl)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    # the kernels themselves (an operator's self device time counts the kernels it launched a second time)
    total = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    return sum(e.device_time_total for e in events if e.key in GEMM_OPS) / total if total else 0.0


def needed_gemm_speedup(share: float, target: float) -> float:
    """How much faster every GEMM must get for the whole step to be `target` times faster (inf: not reachable)."""
    rest = 1 / target - (1 - share)
    return share / rest if rest > 0 else float("inf")


def markdown(rows: list[Row]) -> str:
    """The table docs/notebook.md keeps."""
    lines = ["| phase | mode | unpatched ms | patched ms | speed-up | logits rel. diff |", "|---" * 6 + "|"]
    for r in rows:
        lines.append(f"| {r.phase} | {r.mode} | " + (f"{r.note} | | | |" if r.note else
                     f"{r.ref_ms:.3f} | {r.ours_ms:.3f} | {r.speedup:.3f}x | {r.rel_err:.1e} |"))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", help="reuse this run's kernels instead of searching")
    p.add_argument("--budget-minutes", type=float, default=6.0, help="the search's budget over all shapes")
    p.add_argument("--max-candidates", type=int, default=8, help="per shape")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "runs")
    p.add_argument("--work", type=Path, help="shapes files and the export (default runs/e2e-llama)")
    p.add_argument("--no-check", action="store_true", help="skip the export's self-check")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--decode-batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=512, help="tokens in the KV cache at a decode step")
    p.add_argument("--modes", default="eager,graphs,compile")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small config (a quick look on the CPU)")
    p.add_argument("--record-only", action="store_true", help="write the shapes files and stop (no GPU needed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.record_only and not torch.cuda.is_available():
        print("error: timing needs a CUDA GPU (--record-only writes the shapes files without one)", file=sys.stderr)
        return 2
    work = args.work or args.runs_dir / "e2e-llama"
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    phases = [Phase("prefill", 1, args.prefill_tokens, 0)] + [
        Phase(f"decode{b}", b, 1, args.context) for b in map(int, args.decode_batches.split(","))]
    model, config = build_model(args.layers, args.tiny, args.device)
    shapes = record(model, config, phases, out_dir or work, args.device)
    if args.record_only:
        print(f"shapes written to {shapes.parent}")
        return 0
    run = args.run or search(shapes, args)
    export = work / f"export-{run}"
    agent_cli("export", run, "--out", str(export), "--runs-dir", str(args.runs_dir),
              *(["--no-check"] if args.no_check else []))
    ops = load_ops(export)
    ours = copy.deepcopy(model)
    routed = ops.patch(ours)
    print(f"launch path: {ops.path()}; {routed} linear layers routed; run {run}")
    rows, phase_facts = [], {}
    with torch.inference_mode():
        for phase in phases:  # what the patch can move in each phase: its GEMMs' share, the calls it routes
            share = gemm_share(make_step(model, model, config, phase, args.device))
            hit, calls = routed_calls(ops, ours, make_step(ours, ours, config, phase, args.device))
            need = needed_gemm_speedup(share, 1.10)
            phase_facts[phase.name] = {"gemm_share": share, "kernel_calls": hit, "linear_calls": calls,
                                       "gemm_speedup_for_1.10x": need}
            print(f"{phase.name:>10}: GEMMs {share:.0%} of kernel time (1.10x end to end needs GEMMs {need:.2f}x "
                  f"faster); {hit} of {calls} linear calls run an exported kernel", flush=True)
        eager = {"ref": model, "ours": ours}
        for mode in args.modes.split(","):
            models = {n: torch.compile(m) for n, m in eager.items()} if mode == "compile" else eager
            for phase in phases:
                ref, our = (make_step(models[n], eager[n], config, phase, args.device) for n in ("ref", "ours"))
                rows.append(compare(phase, mode, ref, our, args))
                r = rows[-1]
                print(f"{r.phase:>10} {r.mode:>8}: " + (r.note or f"ref {r.ref_ms:.3f} ms, ours {r.ours_ms:.3f} ms, "
                                                        f"{r.speedup:.3f}x, rel err {r.rel_err:.1e}"), flush=True)
    print(markdown(rows))
    report = {"run": run, "path": ops.path(), "routed_layers": routed, "device": torch.cuda.get_device_name(),
              "phases": [asdict(p) for p in phases], "phase_facts": phase_facts, "rows": [asdict(r) for r in rows]}
    if out_dir:
        (out_dir / "e2e_llama.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
