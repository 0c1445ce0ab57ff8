"""tools/e2e_llama.py and tools/host_overhead.py on the CPU: they import, refuse to time without a GPU, and the
end-to-end tool records a (small) Llama's prefill and decode GEMMs where transformers is installed."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.shapes import read_shapes_file
from core.records import Problem
from tests.conftest import HAS_GPU

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    """tools/<name>.py as a module, loaded once per process (a tool may register custom ops)."""
    if f"tool_{name}" in sys.modules:
        return sys.modules[f"tool_{name}"]
    spec = importlib.util.spec_from_file_location(f"tool_{name}", TOOLS / f"{name}.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU refusal")
def test_tools_import_and_refuse_to_time_without_a_gpu(tmp_path, capsys):
    assert load_tool("host_overhead").main([str(tmp_path)]) == 2
    assert load_tool("norm_bench").main([str(tmp_path)]) == 2
    assert load_tool("e2e_llama").main(["--model", "tiny", "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_norm_bench_times_the_kernels_with_a_norm_variant_at_their_lowest_m():
    manifest = {"kernels": {"1_6144_4096:nk:f16": {"norm_cubin": "a"}, "2-4_4096_4096:nk:bf16:residual":
                            {"norm_cubin": "b"}, "1_4096_14336:nk:f16:residual": {}, "1_64_64:nk:f16:bias:silu_mul":
                            {"norm_cubin": "c"}}}
    assert load_tool("norm_bench").problems(manifest) == [
        ("1_6144_4096:nk:f16", 1, 6144, 4096, "f16", False, "none"),
        ("2-4_4096_4096:nk:bf16:residual", 2, 4096, 4096, "bf16", False, "residual"),
        ("1_64_64:nk:f16:bias:silu_mul", 1, 64, 64, "f16", True, "silu_mul")]


def test_e2e_records_the_patched_models_problems_at_prefill_and_decode(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.delenv("OUT", raising=False)
    e2e = load_tool("e2e_llama")
    assert e2e.main(["--record-only", "--model", "tiny", "--device", "cpu", "--layers", "2", "--prefill-tokens", "32",
                     "--decode-batches", "1,4", "--context", "8", "--work", str(tmp_path)]) == 0
    decode4 = read_shapes_file(tmp_path / "shapes_decode4.txt")
    hidden, inter, kv, vocab = 256, 512, 64, 1024  # the tiny config: 8 heads of 32, 2 KV heads
    assert set(decode4) == {Problem(4, hidden + 2 * kv, hidden, "nk"),  # q/k/v as one GEMM
                            Problem(4, hidden, hidden, "nk", epilogue="residual"),  # o_proj + residual
                            Problem(4, 2 * inter, hidden, "nk", epilogue="silu_mul"),  # gate/up
                            Problem(4, hidden, inter, "nk", epilogue="residual"),  # down_proj + residual
                            Problem(4, vocab, hidden, "nk")}  # lm_head (last position)
    assert Problem(32, 2 * inter, hidden, "nk", epilogue="silu_mul") in read_shapes_file(
        tmp_path / "shapes_prefill.txt")
    union = read_shapes_file(tmp_path / "shapes_all.txt")
    assert len(union) == len(set(union)) and set(decode4) <= set(union)


def test_with_ranges_each_problem_is_recorded_once_over_the_m_its_phases_run(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.delenv("OUT", raising=False)
    e2e = load_tool("e2e_llama")
    assert e2e.main(["--record-only", "--model", "tiny", "--device", "cpu", "--layers", "1", "--prefill-tokens",
                     "40", "--decode-batches", "1-3", "--context", "8", "--ranges", "--work", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes_all.txt"]
    union = read_shapes_file(tmp_path / "shapes_all.txt")
    hidden, inter, vocab = 256, 512, 1024
    assert Problem(21, 2 * inter, hidden, "nk", epilogue="silu_mul", m_range=(1, 40)) in union  # M: the middle
    assert Problem(2, vocab, hidden, "nk", m_range=(1, 3)) in union  # lm_head: the last position of each sequence
    assert len(union) == 5


def test_the_search_keeps_its_per_shape_table_beside_the_figures(tmp_path, monkeypatch):
    e2e = load_tool("e2e_llama")
    runs, out = tmp_path / "runs", tmp_path / "out"
    runs.mkdir(), out.mkdir()
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd[3:5])
        if cmd[3] == "run":  # the agent makes a new run directory
            (runs / f"run-{len(list(runs.iterdir()))}").mkdir()
        return subprocess.CompletedProcess(cmd, 0, stdout="shape  tried  best\n1_4096_14336 12 0.957x\n", stderr="")

    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    args = argparse.Namespace(runs_dir=runs, budget_minutes=1.0, max_candidates=4, model="llama3-8b", dtype="f16")
    assert e2e.search(tmp_path / "shapes.txt", args, out) == "run-0"
    assert calls == [["run", "--shapes"], ["show", "run-0"]]
    assert "0.957x" in (out / "search_llama3-8b_f16.txt").read_text()
    calls.clear()
    assert e2e.search(tmp_path / "shapes.txt", args) == "run-1"
    assert calls == [["run", "--shapes"]]  # without $OUT nothing is shown or written


def test_phases_every_batch_of_a_range_and_seeded_random_prefills():
    e2e = load_tool("e2e_llama")
    assert e2e.counts("1-4,8,2") == [1, 2, 3, 4, 8]
    for bad in ("", "0-3", "5-2", "5-2,3", "a", "1-b"):
        with pytest.raises(ValueError):
            e2e.counts(bad)
    args = e2e.parse_args(["--prefill-tokens", "2048", "--prefill-random", "10", "--decode-batches", "1-64"])
    phases = e2e.phases_of(args)
    prefills = [p.tokens for p in phases if p.context == 0]
    assert len(prefills) == 11 and 2048 in prefills and all(100 <= t <= 4000 for t in prefills)
    assert [p.batch for p in phases if p.context] == list(range(1, 65))
    assert phases == e2e.phases_of(args)  # the same seed draws the same lengths
    only_decode = e2e.phases_of(e2e.parse_args(["--prefill-tokens", "", "--decode-batches", "32,64"]))
    assert [(p.batch, p.context) for p in only_decode] == [(32, 512), (64, 512)]
    only_prefill = e2e.phases_of(e2e.parse_args(["--prefill-tokens", "2048", "--decode-batches", ""]))
    assert [(p.name, p.tokens, p.context) for p in only_prefill] == [("prefill", 2048, 0)]
    with pytest.raises(ValueError, match="no phase"):
        e2e.phases_of(e2e.parse_args(["--prefill-tokens", "", "--decode-batches", ""]))
    rows = [e2e.Row("decode1", "graphs", 1.0, 0.8, 1.25, 0.0, 2e-3, 3e-3),
            e2e.Row("decode2", "graphs", 1.0, 1.0, 1.0, 0.0),
            e2e.Row("prefill100", "graphs", note="failed")]
    s = e2e.summary(rows)
    assert set(s) == {"graphs decode"} and s["graphs decode"]["lowest_at"] == "decode2"
    assert s["graphs decode"]["geomean"] == pytest.approx(1.25 ** 0.5) and s["graphs decode"]["n"] == 2
    assert s["graphs decode"]["err32_ratio_max"] == pytest.approx(1.5)


def test_tables_for_the_notebook():
    e2e, host = load_tool("e2e_llama"), load_tool("host_overhead")
    rows = [e2e.Row("decode1", "eager", 3.8, 3.3, 3.8 / 3.3, 1e-3),
            e2e.Row("decode1", "compile", 3.0, 2.5, 1.2, 1e-3, 2e-3, 3e-3, compile_s=(40.0, 35.0), host_ms=(2.9, 1.1)),
            e2e.Row("decode1", "graphs", note="RuntimeError: capture failed")]
    table = e2e.markdown(rows)
    assert "| decode1 | eager | 3.800 | 3.300 | 1.152x | 1.0e-03 |  |  |  |  |" in table and "capture failed" in table
    assert ("| decode1 | compile | 3.000 | 2.500 | 1.200x | 1.0e-03 | 2.0e-03 | 3.0e-03 | 40, 35 | 2.900, 1.100, "
            "host-bound: stock |") in table
    assert all(line.count("|") == 11 for line in table.splitlines())  # every row as many cells as the header
    assert e2e.said(rows[1]).endswith("compile 40 s / 35 s; host a step 2.900 / 1.100 ms, host-bound: stock")
    assert e2e.said(rows[2]).endswith("graphs: RuntimeError: capture failed")
    assert "host" not in e2e.said(rows[0])
    # a host that takes 90% of a model's step or more to issue it: that model's wall is the host's
    bound = e2e.Row("decode1", "max-autotune", 1.712, 1.511, 1.133, 2e-3, host_ms=(1.684, 1.483))
    assert e2e.said(bound).endswith("host a step 1.684 / 1.483 ms, host-bound: both")
    assert "1.684, 1.483, host-bound: both |" in e2e.markdown([bound])
    one = dataclasses.replace(bound, ours_ms=1.9)
    assert e2e.said(one).endswith(", host-bound: stock") and "host-bound" not in e2e.said(
        dataclasses.replace(bound, host_ms=(0.817, 0.750)))
    timing = {"issue": 6.0, "sync": 30.0}
    rows = {"64_4096_4096:nk:f16": {"compiled": {"issue": 5.5, "sync": 28.0}, "dispatcher": timing,
                                    "python": timing, "torch": timing},
            "1_8_8:kn:f16": {"python": timing, "torch": timing}}  # no compiled op: its columns empty
    assert host.spread(list("abcdefg"), 3) == ["a", "d", "g"] and host.spread(list("ab"), 0) == ["a", "b"]
    table = host.markdown(rows)
    assert "| 64_4096_4096:nk:f16 | 5.50 | 6.00 | 6.00 | 6.00 | 28.00 | 30.00 | -0.50 |" in table
    assert "| 1_8_8:kn:f16 | - | - | 6.00 | 6.00 | - | 30.00 | - |" in table


def test_calls_through_the_export_are_counted_by_whether_a_kernel_ran():
    e2e = load_tool("e2e_llama")

    class Path:  # the launch path: computes
        @staticmethod
        def linear(x, w, bias=None):
            return x @ w.t()

        @staticmethod
        def norm_linear(x, norm_w, eps, kind, w, bias, epilogue, residual):
            return (x * norm_w) @ w.t()

    class Ops:  # explain() as the export answers it: one shape tuned
        _eager = Path

        class epilogue:
            EPILOGUES = ("none", "silu_mul")

        @staticmethod
        def explain(x, w, bias, layout, *epilogue):
            return "kernel 2_16_8:nk:f16" if w.shape == (16, 8) else "shape not tuned"

    x, w1, w2 = torch.randn(2, 8), torch.randn(16, 8), torch.randn(4, 16)
    assert e2e.kernel_calls(Ops, lambda: Ops._eager.linear(Ops._eager.linear(x, w1), w2)) == (1, 2)
    norm_w = torch.randn(8)
    assert e2e.kernel_calls(Ops, lambda: Ops._eager.norm_linear(x, norm_w, 1e-5, 0, w1, None, 1, None)) == (1, 1)
    assert Ops._eager is Path  # put back


def test_timing_alternates_the_order_and_drops_a_first_round(monkeypatch):
    e2e = load_tool("e2e_llama")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    e2e.timed({"ref": lambda: calls.append("ref"), "ours": lambda: calls.append("ours")}, rounds=3, inner=1)
    assert calls == ["ours", "ref", "ref", "ours", "ours", "ref", "ref", "ours"]  # round 0 is warm-up
    assert set(e2e.timed({"a": lambda: None}, rounds=4, inner=2)) == {"a"}


def test_timing_says_how_much_of_a_step_the_host_took_to_issue(monkeypatch):
    """The wall ends at the synchronize, the host's share when the last call returned: a GPU that is still busy
    after the calls shows as a wall above the host time."""
    e2e = load_tool("e2e_llama")
    import time as clock

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: clock.sleep(0.02))  # the GPU's tail after the calls
    (wall, host), = e2e.timed({"step": lambda: clock.sleep(0.01)}, rounds=2, inner=2).values()
    assert 9.0 < host < 15.0 and wall > host + 8.0


def test_the_overlap_modes_plain_step_launches_plainly_and_restores_the_switch():
    e2e = load_tool("e2e_llama")

    class Ops:  # hgemm_ops.overlap's contract: no argument reads, an argument sets and returns what it was
        on = True

        def overlap(self, enabled=None):
            was = self.on
            if enabled is not None:
                self.on = enabled
            return was

    ops, seen = Ops(), []
    step = e2e.plain_launches(ops, lambda: seen.append(ops.overlap()) or "logits")
    assert step() == "logits" and seen == [False] and ops.on is True

    def fails():
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError):
        e2e.plain_launches(ops, fails)()
    assert ops.on is True and "overlap" in e2e.MODES


def test_after_compiling_the_compile_workers_are_shut_down_and_what_was_alive_is_said(monkeypatch):
    e2e = load_tool("e2e_llama")
    from torch._inductor import async_compile

    shut = []
    monkeypatch.setattr(async_compile, "shutdown_compile_workers", lambda: shut.append(True))
    note = e2e.settle()
    assert shut == [True]
    before, after = note.split(" -> ")
    for part in (before, after):
        threads, children, load = part.split(", ")
        assert threads.endswith(" threads") and int(threads.split()[0]) >= 1
        assert children.endswith(" child processes") and int(children.split()[0]) >= 0
        assert load.startswith("load ") and float(load.split()[1]) >= -1


def test_compile_diag_times_one_model_alone_with_only(tmp_path, capsys):
    pytest.importorskip("transformers")
    from tests.export_fixtures import small_export

    diag = load_tool("compile_diag")
    common = ["--model", "tiny", "--device", "cpu", "--layers", "1", "--decode-batches", "1", "--context", "8",
              "--steps", "1"]
    assert diag.main([str(tmp_path / "none"), "--only", "stock", *common, "--timeline", str(tmp_path / "tl")]) == 0
    out = capsys.readouterr().out  # the export is never read
    assert "== decode 1 stock (default)" in out and "patched" not in out
    assert re.search(r"guards \d+\.\d us a step", out)  # the guard tree's check alone
    assert "Triton kernels launched statically -;" in out  # the CPU has no Triton kernels
    assert "timeline (decode_1_stock.txt): span" in out  # no kernels on the CPU: an empty table
    assert (tmp_path / "tl" / "decode_1_stock.txt").read_text().startswith("# decode 1 stock (default): 0 kernels")
    assert diag.main([str(small_export(tmp_path / "export", [])), "--only", "patched", *common]) == 0
    out = capsys.readouterr().out
    assert "== decode 1 patched (default)" in out and "== decode 1 stock" not in out
    # no phase at all: refused in one line, before any model is built
    for none in ("0", ""):  # "" as e2e_llama.py reads it
        assert diag.main([str(tmp_path / "none"), "--device", "cpu", "--decode-batches", "", "--prefill-tokens",
                          none]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: no phase") and err.count("\n") == 1


def test_compile_diag_times_both_models_before_profiling_either(tmp_path, capsys, monkeypatch):
    """In one process every model's wall time comes before any profile, and each model's guards are its own
    compiled entry's (both models' entries hang off the same forward)."""
    pytest.importorskip("transformers")
    from tests.export_fixtures import small_export

    diag = load_tool("compile_diag")
    order = []
    wall, profiled = diag.wall_ms, diag.profiled
    monkeypatch.setattr(diag, "wall_ms", lambda *a, **k: order.append("wall") or wall(*a, **k))
    monkeypatch.setattr(diag, "profiled", lambda *a, **k: order.append("profile") or profiled(*a, **k))
    common = ["--model", "tiny", "--device", "cpu", "--layers", "1", "--decode-batches", "1", "--context", "8",
              "--steps", "1"]
    assert diag.main([str(small_export(tmp_path / "export", [])), *common]) == 0
    assert order == ["wall"] * 4 + ["profile"] * 2  # back to back and synchronised, for each model
    out = capsys.readouterr().out
    assert out.index("== decode 1 stock (default)") < out.index("== decode 1 patched (default)")
    assert len(re.findall(r"guards \d+\.\d us a step", out)) == 2


def test_compile_diag_counts_the_triton_kernels_that_launch_statically():
    """A compiled graph's Triton kernels are CachingAutotuners in inductor's loaded modules; the static launcher
    marks its launchers `_is_static` (docs/decisions.md `short-kernel-names`)."""
    from types import ModuleType, SimpleNamespace

    import torch
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    diag = load_tool("compile_diag")

    def tuner(*launchers):
        t = CachingAutotuner.__new__(CachingAutotuner)
        t.launchers = list(launchers)
        return t

    wrapper = ModuleType("wrapper")
    wrapper.a = tuner(SimpleNamespace(_is_static=True))
    wrapper.b = tuner(SimpleNamespace())  # through Triton's launcher
    wrapper.c = tuner()  # not launched yet: not counted
    wrapper.other = 3
    assert diag.static_launches([wrapper]) == "1 of 2"
    assert diag.static_launches([ModuleType("empty")]) == diag.static_launches([]) == "-"
    known = diag.loaded_modules()  # main takes what a compilation loaded as the modules past these: inductor appends
    torch.compile(lambda x: x * 2 + 1)(torch.randn(4))
    now = diag.loaded_modules()
    assert len(now) > len(known) and now[:len(known)] == known


def test_compile_diag_timeline_takes_the_middle_step_and_sums_the_gpus_idle_time(tmp_path):
    from types import SimpleNamespace

    diag = load_tool("compile_diag")

    def kernel(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    # three steps of three kernels, given out of order; the middle step starts at 100 and idles 4 + 6 us
    steps = [[kernel(f"k{i}", base, base + 10), kernel(f"m{i}", base + 14, base + 20),
              kernel(f"n{i}", base + 26, base + 30)] for i, base in enumerate((0, 100, 200))]
    events = [e for step in reversed(steps) for e in reversed(step)]
    rows, span, idle, after = diag.step_timeline(events, 3)
    assert [r[4] for r in rows] == ["k1", "m1", "n1"]
    assert [r[0] for r in rows] == [0, 14, 26] and [r[1] for r in rows] == [0.0, 4, 6]
    assert [r[2] for r in rows] == [r[3] for r in rows] == [10, 6, 4]  # none overlapped: own time is the duration
    assert (span, idle, after) == (30, 10, 70)  # the middle step ends at 130, the next starts at 200
    line = diag.write_timeline(tmp_path / "t" / "decode_1_stock.txt", "decode 1 stock", (rows, span, idle, after))
    assert line.startswith("span 30.0 us, GPU idle 10.0 us (33%); largest: 6.0 us before n1")
    assert line.endswith("then 70.0 us idle before the next step's first kernel")
    table = (tmp_path / "t" / "decode_1_stock.txt").read_text().splitlines()
    assert table[0].startswith("# decode 1 stock: 3 kernels") and len(table) == 5
    assert diag.step_timeline([], 5) == ([], 0.0, 0.0, None)
    # a kernel launched overlapped starts 5 us before the one ahead ends and waits for it inside: its own time is
    # from that end, so the step's kernel time is its span
    overlapped = [kernel("a", 0, 10), kernel("b", 5, 30), kernel("c", 30, 32)]
    assert [own for _, own in diag.own_times(overlapped)] == [10, 20, 2]
    rows, span, idle, _ = diag.step_timeline(overlapped, 1)
    assert [r[2] for r in rows] == [10, 25, 2] and sum(r[3] for r in rows) == span == 32 and idle == 0
    assert diag.step_timeline(events[:3], 1)[3] is None  # one step: none follows


def test_compile_diag_synchronised_step_says_the_hosts_lead_and_a_wait_inside_the_step():
    from types import SimpleNamespace

    import torch

    diag = load_tool("compile_diag")
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, start, end, device=cpu):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = []
    for base in (0, 1000, 2000):  # three synchronised steps; each: 100 us to the first kernel, a wait inside
        events += [event("compile_diag_step", base, base + 700), event("cudaLaunchKernel", base + 90, base + 95),
                   event("compile_diag_step", base + 100, base + 600, cuda),  # the range on the GPU: not a kernel
                   event("k", base + 100, base + 200, cuda), event("cudaStreamSynchronize", base + 210, base + 400),
                   event("m", base + 450, base + 600, cuda), event("cudaDeviceSynchronize", base + 610, base + 690)]
    each = diag.step_in_range(events[::-1], 3)
    assert (each["lead_us"], each["tail_us"]) == (100, 100)
    rows, span, idle, _ = each["timeline"]
    assert [r[4] for r in rows] == ["k", "m"] and (span, idle) == (500, 250)
    assert [c[0] for c in each["calls"]] == ["cudaStreamSynchronize", "cudaLaunchKernel"]  # its own sync left out
    assert each["calls"][0][1:] == (210, 190)
    line = diag.synchronised_line(each)
    assert line.startswith("100.0 us from the call to the first kernel, 100.0 us from the last kernel's end")
    assert "cudaStreamSynchronize 190 us at +210" in line
    assert diag.step_in_range(events, 4)["lead_us"] is None  # fewer ranges than steps: nothing to read
    assert diag.synchronised_line(diag.step_in_range([], 0)) == "no kernels"
