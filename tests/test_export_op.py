"""The exported op's compiled part, built against this torch (CPU build here, as in CI): the ops are registered, CPU,
meta and fake tensors get what torch.matmul / F.linear give, torch.compile(fullgraph=True) traces it as the op, a
wanted gradient goes through autograd, and the routing names the tuned kernel or why a call falls back."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from agent.export import export_run
from tests.export_fixtures import load_ops, small_export
from tests.helpers import populated_run

SMALL = ["16_24_8:kn:f16", "16_24_8:nk:f16", "16_24_8:nk:bf16:bias", "16_24_8:kn:bf16:bias"]


@pytest.fixture
def ops(tmp_path, op_build_dir):
    mod = load_ops(small_export(tmp_path / "out", SMALL))
    assert mod.path() == "compiled", "the C++ extension did not build (see the warning)"
    return mod


def test_an_exported_run_registers_its_kernels(tmp_path, op_build_dir):
    export_run(populated_run(tmp_path / "r"), tmp_path / "out")
    mod = load_ops(tmp_path / "out")
    ext = mod.compiled()
    assert ext is not None and "1000_3000_2000:kn:f16" in ext.kernels()  # its tensor maps parsed and registered
    assert hasattr(torch.ops.hgemm, "mm") and hasattr(torch.ops.hgemm, "linear")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpu_tensors_get_torchs_results(ops, dtype):
    a, w, bias = torch.randn(2, 8, 8, dtype=dtype), torch.randn(24, 8, dtype=dtype), torch.randn(24, dtype=dtype)
    for linear in (ops.linear, torch.ops.hgemm.linear):
        assert torch.equal(linear(a, w), F.linear(a, w)) and torch.equal(linear(a, w, bias), F.linear(a, w, bias))
    for mm in (ops.mm, torch.ops.hgemm.mm):
        assert torch.equal(mm(a, w.t()), torch.matmul(a, w.t()))
        assert torch.equal(mm(a[0, 0], w.t()), torch.matmul(a[0, 0], w.t()))  # 1-D a, as torch.matmul takes it
        # with a bias: torch.addmm, as transformers' Conv1D calls it on the rows folded (a K x N weight)
        kn = w.t().contiguous()
        assert torch.equal(mm(a, kn, bias), torch.addmm(bias, a.view(-1, 8), kn).view(2, 8, 24))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        ops.mm(a, w)  # torch's own error for a K mismatch


def test_explain_names_the_kernel_or_the_reason(ops):
    a, b = torch.randn(16, 8).half(), torch.randn(8, 24).half()
    assert ops.explain(a, b) == "operands are not on one CUDA device (tuned: 16_24_8:kn:f16)"
    assert ops.explain(a.view(2, 8, 8), b) == "operands are not on one CUDA device (tuned: 16_24_8:kn:f16)"
    assert ops.explain(a, b.t().contiguous().t()) == "an operand is not contiguous (tuned: 16_24_8:kn:f16)"
    assert ops.explain(a, torch.randn(24, 8).half(), torch.randn(24).bfloat16(), "nk") == "operands of mixed dtypes"
    w, bias = torch.randn(24, 8).bfloat16(), torch.randn(24).bfloat16()
    assert ops.explain(a.bfloat16(), w, bias, "nk") == "operands are not on one CUDA device (tuned: " \
        "16_24_8:nk:bf16:bias)"
    assert ops.explain(a.bfloat16(), b.bfloat16(), bias, "kn") == "operands are not on one CUDA device (tuned: " \
        "16_24_8:kn:bf16:bias)"
    assert ops.explain(a.bfloat16(), b.bfloat16(), bias[:8], "kn") == "bias is not a vector of N (tuned: " \
        "16_24_8:kn:bf16:bias)"
    assert ops.explain(a.bfloat16(), w, None, "nk") == "shape not tuned"  # bf16 was tuned with a bias only
    assert ops.explain(a[1:], b) == "shape not tuned"
    assert ops.explain(a.float(), b.float()) == "dtype is neither float16 nor bfloat16"
    assert ops.explain(a, b[:4]) == "A's last dimension is not B's K"
    offset = torch.randn(16 * 8 + 1).half()[1:].view(16, 8)  # 2 bytes past an aligned start
    assert ops.explain(offset, b) == "an operand is not 16-byte aligned (tuned: 16_24_8:kn:f16)"


def test_meta_fake_and_torch_compile_see_the_op(ops):
    a, w = torch.empty(3, 5, 8, dtype=torch.half, device="meta"), torch.empty(24, 8, dtype=torch.half, device="meta")
    assert torch.ops.hgemm.linear(a, w).shape == (3, 5, 24) and ops.linear(a, w).device.type == "meta"
    with FakeTensorMode():
        out = ops.linear(torch.empty(5, 8, dtype=torch.half), torch.empty(24, 8, dtype=torch.half))
    assert isinstance(out, FakeTensor) and out.shape == (5, 24)  # the fast entry point defers to the dispatcher
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(x, w, b):
        return ops.linear(x, w, b).relu() + ops.mm(x, w.t())

    traced = torch.compile(f, fullgraph=True, backend=backend, dynamic=True)
    x, w, b = torch.randn(2, 8, 8).half(), torch.randn(24, 8).half(), torch.randn(24).half()
    with torch.no_grad():
        assert torch.equal(traced(x, w, b), f(x, w, b))
        assert torch.equal(traced(x[:1], w, b), f(x[:1], w, b))  # another M, the same graph (dynamic)
    assert "hgemm.linear" in " ".join(targets) and "hgemm.mm" in " ".join(targets)
    eager = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(eager(x, w, b), f(x, w, b))


def test_inductor_realizes_an_input_shared_by_several_calls_once(ops, monkeypatch):
    """The ops take any strides (falling back where not contiguous): inductor computes x once for q, k and v, not
    a copy of it for each call (measured: prefill under torch.compile 0.98x of the unpatched model before)."""
    assert all(torch.Tag.flexible_layout in op.default.tags for op in (torch.ops.hgemm.mm, torch.ops.hgemm.linear))
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(config, "force_disable_caches", True)  # a cached graph would hide what the ops' tags do

    w1, w2 = torch.randn(24, 8).half(), torch.randn(24, 8).half()

    def f(x):
        h = (x * x.float().pow(2).mean(-1, keepdim=True).rsqrt()).half()  # a norm, as before q/k/v projections
        return ops.linear(h, w1) + ops.linear(h, w2)

    x = torch.randn(2, 5, 8).half()
    with torch.no_grad():
        out, (code, *_) = run_and_get_code(torch.compile(f, fullgraph=True), x)
    assert torch.allclose(out.float(), f(x).float(), atol=1e-2)
    assert code.count("empty_strided_cpu((2, 5, 8)") == 1, code  # the norm's output, written once


def test_a_wanted_gradient_goes_through_autograd(ops):
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(24, 8, requires_grad=True)
    for linear in (ops.linear, torch.ops.hgemm.linear):
        x.grad = w.grad = None
        linear(x, w).square().sum().backward()
        gx, gw = x.grad, w.grad
        x.grad = w.grad = None
        F.linear(x, w).square().sum().backward()
        assert torch.allclose(gx, x.grad) and torch.allclose(gw, w.grad)
    with torch.no_grad():
        assert ops.linear(x, w).grad_fn is None and torch.ops.hgemm.linear(x, w).grad_fn is None


def test_add_kernel_refuses_a_bad_entry(ops):
    ext = ops.compiled()
    entry = ops._prepared("16_24_8:kn:f16", ops.MANIFEST["kernels"]["16_24_8:kn:f16"])
    with pytest.raises(KeyError):
        ext.add_kernel({k: v for k, v in entry.items() if k != "grid"})
    with pytest.raises(ValueError, match="grid and block take 3 values"):
        ext.add_kernel({**entry, "grid": [1, 1]})
    bad_map = {"operand": 1, "dims": [8, 8], "box": [8], "strides": [16], "swizzle": 3, "l2": 2}
    with pytest.raises(ValueError, match="one box size per dimension"):
        ext.add_kernel({**entry, "tensor_maps": [bad_map]})
    with pytest.raises(TypeError, match="positionally"):
        ext.mm(torch.randn(2, 2))


def test_without_a_compiler_the_python_path_serves_after_one_warning(tmp_path):
    folder = small_export(tmp_path / "out", SMALL)
    code = ("import hgemm_ops, torch; a, b = torch.randn(16, 8).half(), torch.randn(8, 24).half(); "
            "assert torch.equal(hgemm_ops.mm(a, b), a @ b); hgemm_ops.mm(a, b); print(hgemm_ops.path())")
    env = {**os.environ, "PATH": str(tmp_path / "no-tools"), "HGEMM_OPS_BUILD_DIR": str(tmp_path / "build")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "python", proc.stderr
    assert proc.stderr.count("the compiled op is unavailable (") == 1 and "Ninja is required" in proc.stderr
    assert "Ninja" in (tmp_path / "build" / "error.log").read_text()
