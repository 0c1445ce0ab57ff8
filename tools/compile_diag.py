"""Where a compiled forward step's time goes: the stock and the patched model under torch.compile, per phase.

    python tools/compile_diag.py EXPORT_DIR [--model llama3-8b] [--dtype f16] [--decode-batches 1,8] [--layers 4]
        [--prefill-tokens 2048] [--mode default|max-autotune-no-cudagraphs] [--stock-mode MODE] [--steps 30]
        [--only stock|patched] [--timeline DIR]

For each decode batch (a step over a 512-token static KV cache, as tools/e2e_llama.py times it), the prefill of
--prefill-tokens tokens where given, and each model (stock, compiled in --stock-mode, and a copy patched with the
export, compiled in --mode): the wall time of a step run back to back and run synchronised one at a time, the GPU's
kernel time a step (each kernel's own time: a kernel launched overlapped with the one ahead counts from that one's
end) and the kernels a step (torch.profiler over a few steps), the kernels with the most GPU time (cuBLAS's names
mark a fallback), the CPU ops with the most self time, dynamo's guard evaluation a step (the guard tree's check
alone, on the step's own arguments), how many of its Triton kernels launch through inductor's static launcher (the
others through Triton's slower one) and dynamo's counters (graphs, graph breaks, recompilations). A step whose wall time
is well above its kernel time is host-bound; the CPU ops say on what. --timeline DIR writes one step's kernels in
the order they ran (start, the GPU's idle time before each, duration, own time, name) to DIR/<phase>_<model>.txt and
prints the step's idle time, and the GPU's idle time from the step's last kernel to the next step's first: where a
step's wall time exceeds its kernels' sum, it says whether the GPU waited between kernels (after which ones) or
between steps; it also profiles steps synchronised one at a time and writes the middle one's kernels to
DIR/<phase>_<model>_synchronised.txt (and the profile as a Chrome trace, .json), printing the host's time from the
step's call to its first kernel, the time from its last kernel to the synchronize's return and the longest CUDA
runtime calls inside the step (a call that waits on the GPU inside a step shows there). --only times one of the
models, so that each compilation can run in a process of its own (run it once for each model; between processes the
host's speed varies, so host-bound steps compare in one process, where every model's wall time is taken before any
model is profiled). Needs a GPU and `transformers`; --device cpu --model tiny: a quick look.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from e2e_models import CONFIGS, Phase, build_model, counts_or_none, make_step, settle  # noqa: E402

from sandbox.serve_bench import load_ops  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall_ms(step, n: int, device: str, each: bool) -> float:
    """Milliseconds a step over n steps: back to back (one synchronisation at the end) or synchronised each."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
        if each:
            sync(device)
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / n


def own_times(kernels: list) -> list[tuple[object, float]]:
    """The kernels by start, each with its own time: from the later of its start and the end of every kernel before
    it, to its end. A kernel launched overlapped (programmatic dependent launch) starts before the one ahead ends and
    waits inside for it: that wait is the kernel ahead's time, counted once."""
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    end, out = float("-inf"), []
    for e in ordered:
        out.append((e, max(0.0, e.time_range.end - max(e.time_range.start, end))))
        end = max(end, e.time_range.end)
    return out


