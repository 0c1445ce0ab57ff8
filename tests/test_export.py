"""export: files per shape, the manifest, and the exported module's cuBLAS fallback (CPU-testable)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

from agent.export import export_run, recheck
from core.records import EvalJob, Problem, Timing
from tests.conftest import HAS_GPU
from tests.helpers import fake_evaluate, populated_run


def load_module(folder):
    spec = importlib.util.spec_from_file_location("hgemm_ops_under_test", folder / "hgemm_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_export_writes_kernels_and_fallbacks(tmp_path):
    store = populated_run(tmp_path / "r")
    lines = export_run(store, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert list(manifest["kernels"]) == ["1000_3000_2000:kn"] and manifest["cublas"] == ["64_64_64:nk"]
    entry = manifest["kernels"]["1000_3000_2000:kn"]
    cu = (tmp_path / "out" / entry["file"]).read_text()
    assert "extern \"C\" __global__" in cu and f"dim3{tuple(entry['grid'])}" in cu
    assert (tmp_path / "out" / entry["cubin"]).read_bytes()[:4] == b"\x7fELF"
    assert [ln.kernel_file is None for ln in lines] == [False, True]
    # a TMA kernel: the manifest and the .cu header carry the tensor maps the op encodes before each launch
    assert [t["operand"] for t in entry["tensor_maps"]][:2] == ["A", "B"]  # + C with a TMA-store epilogue
    assert entry["tensor_maps"][0]["dims"] == [2000, 1000] and "CUtensorMap over A" in cu
    assert (tmp_path / "out" / "hgemm_driver.py").is_file()


def test_export_records_the_workspace_a_k_groups_kernel_needs(tmp_path):
    def k_groups_win(job: EvalJob):
        t = 10.0 if job.params.get("k_groups", 1) > 1 else 50.0
        return dataclasses.replace(fake_evaluate(job), warm=Timing(t, t, t, 100), cold=Timing(t, t, t, 100))

    populated = populated_run(tmp_path / "r", problems=(Problem(64, 4096, 16384),), evaluate=k_groups_win)
    export_run(populated, tmp_path / "out")
    entry = json.loads((tmp_path / "out" / "manifest.json").read_text())["kernels"]["64_4096_16384:kn"]
    assert entry["workspace_bytes"] > 0 and entry["counters"] > 0  # passed after the tensor maps by the op
    cu = (tmp_path / "out" / entry["file"]).read_text()
    assert "scratch buffer" in cu
    # B (K x N, N % 64 == 0) as a view of 64-column panels: the op needs the strides to encode it
    assert entry["tensor_maps"][1]["strides"] == [8192, 128] and "byte strides (8192, 128)" in cu


def test_exported_op_falls_back_to_cublas_off_gpu(tmp_path):
    export_run(populated_run(tmp_path / "r"), tmp_path / "out")
    ops = load_module(tmp_path / "out")
    a, b = torch.randn(64, 64).half(), torch.randn(64, 64).half()
    assert torch.equal(ops.linear(a, b), torch.matmul(a, b.t()))
    ops.MANIFEST["kernels"]["16_24_8:kn"] = ops.MANIFEST["kernels"]["1000_3000_2000:kn"]  # small, for the CPU
    x, w = torch.randn(16, 8).half(), torch.randn(8, 24).half()
    assert torch.equal(ops.mm(x, w), torch.matmul(x, w))  # CPU tensors: the kernel is not usable, cuBLAS path
    assert ops.driver.TENSOR_MAP_BYTES == 128  # the copied driver module loaded beside it


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_recheck_without_gpu_says_so(tmp_path):
    export_run(populated_run(tmp_path / "r"), tmp_path / "out")
    status, text = recheck(tmp_path / "out")
    assert status == "no-gpu" and "not re-checked" in text


@pytest.mark.gpu
def test_exported_tma_kernel_rechecks_on_the_gpu(tmp_path):
    out = tmp_path / "out"
    export_run(populated_run(tmp_path / "r"), out)
    assert json.loads((out / "manifest.json").read_text())["kernels"]["1000_3000_2000:kn"]["tensor_maps"]
    status, text = recheck(out)
    assert status == "ok", text
