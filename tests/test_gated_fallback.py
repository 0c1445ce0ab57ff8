"""The export's gated fallback (runtime/hgemm_gated.cu): act(gate) * up of an unserved gated call's GEMM output in
one kernel. Compiled per dtype and gated epilogue for both archs at export; registered in the compiled op; on the
GPU bit-for-bit the model's composition (PyTorch's activation, then the product, each rounding) through the compiled
op and the Python launch path alike."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from agent.export import export_run
from agent.export.writer import gated_fallbacks
from core.epilogue import Epilogue, compose
from tests.export_fixtures import helper_ops_on_this_gpu, load_ops, small_export, with_helper_kernels
from tests.helpers import populated_run

KEYS = ("silu_mul:f16", "silu_mul:bf16", "gelu_mul:f16", "gelu_mul:bf16")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_each_dtype_and_gated_epilogue_compiles_for_each_arch(tmp_path, arch):
    entries = gated_fallbacks(tmp_path, arch)
    assert set(entries) == set(KEYS) and {e["arch"] for e in entries.values()} == {arch}
    cubins = [(tmp_path / e["cubin"]).read_bytes() for e in entries.values()]
    assert all(c.startswith(b"\x7fELF") for c in cubins) and len(set(cubins)) == 4  # four different kernels


def test_an_export_ships_them_in_its_manifest(tmp_path):
    export_run(populated_run(tmp_path / "r"), tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["arch"] == "sm_90a" and set(manifest["gated"]) == set(KEYS)
    assert all((tmp_path / "out" / e["cubin"]).is_file() for e in manifest["gated"].values())
    assert (tmp_path / "out" / "hgemm_gated.cu").is_file()  # its source beside them


def test_the_compiled_op_registers_them_and_refuses_a_key_that_is_no_helper_kernels(tmp_path, op_build_dir):
    ops = load_ops(with_helper_kernels(small_export(tmp_path / "out", ["16_24_8:nk:f16"]), "gated"))
    ext = ops.compiled()
    assert ext is not None, "the C++ extension did not build (see the warning)"
    entry = {"key": "relu:f16", "arch": "sm_90a", "cubin": b"\x7fELF"}
    with pytest.raises(ValueError, match="not a helper kernel's key: relu:f16"):
        ext.add_helper(entry)
    x, w = torch.randn(5, 8).half(), torch.randn(32, 8).half()  # CPU tensors: PyTorch's composition
    assert torch.equal(ops.fused_linear(x, w, None, "silu_mul"), compose(F.linear(x, w), Epilogue("silu_mul")))


def test_an_export_missing_a_gated_cubin_still_loads_its_compiled_op(tmp_path, op_build_dir):
    folder = with_helper_kernels(small_export(tmp_path / "out", ["16_24_8:nk:f16"]), "gated")
    (folder / "hgemm_gated_silu_mul_f16.cubin").unlink()
    ops = load_ops(folder)
    assert ops.compiled() is not None and ops.path() == "compiled"


def kernels_run(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages()]


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [True, False])
def test_an_unserved_gated_call_is_the_models_composition_bit_for_bit_on_the_gpu(tmp_path, op_build_dir,
                                                                                 monkeypatch, compiled):
    ops = helper_ops_on_this_gpu(tmp_path / "out", "gated", compiled, monkeypatch)
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for epi in ("silu_mul", "gelu_mul"):
            for rows, n, k in ((1, 96, 64), (37, 4096, 256), (3 * 129, 160, 32)):
                x = torch.randn(rows, k, device="cuda", dtype=dtype)
                w = torch.randn(n, k, device="cuda", dtype=dtype) * (8 if rows == 1 else 1)  # fp16: some Inf
                want = compose(F.linear(x, w), Epilogue(epi))
                got = ops.fused_linear(x.view(1, rows, k) if rows > 100 else x, w, None, epi).view(rows, -1)
                assert got.shape == (rows, n // 2) and torch.equal(got, want), (dtype, epi, rows, n, k)
            names = kernels_run(lambda x=x, w=w, epi=epi: ops.fused_linear(x, w, None, epi))
            assert "hgemm" in names, names  # the export's gated kernel ran, not PyTorch's two ops


def test_a_gated_kernel_that_does_not_build_is_left_out_with_its_reason(tmp_path, monkeypatch):
    from agent.export import writer
    from core.records import BuildResult

    def build(source, arch, options):  # the SiLU kernels build, the GELU ones do not
        if "-DHGEMM_GELU=1" in options:
            return BuildResult("", False, arch, source, error="NVRTC refused it")
        return BuildResult("", True, arch, source, cubin=b"\x7fELF " + " ".join(options).encode())

    monkeypatch.setattr(writer, "compile_cuda", build)
    notes = {}
    entries = writer.gated_fallbacks(tmp_path, "sm_90a", notes)
    assert set(entries) == {"silu_mul:f16", "silu_mul:bf16"}
    assert all((tmp_path / e["cubin"]).is_file() for e in entries.values())
    assert notes == {f"gated gelu_mul:{d}": "the gated fallback's kernel did not build: NVRTC refused it"
                     for d in ("f16", "bf16")}