def step_timeline(kernels: list, n: int) -> tuple[list[tuple[float, float, float, float, str]], float, float,
                                                  float | None]:
    """One step's kernels of n profiled back-to-back steps (the middle one, by count; `kernels` are profiler events
    with time_range in µs): (start from the step's first kernel, GPU idle before it, duration, own time (own_times),
    name) each, the step's span from its first kernel's start to its last's end, its idle time inside that span, and
    the GPU's idle time from its end to the next step's first kernel (None where no step follows)."""
    ordered = own_times(kernels)
    per = len(ordered) // n if n else 0
    one = ordered[per * (n // 2): per * (n // 2 + 1)]
    following = ordered[per * (n // 2 + 1)][0] if per and per * (n // 2 + 1) < len(ordered) else None
    t0 = end = one[0][0].time_range.start if one else 0.0
    rows, idle = [], 0.0
    for e, own in one:
        start, stop = e.time_range.start, e.time_range.end
        gap = max(0.0, start - end)
        idle += gap
        rows.append((start - t0, gap, stop - start, own, e.name))
        end = max(end, stop)
    after = max(0.0, following.time_range.start - end) if following is not None else None
    return rows, end - t0, idle, after


def profiled(step, n: int, device: str) -> dict:
    """Kernels a step, GPU kernel time a step, the top kernels by GPU time, the top CPU ops by self time and one
    step's timeline (step_timeline)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(n):
            step()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us: Counter = Counter()
    calls: Counter = Counter()
    for e, own in own_times(kernels):
        gpu_us[e.name[:90]] += own
        calls[e.name[:90]] += 1
    cpu = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)
    return {"kernels_a_step": len(kernels) / n, "gpu_ms_a_step": sum(gpu_us.values()) / n / 1e3,
            "top_kernels": [(name, calls[name] / n, us / n) for name, us in gpu_us.most_common(14)],
            "top_cpu": [(a.key[:70], a.count / n, a.self_cpu_time_total / n) for a in cpu[:20]],
            "timeline": step_timeline(kernels, n)}


def synchronised_step(step, n: int, device: str, trace: Path | None = None) -> dict:
    """n steps under torch.profiler, each in a record_function range followed by a synchronize, as a synchronised
    wall time runs them; for the middle one: the host's time from the step's call to its first kernel's start
    (`lead_us`), the step's kernel timeline (step_timeline), the time from its last kernel's end to the range's end
    after the synchronize (`tail_us`), and the longest CUDA runtime calls inside the range (name, start from the
    range's start, duration; µs; the range's own synchronize left out), where a call that waits on the GPU shows as
    a long one; with `trace`, the profile as a Chrome trace there (each CPU op against the kernels)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(n):
            with record_function("compile_diag_step"):
                step()
                sync(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return step_in_range(list(prof.events()), n)


def step_in_range(events: list, n: int) -> dict:
    """synchronised_step's figures from profiler events (each with name, device_type and time_range in µs)."""
    cuda = torch.autograd.DeviceType.CUDA
    ranges = sorted((e for e in events if e.name == "compile_diag_step" and e.device_type != cuda),
                    key=lambda e: e.time_range.start)
    mid = ranges[n // 2].time_range if n and len(ranges) >= n else None
    inside = [e for e in events if mid and mid.start <= e.time_range.start < mid.end]
    kernels = [e for e in inside if e.device_type == cuda and e.name != "compile_diag_step"]  # not the range's own
    runtime = sorted((e for e in inside if e.device_type != cuda and e.name.startswith("cu")),
                     key=lambda e: e.time_range.start)
    if runtime and "Synchronize" in runtime[-1].name:
        runtime.pop()  # the range's own synchronize
    calls = sorted(((e.name, e.time_range.start - mid.start, e.time_range.end - e.time_range.start) for e in runtime),
                   key=lambda c: c[2], reverse=True)
    first = min((e.time_range.start for e in kernels), default=None)
    last = max((e.time_range.end for e in kernels), default=None)
    return {"lead_us": None if first is None else first - mid.start,
            "tail_us": None if last is None else mid.end - last,
            "timeline": step_timeline(kernels, 1), "calls": calls[:5]}


def guard_us(eager, step, calls: int = 2000) -> float | None:
    """Microseconds one evaluation of dynamo's guards on the compiled forward takes (its guard tree's check, called
    `calls` times on the locals of one step's call of the model's forward, captured by a profile hook), or None
    where no compiled frame of the model's forward is found or its guards do not pass on those locals."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    f, codes = type(eager).forward, []
    while f is not None:  # the forward and what it wraps (transformers' decorators)
        codes.append(f.__code__)
        f = getattr(f, "__wrapped__", None)
    code = next((c for c in codes if _debug_get_cache_entry_list(c)), None)
    if code is None:
        return None
    checks = [entry.guard_manager.check for entry in _debug_get_cache_entry_list(code)]
    seen: dict = {}

    def hook(frame, event, arg):
        if event == "call" and not seen and (frame.f_code.co_name, frame.f_code.co_filename) == (code.co_name,
                                                                                                 code.co_filename):
            seen.update(frame.f_locals)
    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    check = next((c for c in checks if seen and c(seen)), None)  # this model's entry: its guards pass
    if check is None:
        return None
    t0 = time.perf_counter()
    for _ in range(calls):
        check(seen)
    return (time.perf_counter() - t0) * 1e6 / calls


def loaded_modules() -> list:
    """The Python modules inductor has loaded so far (its compiled graphs' wrappers), [] where it keeps none."""
    try:
        from torch._inductor.codecache import PyCodeCache
    except ImportError:
        return []
    return list(getattr(PyCodeCache, "modules", []))


def static_launches(modules: list) -> str:
    """How many of the Triton kernels in these modules launch through inductor's static launcher (the cheaper one;
    docs/decisions.md `short-kernel-names`): "S of N", or "-" where none or this torch keeps no such mark."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        return "-"
    tuners = [obj for mod in modules for obj in vars(mod).values() if isinstance(obj, CachingAutotuner)]
    launchers = [t.launchers[0] for t in tuners if t.launchers]
    if not launchers:
        return "-"
    return f"{sum(bool(getattr(launcher, '_is_static', False)) for launcher in launchers)} of {len(launchers)}"


def write_timeline(path: Path, title: str, timeline) -> str:
    """The step's timeline as a table in `path`; a line for the log: its span, idle time, largest gaps and the idle
    time before the next step."""
    rows, span, idle, after = timeline
    path.parent.mkdir(parents=True, exist_ok=True)
    then = "" if after is None else f"; then {after:.1f} us idle before the next step's first kernel"
    lines = [f"# {title}: {len(rows)} kernels, span {span:.1f} us, GPU idle {idle:.1f} us between them{then}",
             "#  start_us   idle_before_us   duration_us   own_us  kernel"]
    lines += [f"{start:10.1f} {gap:16.1f} {dur:13.1f} {own:8.1f}  {name[:120]}" for start, gap, dur, own, name in rows]
    path.write_text("\n".join(lines) + "\n")
    worst = sorted(range(len(rows)), key=lambda i: rows[i][1], reverse=True)[:3]
    gaps = ", ".join(f"{rows[i][1]:.1f} us before {rows[i][4][:40]}" for i in worst if rows[i][1] > 0)
    share = 100 * idle / span if span else 0
    return f"span {span:.1f} us, GPU idle {idle:.1f} us ({share:.0f}%); largest: {gaps or '-'}{then}"


def synchronised_line(each: dict) -> str:
    """synchronised_step's figures in a line: the host's lead to the first kernel, the wait after the last, and the
    longest runtime calls."""
    if each["lead_us"] is None:
        return "no kernels"
    calls = ", ".join(f"{name[:32]} {dur:.0f} us at +{at:.0f}" for name, at, dur in each["calls"][:3])
    return (f"{each['lead_us']:.1f} us from the call to the first kernel, {each['tail_us']:.1f} us from the last "
            f"kernel's end to the synchronize's return; longest runtime calls: {calls or '-'}")


def tokens(text: str) -> int:
    """--prefill-tokens: a count, "" as 0 (none)."""
    return int(text) if text else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export", type=Path)
    p.add_argument("--model", choices=list(CONFIGS), default="llama3-8b")
    p.add_argument("--dtype", choices=("f16", "bf16"), default="f16")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--decode-batches", default="1,8", help='1,8 or 1-64 (each), or "" for none')
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--prefill-tokens", type=tokens, default=0,
                   help='a prefill phase of this many tokens too (0 or "": none, as e2e_llama.py reads "")')
    p.add_argument("--mode", default="default", help="torch.compile mode")
    p.add_argument("--stock-mode", help="torch.compile mode of the stock model (default: --mode)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", choices=("stock", "patched"), help="time this model alone (default: both)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeline", type=Path, help="write each step's kernel timeline into this folder")
    args = p.parse_args(argv)
    try:
        phases = [Phase(f"decode {b}", b, 1, args.context) for b in counts_or_none(args.decode_batches)]
    except ValueError as e:
        print(f"error: --decode-batches: {e}", file=sys.stderr)
        return 2
    if args.prefill_tokens > 0:
        phases.insert(0, Phase(f"prefill {args.prefill_tokens}", 1, args.prefill_tokens, 0))
    if not phases:
        print('error: no phase: --decode-batches is "" and --prefill-tokens 0 or ""', file=sys.stderr)
        return 2
    model, config = build_model(args.model, args.layers, args.dtype, args.device)
    models = {"stock": model}
    if args.only != "stock":
        ops = load_ops(args.export)
        models["patched"] = ours = copy.deepcopy(model)
        print(f"launch path {ops.path()}; patch {ops.patch(ours)}", flush=True)
        if args.only == "patched":
            del models["stock"]
    from torch._dynamo.utils import counters

    with torch.inference_mode():
        for phase in phases:
            torch._dynamo.reset()
            timed = {}
            for name, eager in models.items():  # every model's wall time before any profile (a profile leaves the
                counters.clear()                # CUPTI hooks that slow the launches after it: decisions `diag-order`)
                mode = (args.stock_mode or args.mode) if name == "stock" else args.mode
                compiled = torch.compile(eager, mode=None if mode == "default" else mode)
                step = make_step(compiled, eager, config, phase, args.device)
                known, t0 = loaded_modules(), time.perf_counter()
                step()
                sync(args.device)
                first = time.perf_counter() - t0
                static = static_launches(loaded_modules()[len(known):])  # the modules its compilation loaded
                workers = settle()
                stats = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
                for _ in range(3):
                    step()
                back, each = (wall_ms(step, args.steps, args.device, e) for e in (False, True))
                timed[name] = (mode, step, first, workers, stats, back, each, static)
            for name, (mode, step, first, workers, stats, back, each, static) in timed.items():
                prof = profiled(step, 5, args.device)
                guards = guard_us(models[name], step)
                print(f"\n== {phase.name} {name} ({mode}): compile {first:.0f} s; workers {workers}; wall a step "
                      f"{back:.3f} ms back to back, {each:.3f} ms synchronised; GPU kernels "
                      f"{prof['gpu_ms_a_step']:.3f} ms a step in {prof['kernels_a_step']:.0f} kernels; guards "
                      f"{'-' if guards is None else f'{guards:.1f} us'} a step; Triton kernels launched statically "
                      f"{static}; dynamo {stats}", flush=True)
                for kname, n, us in prof["top_kernels"]:
                    print(f"   gpu {us:9.1f} us {n:5.1f}x  {kname}")
                for op, n, us in prof["top_cpu"]:
                    print(f"   cpu {us:9.1f} us {n:5.1f}x  {op}")
                if args.timeline is not None:
                    where = args.timeline / f"{phase.name.replace(' ', '_')}_{name}.txt"
                    print(f"   timeline ({where.name}): "
                          f"{write_timeline(where, f'{phase.name} {name} ({mode})', prof['timeline'])}")
                    where = where.with_name(where.stem + "_synchronised.txt")
                    each = synchronised_step(step, 5, args.device, where.with_suffix(".json"))
                    print(f"   synchronised step ({where.name}): {synchronised_line(each)}; "
                          f"{write_timeline(where, f'{phase.name} {name} ({mode}), synchronised', each['timeline'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
