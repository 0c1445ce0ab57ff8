"""The export's RMSNorm kernel (runtime/hgemm_norm.cu): Llama's RMSNorm (and Gemma's, 1 + weight, and Olmo 2's) in
one kernel for a patched model's norms.
Compiled per dtype for both archs at export and shipped in the manifest; registered in the compiled op (which
refuses keys that are no helper kernel's); `rms_norm` is PyTorch's ops on the CPU and under torch.compile. On the GPU
the kernel's output against the model's eight ops, through the compiled op and the Python launch path, in a CUDA
graph too: differences only where the row's sum of squares, added in another order, moves the scale by an ulp (the
rounded x * r by one ulp, the product with the weight by up to two)."""

from __future__ import annotations

import json

import pytest
import torch

from agent.export import export_run
from agent.export.runtime.hgemm_fuse import recognise
from agent.export.writer import norm_kernels
from tests.export_fixtures import helper_ops_on_this_gpu, load_ops
from tests.helpers import populated_run

KEYS = ("rms_norm:f16", "rms_norm:bf16")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_each_dtype_compiles_for_each_arch(tmp_path, arch):
    entries = norm_kernels(tmp_path, arch)
    assert set(entries) == set(KEYS) and {e["arch"] for e in entries.values()} == {arch}
    cubins = [(tmp_path / e["cubin"]).read_bytes() for e in entries.values()]
    assert all(c.startswith(b"\x7fELF") for c in cubins) and len(set(cubins)) == 2


def test_an_export_ships_them_and_the_cpu_computes_the_models_ops(tmp_path, op_build_dir):
    export_run(populated_run(tmp_path / "r"), tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert set(manifest["norm"]) == set(KEYS) and (tmp_path / "out" / "hgemm_norm.cu").is_file()
    ops = load_ops(tmp_path / "out")
    assert ops.compiled() is not None, "the C++ extension did not build (see the warning)"
    x, w = torch.randn(3, 64).half(), torch.randn(64).half()
    assert torch.equal(ops.rms_norm(x, w, 1e-5), recognise.llama_rms_norm(x, w, 1e-5))
    assert torch.equal(ops.rms_norm(x, w, 1e-5, 1), recognise.gemma_rms_norm(x, w, 1e-5))
    assert torch.equal(ops.rms_norm(x, w, 1e-5, 2), recognise.weight_fp32_rms_norm(x, w, 1e-5))
    r = torch.randn(3, 64).half()
    assert torch.equal(ops.rms_norm(x, w, 1e-5, 1, r), r + recognise.gemma_rms_norm(x, w, 1e-5))
    compiled = torch.compile(lambda x, w: ops.rms_norm(x, w, 1e-5), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, w), recognise.llama_rms_norm(x, w, 1e-5))
    # the Python launch path knows both sections' kernels, and leaves CPU tensors to PyTorch
    assert set(ops._helpers.entries) == set(KEYS) | set(manifest["gated"])
    assert ops.PythonPath.rms_norm(x, w, 1e-5) is None


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place, from the integer views of finite values of one sign."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [True, False])
def test_on_the_gpu_it_is_the_models_norm_within_two_ulps(tmp_path, op_build_dir, monkeypatch, compiled):
    ops = helper_ops_on_this_gpu(tmp_path / "out", "norm", compiled, monkeypatch)
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for shape in ((1, 4096), (5, 3584), (2, 1024, 4096), (7, 40), (3, 36)):  # 36: no kernel (h % 8), the ops
            x = torch.randn(*shape, device="cuda", dtype=dtype) * 3
            w = 1 + 0.2 * torch.randn(shape[-1], device="cuda", dtype=dtype)
            r = torch.randn_like(x)
            for kind, residual in ((0, None), (1, None), (2, None), (1, r), (0, r)):  # each rounding, + residual
                norm = recognise.RMS_NORMS[kind](x, w, 1e-5)
                want = norm if residual is None else residual + norm
                got = ops.rms_norm(x, w, 1e-5, kind, residual)
                assert got.shape == want.shape and got.dtype == want.dtype
                if residual is None:
                    off = ulps(got, want)
                    assert off.max() <= 2 and (off > 0).float().mean() < 0.01, (dtype, shape, off.max(), kind)
                else:  # a sum that cancels turns the norm's ulp into many of its own: bound by the addends' size
                    scale = (norm.float().abs() + residual.float().abs()) * torch.finfo(dtype).eps
                    off = (got.float() - want.float()).abs()
                    assert (off <= 2 * scale).all() and (off > 0).float().mean() < 0.01, (dtype, shape, kind)
        graph, static = torch.cuda.CUDAGraph(), torch.randn(4, 4096, device="cuda", dtype=dtype)
        w = torch.randn(4096, device="cuda", dtype=dtype)
        ops.rms_norm(static, w, 1e-6)
        with torch.cuda.graph(graph):
            out = ops.rms_norm(static, w, 1e-6)
        static.copy_(torch.randn_like(static))
        graph.replay()
        assert ulps(out, recognise.llama_rms_norm(static, w, 1e-6)).max() <= 2
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ops.rms_norm(x, w[:36].contiguous() if x.shape[-1] == 36 else w, 1e-5)
        ops.rms_norm(static, w, 1e-6)
        torch.cuda.synchronize()
    assert "hgemm" in [e.key for e in prof.key_averages()]  # the export's kernel ran, not PyTorch's eight ops


@pytest.mark.gpu
@pytest.mark.parametrize("section", ["norm", "gated"])
def test_the_exports_self_check_runs_its_helper_kernels_through_each_path(tmp_path, op_build_dir, monkeypatch,
                                                                          section):
    ops = helper_ops_on_this_gpu(tmp_path / "out", section, True, monkeypatch)
    with torch.no_grad():
        lines = ops._sibling("hgemm_selfcheck").helper_lines(ops.checked(), {"compiled": ops.compiled(),
                                                                               "python": ops.PythonPath})
    keys = ops.MANIFEST[section]
    for key in keys:
        for path in ("compiled", "python"):
            assert any(line.startswith(f"{key} ") and path in line and "FAILED" not in line for line in lines), \
                (key, path, lines)
