"""export: files per problem, the manifest, the launch rule for the run's GPU, and the exported module's Python
launch path and cuBLAS fallback (CPU-testable; the compiled op is tests/test_export_op.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import agent.export.writer as writer
from agent import buckets
from agent.export import export_run, recheck
from core.device import H200
from core.epilogue import EPILOGUES
from core.records import EvalJob, Problem, Timing
from tests.conftest import HAS_GPU
from tests.export_fixtures import load_ops
from tests.helpers import fake_evaluate, m_dependent_evaluate, populated_run

RUNTIME_FILES = {"hgemm_ops.py", "hgemm_op.cpp", "hgemm_library.cpp", "hgemm_route.cpp", "hgemm_gated.cu",
                 "hgemm_op.h", "hgemm_module.cpp", "hgemm_cuda.h", "hgemm_build.py", "hgemm_selfcheck.py",
                 "hgemm_driver.py"}


def test_export_writes_kernels_and_fallbacks(tmp_path):
    store = populated_run(tmp_path / "r")
    lines = export_run(store, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert list(manifest["kernels"]) == ["1000_3000_2000:kn:f16"] and manifest["cublas"] == ["64_64_64:nk:f16"]
    entry = manifest["kernels"]["1000_3000_2000:kn:f16"]
    cu = (tmp_path / "out" / entry["file"]).read_text()
    assert entry["file"] == "hgemm_1000_3000_2000_kn_f16.cu"
    assert "extern \"C\" __global__" in cu and f"dim3{tuple(entry['grid'])}" in cu and "fp16 in" in cu
    assert (tmp_path / "out" / entry["cubin"]).read_bytes()[:4] == b"\x7fELF"
    assert [ln.kernel_file is None for ln in lines] == [False, True]
    # a TMA kernel: the manifest and the .cu header carry the tensor maps the op encodes before each launch
    assert [t["operand"] for t in entry["tensor_maps"]][:2] == ["A", "B"]  # + C with a TMA-store epilogue
    assert entry["tensor_maps"][0]["dims"] == [2000, 1000] and "CUtensorMap over A" in cu
    assert RUNTIME_FILES <= {p.name for p in (tmp_path / "out").iterdir()}


def test_export_uses_the_winner_and_the_runs_gpu(tmp_path, monkeypatch):
    store = populated_run(tmp_path / "r")
    small = dataclasses.replace(H200, name="Half H200", sms=66)
    store.set_meta("device", small.to_dict())
    seen = []
    real = writer.get_family

    class Spy:
        def __init__(self, fam):
            self.fam = fam

        def launch(self, params, problem, device):
            seen.append((params, problem, device))
            return self.fam.launch(params, problem, device)

        def __getattr__(self, name):
            return getattr(self.fam, name)

    monkeypatch.setattr(writer, "get_family", lambda name: Spy(real(name)))
    export_run(store, tmp_path / "out")
    win = store.winner(Problem(1000, 3000, 2000))
    # at the problem's M, and at the next (which dimensions follow M)
    assert seen == [(win.candidate.params, Problem(m, 3000, 2000), small) for m in (1000, 1001)]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["device"] == "Half H200" and manifest["kernels"]["1000_3000_2000:kn:f16"]["candidate"] == \
        win.candidate.id


def gemv_wins(job: EvalJob):
    """Up to M = 4 only gemv beats cuBLAS (30 us); above it every kernel does."""
    t = 10.0 if job.family == "gemv" or job.problem.m > 4 else 100.0
    if job.honest_only:
        return dataclasses.replace(fake_evaluate(job), honest=Timing(t, t, t, 100))
    return dataclasses.replace(fake_evaluate(job), warm=Timing(t, t, t, 100), cold=Timing(t * 1.1, t, t * 1.2, 100))


def test_a_gemv_winner_is_exported_with_its_norm_variant_and_a_tile_winner_without(tmp_path):
    """By default gemv's winners get the same source built with -DHGEMM_NORM (hgemm::norm_linear's kernel);
    others do not, nor any without it."""
    problems = (Problem(1, 64, 64, "nk"), Problem(1000, 3000, 2000))
    store = populated_run(tmp_path / "r", problems=problems, n=12, evaluate=gemv_wins)
    export_run(store, tmp_path / "plain", norm_variants=False)
    assert not any("norm_cubin" in e for e in json.loads((tmp_path / "plain" / "manifest.json").read_text())[
        "kernels"].values())  # only where asked
    export_run(store, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    gemv, tiled = manifest["kernels"]["1_64_64:nk:f16"], manifest["kernels"]["1000_3000_2000:kn:f16"]
    assert gemv["norm_cubin"] == "hgemm_1_64_64_nk_f16_norm.cubin" and "norm_cubin" not in tiled
    normed, plain = ((tmp_path / "out" / gemv[k]).read_bytes() for k in ("norm_cubin", "cubin"))
    assert normed[:4] == b"\x7fELF" and normed != plain


def test_a_norm_variant_that_would_hold_fewer_warps_an_sm_is_left_out_with_why(tmp_path, monkeypatch):
    store = populated_run(tmp_path / "r", problems=(Problem(1, 64, 64, "nk"),), n=12, evaluate=gemv_wins)
    monkeypatch.setattr(writer, "NORM_OCCUPANCY", 100.0)  # no variant can keep that many
    export_run(store, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert "norm_cubin" not in manifest["kernels"]["1_64_64:nk:f16"]
    assert manifest["notes"]["norm 1_64_64:nk:f16"].startswith("no norm variant: ")
    assert not (tmp_path / "out" / "hgemm_1_64_64_nk_f16_norm.cubin").exists()
    compile_cuda = writer.compile_cuda  # without ptxas's counts the variant is built
    monkeypatch.setattr(writer, "compile_cuda", lambda *a, **k: dataclasses.replace(compile_cuda(*a, **k),
                                                                                     registers=None))
    export_run(store, tmp_path / "unknown")
    assert "norm_cubin" in json.loads((tmp_path / "unknown" / "manifest.json").read_text())["kernels"][
        "1_64_64:nk:f16"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_a_norm_variant_computes_the_models_norm_then_the_call_on_the_gpu(tmp_path, op_build_dir, dtype):
    """gemv's norm variants (three epilogues, each rounding kind of the norm, the compiled op and the Python path)
    through the export's selfcheck: within twice cuBLAS's error on the model's norm output. None at M = 4 (a block
    of 4 rows of A)."""
    problems = (Problem(1, 256, 512, "nk", dtype), Problem(1, 512, 512, "nk", dtype, False, "silu_mul"),
                Problem(1, 256, 512, "nk", dtype, False, "residual"), Problem(4, 256, 512, "nk", dtype))
    export_run(populated_run(tmp_path / "r", problems=problems, n=12, evaluate=gemv_wins), tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {k for k, e in manifest["kernels"].items() if "norm_cubin" in e} == {p.key for p in problems[:3]}
    assert len(manifest["kernels"]) == 4
    lines = load_ops(tmp_path / "out").selfcheck()
    normed = [ln for ln in lines if "the norm (kind" in ln]
    assert len(normed) == 3 * 3 * 2 and all(": ok" in ln for ln in normed), "\n".join(normed)


def test_export_records_the_workspace_a_k_groups_kernel_needs(tmp_path):
    def k_groups_win(job: EvalJob):
        t = Timing(*(3 * [10.0 if job.params.get("k_groups", 1) > 1 else 50.0]), 100)
        r = fake_evaluate(job)
        return dataclasses.replace(r, honest=t) if job.honest_only else dataclasses.replace(r, warm=t, cold=t)

    populated = populated_run(tmp_path / "r", problems=(Problem(64, 4096, 16384),), evaluate=k_groups_win)
    export_run(populated, tmp_path / "out")
    entry = json.loads((tmp_path / "out" / "manifest.json").read_text())["kernels"]["64_4096_16384:kn:f16"]
    assert entry["workspace_bytes"] > 0 and entry["counters"] > 0  # passed after the tensor maps by the op
    cu = (tmp_path / "out" / entry["file"]).read_text()
    assert "scratch buffer" in cu
    # B (K x N, N % 64 == 0) as a view of 64-column panels: the op needs the strides to encode it
    assert entry["tensor_maps"][1]["strides"] == [8192, 128] and "byte strides (8192, 128)" in cu


def test_python_path_falls_back_to_cublas_off_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("HGEMM_OPS_COMPILED", "0")
    export_run(populated_run(tmp_path / "r"), tmp_path / "out")
    ops = load_ops(tmp_path / "out")
    assert ops.path() == "python" and ops.compiled() is None
    a, b, bias = torch.randn(64, 64).half(), torch.randn(64, 64).half(), torch.randn(64).half()
    assert torch.equal(ops.linear(a, b), F.linear(a, b)) and torch.equal(ops.linear(a, b, bias), F.linear(a, b, bias))
    entry = {**ops.MANIFEST["kernels"]["1000_3000_2000:kn:f16"], "serves": [[16, 16]]}
    ops.MANIFEST["kernels"]["16_24_8:kn:f16"] = entry  # CPU-sized
    ops.INDEX = ops.intervals.Index(ops.MANIFEST)
    x, w = torch.randn(2, 8, 8).half(), torch.randn(8, 24).half()
    assert ops.problem_key(x, w, None, "kn") == "16_24_8:kn:f16"  # leading dims fold into M
    assert ops.INDEX.find_key("16_24_8:kn:f16") == "16_24_8:kn:f16"
    ops.MANIFEST["kernels"]["8_24_8:kn:f16:bias:silu_mul"] = {**entry, "serves": [[8, 8]]}  # a fused epilogue
    ops.INDEX = ops.intervals.Index(ops.MANIFEST)
    assert ops.INDEX.find_key("8_24_8:kn:f16:bias") is None  # serves only calls that name the same epilogue
    assert ops.INDEX.find_key("8_24_8:kn:f16:bias:silu_mul") == "8_24_8:kn:f16:bias:silu_mul"
    assert torch.equal(ops.mm(x, w), torch.matmul(x, w))  # CPU tensors: the kernel is not usable, cuBLAS path
    assert ops.driver.TENSOR_MAP_BYTES == 128  # the copied driver module loaded beside it


def test_problem_keys_of_calls(tmp_path, monkeypatch):
    monkeypatch.setenv("HGEMM_OPS_COMPILED", "0")
    export_run(populated_run(tmp_path / "r"), tmp_path / "out")
    ops = load_ops(tmp_path / "out")
    x, w = torch.randn(3, 5, 16, dtype=torch.bfloat16), torch.randn(24, 16, dtype=torch.bfloat16)
    assert ops.problem_key(x, w, torch.zeros(24), "nk") == "15_24_16:nk:bf16:bias"
    assert ops.problem_key(x.float(), w.float(), None, "nk") is None
    assert ops.problem_key(x, w, None, "kn") is None  # K does not match
    assert ops.parse_key("15_24_16:nk:bf16:bias") == (15, 24, 16, "nk", "bf16", True, "none")
    assert ops.parse_key("9-16_24_16:kn:f16") == (9, 24, 16, "kn", "f16", False, "none")  # a bucket: its lowest M
    assert ops.parse_key("8_32_16:nk:f16:bias:silu_mul") == (8, 32, 16, "nk", "f16", True, "silu_mul")
    assert ops.problem_key(x, w, None, "nk", "residual") == "15_24_16:nk:bf16:residual"
    # the compiled op numbers the epilogues as core/epilogue.py lists them (hgemm_op.h's enum)
    header = (tmp_path / "out" / "hgemm_op.h").read_text()
    enum = header.split("enum Epilogue : int {")[1].split("}")[0]
    camel = ["k" + "".join(w.capitalize() for w in name.split("_")) for name in EPILOGUES]
    assert [e.split("=")[0].strip() for e in enum.split(",")] == [*camel, "kEpilogues"]
    assert list(ops.EPILOGUE_CODES) == list(EPILOGUES)


def test_export_serves_the_buckets_where_they_are_as_fast_as_cublas(tmp_path, monkeypatch):
    """A range 1-48 and one M inside it, searched with kernels that beat cuBLAS only from M = 20 up: the buckets
    served at every probe M and the single M get kernels with their intervals and launches at every M; bucket 17-24
    (slower at its probes 17 and 19) serves its stretch 21-24, cuBLAS 17-19; the rest cuBLAS, each with its reason;
    the exported module finds the kernel for any M by its interval."""
    monkeypatch.setenv("HGEMM_OPS_COMPILED", "0")
    problems = buckets.plan([Problem(24, 256, 512, "nk", m_range=(1, 48)), Problem(20, 256, 512, "nk")])
    store = populated_run(tmp_path / "r", problems=tuple(problems), n=4, evaluate=m_dependent_evaluate)
    lines = export_run(store, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert set(manifest["kernels"]) == {"17-24_256_512:nk:f16", "25-32_256_512:nk:f16", "33-48_256_512:nk:f16",
                                        "20_256_512:nk:f16"}
    assert manifest["kernels"]["17-24_256_512:nk:f16"]["serves"] == [[21, 24]]
    assert manifest["notes"]["17-24_256_512:nk:f16"].endswith("; serves M 21-24, cuBLAS the rest")
    assert manifest["notes"]["1-1_256_512:nk:f16"] == ("no leader was at least as fast as cuBLAS at two "
                                                       "neighbouring probe M of the bucket")
    entry = manifest["kernels"]["25-32_256_512:nk:f16"]
    assert entry["m_range"] == [25, 32] and entry["serves"] == [[25, 32]] and entry["segments"][0]["m"] == 25
    assert manifest["kernels"]["20_256_512:nk:f16"]["serves"] == [[20, 20]]
    served = buckets.served(store, problems[6])
    assert entry["candidate"] == served.candidate.id and manifest["notes"]["25-32_256_512:nk:f16"] == \
        f"vs cuBLAS {served.note(problems[6])}"
    assert "serves every M from 25 to 32" in (tmp_path / "out" / entry["file"]).read_text()
    part = manifest["kernels"]["17-24_256_512:nk:f16"]["file"]
    assert "serves M 21-24 of the bucket 17-24 (cuBLAS the rest)" in (tmp_path / "out" / part).read_text()
    assert [ln.problem for ln in lines] == problems and sum(ln.kernel_file is not None for ln in lines) == 4
    ops = load_ops(tmp_path / "out")
    series = "256_512:nk:f16"
    found = {m: ops.INDEX.find(m, series) for m in range(1, 50)}
    assert {m for m, key in found.items() if key} == set(range(20, 49))
    assert found[20] == "20_256_512:nk:f16" and found[21] == found[24] == "17-24_256_512:nk:f16"
    x, w = torch.randn(30, 512).half(), torch.randn(256, 512).half()
    assert ops.explain(x, w, None, "nk") == ("the compiled op is unavailable; the manifest says: kernel "
                                             "25-32_256_512:nk:f16 (M=30 in 25-32)")
    assert ops.explain(x[:17], w, None, "nk").endswith("M=17 is in 17-24_256_512:nk:f16, which cuBLAS serves")
    assert torch.equal(ops.linear(x, w), F.linear(x, w))  # CPU tensors: the kernel is not usable here


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_recheck_without_gpu_says_so(tmp_path):
    export_run(populated_run(tmp_path / "r"), tmp_path / "out")
    status, text = recheck(tmp_path / "out")
    assert status == "no-gpu" and "not re-checked" in text


@pytest.mark.gpu
def test_exported_tma_kernel_rechecks_on_the_gpu(tmp_path):
    out = tmp_path / "out"
    export_run(populated_run(tmp_path / "r"), out)
    assert json.loads((out / "manifest.json").read_text())["kernels"]["1000_3000_2000:kn:f16"]["tensor_maps"]
    status, text = recheck(out)
    assert status == "ok", text
    assert "compiled op: built and loaded" in text and "first call inside a CUDA-graph capture: ok" in text


@pytest.mark.gpu
def test_a_bucketed_export_is_right_at_every_m_it_serves_on_the_gpu(tmp_path, op_build_dir):
    """Real kernels of buckets of 1-200 (timings faked so that M from 20 up are faster: served from 21, the probe
    after 19 in bucket 17-24): the export's
    self-check passes at each interval's ends and inside, and every M 1-200 through the compiled op and the Python
    path gives cuBLAS's accuracy, the served ones by their bucket's kernel."""
    def tma_first(job: EvalJob):  # TMA kernels lead, so that tensor maps follow M in the export
        r = m_dependent_evaluate(job)
        if job.family == "sm90_wgmma" and job.params.get("loader", "tma") == "tma":
            return r
        return dataclasses.replace(r, warm=Timing(50.0, 50.0, 50.0, 100))

    problems = buckets.plan([Problem(100, 256, 512, "nk", m_range=(1, 200))])
    store = populated_run(tmp_path / "r", problems=tuple(problems), n=4, evaluate=tma_first)
    out = tmp_path / "out"
    export_run(store, out)
    kernels = json.loads((out / "manifest.json").read_text())["kernels"]
    assert kernels and all(e["tensor_maps"] and e["tensor_maps"][0]["m_dims"] == [1] for e in kernels.values())
    status, text = recheck(out)
    assert status == "ok", text
    ops = load_ops(out)
    assert ops.path() == "compiled"
    w = torch.randn(256, 512, device="cuda").half()
    with torch.no_grad():
        for m in range(1, 201):
            a = torch.randn(m, 512, device="cuda").half()
            ref = a.double() @ w.double().t()
            cub = torch.linalg.norm(F.linear(a, w).double() - ref) / torch.linalg.norm(ref)
            why = ops.explain(a, w, None, "nk")
            assert why.startswith("kernel ") == (m >= 21), (m, why)  # bucket 17-24 serves its stretch 21-24
            for path in (ops.compiled(), ops.PythonPath):
                got = path.linear(a, w, None)
                torch.cuda.synchronize()
                err = torch.linalg.norm(got.double() - ref) / torch.linalg.norm(ref)
                assert got.shape == (m, 256) and err <= 2 * cub + 1e-6, (m, path, why, float(err), float(cub))
