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

from agent import buckets
from agent.export import export_run
from agent.export.geometry import launch_table, resolve
from core.device import H200
from core.epilogue import EPILOGUES
from core.records import Problem
from templates import get_family
from tests.export_fixtures import export_folder, load_ops, small_export
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


def test_the_overlap_switch_reads_and_sets_what_later_launches_do(ops):
    was = ops.overlap()
    assert was is (os.environ.get("HGEMM_OPS_OVERLAP") != "0")
    try:
        assert ops.overlap(False) is was and ops.overlap() is False
        assert ops.overlap(True) is False and ops.overlap() is True
    finally:
        ops.overlap(was)
    with pytest.raises(TypeError):
        ops.compiled().overlap(True, False)


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
    assert ops.explain(a[1:], b) == "M=15 not tuned (tuned M: 16)"
    assert ops.explain(a[1:], b.bfloat16()) == "operands of mixed dtypes"
    assert ops.explain(a.float(), b.float()) == "dtype is neither float16 nor bfloat16"
    assert ops.explain(a, b[:4]) == "A's last dimension is not B's K"
    offset = torch.randn(16 * 8 + 1).half()[1:].view(16, 8)  # 2 bytes past an aligned start
    assert ops.explain(offset, b) == "an operand is not 16-byte aligned (tuned: 16_24_8:kn:f16)"


def test_an_export_tuned_on_another_gpu_warns_where_calls_resolve(ops, monkeypatch):
    monkeypatch.setitem(ops.MANIFEST, "device", "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    with pytest.warns(RuntimeWarning, match="tuned on NVIDIA H200, this GPU is NVIDIA H100 80GB HBM3"):
        ops._resolve()
    assert ops.tuned_elsewhere() == "NVIDIA H200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert ops.tuned_elsewhere() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ops.tuned_elsewhere() is None


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
        ext.add_kernel({k: v for k, v in entry.items() if k != "segments"})
    with pytest.raises(ValueError, match="grid and block take 3 values"):
        ext.add_kernel({**entry, "segments": [{"m": 16, "grid": [1, 1], "boxes": []}]})
    bad_map = {"operand": 1, "dims": [8, 8], "m_dims": [], "strides": [16], "swizzle": 3, "l2": 2}
    with pytest.raises(ValueError, match="one box size per dimension"):
        ext.add_kernel({**entry, "tensor_maps": [bad_map], "segments": [{"m": 16, "grid": [1, 1, 1],
                                                                          "boxes": [[8]]}]})
    with pytest.raises(ValueError, match="past the map's rank"):
        ext.add_kernel({**entry, "tensor_maps": [{**bad_map, "m_dims": [2]}]})
    r_map = {**bad_map, "operand": 3, "dims": [8, 16], "strides": [16]}  # R (3) is a map's operand; 4 is none
    with pytest.raises(ValueError, match="covers A, B, C or R"):
        ext.add_kernel({**entry, "tensor_maps": [{**r_map, "operand": 4}]})
    with pytest.raises(ValueError, match="at most 4 tensor maps"):
        ext.add_kernel({**entry, "tensor_maps": [r_map] * 5})
    with pytest.raises(ValueError, match=r"\[lo, hi\] intervals"):
        ext.add_kernel({**entry, "serves": [[9, 8]]})
    with pytest.raises(ValueError, match="segments must start at or below"):
        ext.add_kernel({**entry, "serves": [[8, 16]]})
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


# ---- dispatch by M: the interval table and the launch at every M ----------------------------------------------------
SETTINGS = [  # sm90_wgmma settings whose launches follow M differently: tiles, a persistent grid, K groups' workspace,
    # a swapped 16-row A box, multicast clusters along M and along N
    {"block_m": 16, "block_n": 128, "consumers": 2, "swap_ab": True, "stages": 6},
    {"block_m": 128, "block_n": 128, "persistent": True, "epilogue": "tma", "stages": 4},
    {"block_m": 64, "block_n": 128, "consumers": 1, "k_groups": 4, "stages": 6},
    {"block_m": 128, "block_n": 256, "cluster_m": 2, "stages": 3},
    {"block_m": 64, "block_n": 256, "consumers": 1, "cluster_n": 2, "stages": 4},
]


def range_manifest(n: int, k: int) -> tuple[dict, list[str], dict]:
    """Kernel entries for the buckets of 1-3000 of one series (four of them left to cuBLAS) and one M of its own
    inside a bucket, as the writer makes them: (kernels, cuBLAS keys, key -> (params, problem))."""
    family, series = get_family("sm90_wgmma"), Problem(1, n, k, "nk")
    problems = buckets.plan([Problem(1500, n, k, "nk", m_range=(1, 3000)), Problem(20, n, k, "nk")])
    kernels, cublas, made, claims = {}, [], {}, []
    for i, p in enumerate(problems):
        claims.append((p.key, p.m_span))
        if p.m_range and p.m_range[0] in (3, 33, 161, 1153):
            cublas.append(p.key)
            continue
        params = SETTINGS[i % len(SETTINGS)]
        kernels[p.key] = {"candidate": f"c{i}", **launch_table(family, params, p, H200)}
        made[p.key] = (params, p)
    for key, pieces in resolve(claims).items():
        if key in kernels:
            kernels[key]["serves"] = [list(q) for q in pieces]
    assert series == buckets.series(problems[0])
    return kernels, cublas, made


def test_cpp_and_python_find_the_same_kernel_and_launch_at_every_m(tmp_path, op_build_dir):
    n, k = 1024, 2048
    kernels, cublas, made = range_manifest(n, k)
    ops = load_ops(export_folder(tmp_path / "out", kernels, tuple(cublas)))
    ext = ops.compiled()
    assert ext is not None
    family, found = get_family("sm90_wgmma"), set()
    for m in range(1, 4097):
        key = ext.lookup(n, k, True, False, False, m)
        assert key == ops.INDEX.find(m, f"{n}_{k}:nk:f16"), m
        if key is None:
            assert ext.launch_at(n, k, True, False, False, m) is None
            continue
        found.add(key)
        params, bucket = made[key]
        spec = family.launch(params, Problem(m, n, k, "nk"), H200)  # the trusted rule at this very M
        grid, maps = ext.launch_at(n, k, True, False, False, m)
        assert tuple(grid) == spec.grid, (m, key)
        assert [(tuple(d), tuple(b)) for d, b in maps] == [(t.dims, t.box) for t in spec.tensor_maps], (m, key)
        py_grid, py_maps = ops.INDEX.launch_at(key, ops.MANIFEST["kernels"][key], m)
        assert py_grid == spec.grid and [(d, b) for _, d, b, *_ in py_maps] == [(t.dims, t.box)
                                                                                for t in spec.tensor_maps]
        assert spec.workspace_bytes <= kernels[key]["workspace_bytes"] and spec.counters <= kernels[key]["counters"]
    assert found == set(kernels)
    assert ext.lookup(n, k, True, False, False, 20) == "20_1024_2048:nk:f16"  # its own M inside 17-24
    assert ext.lookup(n, k, True, False, False, 19) == "17-24_1024_2048:nk:f16"
    assert ext.lookup(n, k, True, False, False, 3001) is None and ext.lookup(n, k, False, False, False, 8) is None


def test_explain_names_the_interval_or_the_cublas_bucket(tmp_path, op_build_dir):
    n, k = 512, 1024
    kernels, cublas, _ = range_manifest(n, k)
    ops = load_ops(export_folder(tmp_path / "out", kernels, tuple(cublas)))
    x, w = torch.randn(6, k).half(), torch.randn(n, k).half()
    assert ops.explain(x, w, None, "nk") == "operands are not on one CUDA device (tuned: 5-8_512_1024:nk:f16)"
    assert ops.INDEX.describe(6, f"{n}_{k}:nk:f16") == "kernel 5-8_512_1024:nk:f16 (M=6 in 5-8)"
    assert ops.INDEX.describe(19, f"{n}_{k}:nk:f16") == "kernel 17-24_512_1024:nk:f16 (M=19 in 17-19)"
    in_cublas = torch.randn(3, k).half()  # 3-4 is the third bucket: cuBLAS serves it
    assert ops.explain(in_cublas, w, None, "nk") == "M=3 is in 3-4_512_1024:nk:f16, which cuBLAS serves"
    assert ops.explain(torch.randn(3001, k).half(), w, None, "nk").startswith("M=3001 not tuned (tuned M: 1, 2, 5-8")
    out = ops.linear(in_cublas, w)  # a miss is the plain call
    assert torch.equal(out, F.linear(in_cublas, w))


def test_a_later_registration_replaces_only_the_m_it_overlaps(ops):
    ext = ops.compiled()
    base = {"file": "fake.cu", "cubin": "fake.cubin", "arch": "sm_90a", "block": [128, 1, 1], "smem_bytes": 0,
            "tensor_maps": [], "workspace_bytes": 0, "counters": 0}

    def register(key, lo, hi):
        ext.add_kernel(ops._prepared(key, {**base, "serves": [[lo, hi]],
                                           "segments": [{"m": lo, "grid": [lo, 1, 1], "boxes": []}]}))

    register("1-100_40_16:kn:f16", 1, 100)
    register("40-60_40_16:kn:f16", 40, 60)
    register("95-120_40_16:kn:f16", 95, 120)
    found = {m: ext.lookup(40, 16, False, False, False, m) for m in range(0, 130)}
    assert {m for m, key in found.items() if key == "1-100_40_16:kn:f16"} == set(range(1, 40)) | set(range(61, 95))
    assert {m for m, key in found.items() if key == "40-60_40_16:kn:f16"} == set(range(40, 61))
    assert {m for m, key in found.items() if key == "95-120_40_16:kn:f16"} == set(range(95, 121))
    assert found[0] is None and found[121] is None
    assert ext.launch_at(40, 16, False, False, False, 70) == ([1, 1, 1], [])  # its own launch, from its first M


EPILOGUE_KEYS = ["16_32_8:nk:f16:silu_mul", "16_24_8:nk:f16:residual", "16_24_8:nk:bf16:bias:gelu_tanh",
                 "16_24_8:nk:f16:gelu", "16_24_8:nk:bf16:relu2"]


def test_fused_linear_computes_the_models_composition_and_traces_as_the_op(tmp_path, op_build_dir):
    from core.epilogue import Epilogue, compose

    ops = load_ops(small_export(tmp_path / "out", SMALL + EPILOGUE_KEYS))
    ext = ops.compiled()
    assert ext is not None and set(EPILOGUE_KEYS) <= set(ext.kernels())
    x, w, r = torch.randn(2, 8, 8).half(), torch.randn(32, 8).half(), torch.randn(2, 8, 24).half()
    for name in EPILOGUES[1:]:
        res = r if name == "residual" else None
        weight = w if Epilogue(name).gated else w[:24]
        want = compose(F.linear(x, weight), Epilogue(name), res)
        for got in (ops.fused_linear(x, weight, None, name, res),
                    torch.ops.hgemm.fused_linear(x, weight, None, ops.EPILOGUE_CODES[name], res)):
            assert torch.equal(got, want), name
    # meta tensors (torch.compile's shapes): C has N / 2 columns where gated
    meta = torch.empty(5, 8, dtype=torch.half, device="meta"), torch.empty(32, 8, dtype=torch.half, device="meta")
    assert ops.fused_linear(*meta, None, "silu_mul").shape == (5, 16)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(x, w, r):
        return ops.fused_linear(x, w[:24], None, "residual", r) + ops.fused_linear(x, w, None, "silu_mul").sum()

    with torch.no_grad():
        assert torch.equal(torch.compile(f, fullgraph=True, backend=backend)(x, w, r), f(x, w, r))
    assert "hgemm.fused_linear" in " ".join(targets)
    # a wanted gradient goes through autograd: PyTorch's composition, differentiated
    wg = w[:24].clone().requires_grad_()
    ops.fused_linear(x.float(), wg.float(), None, "silu").sum().backward()
    assert wg.grad is not None


def test_a_fused_epilogue_is_a_series_of_its_own(tmp_path, op_build_dir):
    """A kernel exported for an epilogue never serves a plain call of the same N and K, nor another epilogue; the
    C++ lookup and the Python index agree."""
    ops = load_ops(small_export(tmp_path / "out", SMALL + EPILOGUE_KEYS))
    ext = ops.compiled()
    codes = ops.EPILOGUE_CODES
    assert ext.lookup(24, 8, True, False, False, 16, codes["residual"]) == "16_24_8:nk:f16:residual"
    assert ext.lookup(24, 8, True, False, False, 16) == "16_24_8:nk:f16"  # the plain kernel
    assert ext.lookup(24, 8, True, False, False, 16, codes["relu"]) is None
    assert ext.lookup(32, 8, True, False, False, 16, codes["silu_mul"]) == "16_32_8:nk:f16:silu_mul"
    assert ext.lookup(32, 8, True, False, False, 16) is None
    assert ops.INDEX.find_key("16_24_8:nk:f16:residual") == "16_24_8:nk:f16:residual"
    assert ops.INDEX.find_key("16_24_8:nk:f16:relu") is None
    x, w, r = torch.randn(16, 8).half(), torch.randn(24, 8).half(), torch.randn(16, 24).half()
    assert ops.explain(x, w, None, "nk", "residual", r) == \
        "operands are not on one CUDA device (tuned: 16_24_8:nk:f16:residual)"
    assert ops.explain(x, w, None, "nk", "residual", r[:, :8]) == \
        "the residual is not M x N (tuned: 16_24_8:nk:f16:residual)"


def test_a_fallback_runs_rows_with_an_odd_size_one_stride_as_one_matrix(tmp_path, op_build_dir):
    """torch.compile lays out a (B, 1, K) activation with any stride on its size-1 dimension; at::matmul then does not
    fold it into one matrix and runs a batched GEMM that reads the weight once a row (on the GPU: 1.5 ms for 32
    rows of Llama's gate/up). The fallback folds the rows itself: one mm, the same values."""
    from torch.profiler import profile

    from core.epilogue import Epilogue, compose

    ops = load_ops(small_export(tmp_path / "out", SMALL + EPILOGUE_KEYS))
    base = torch.randn(32, 8).half()
    x = base.as_strided((32, 1, 8), (8, 3, 1))  # size-1 middle dimension with stride 3, not 8
    assert x.is_contiguous() and torch.equal(x, base.view(32, 1, 8))
    w, r = torch.randn(32, 8).half(), torch.randn(32, 1, 24).half()
    calls = {
        "linear": (lambda: ops.linear(x, w[:24]), F.linear(base, w[:24]).view(32, 1, 24)),
        "mm": (lambda: ops.mm(x, w[:24].t()), torch.mm(base, w[:24].t()).view(32, 1, 24)),
        "silu_mul": (lambda: ops.fused_linear(x, w, None, "silu_mul"),
                     compose(F.linear(base, w), Epilogue("silu_mul"), None).view(32, 1, 16)),
        "residual": (lambda: torch.ops.hgemm.fused_linear(x, w[:24], None, ops.EPILOGUE_CODES["residual"], r),
                     compose(F.linear(base, w[:24]).view(32, 1, 24), Epilogue("residual"), r)),
        "python": (lambda: ops.fallback(x, w[:24], None, "nk"), F.linear(base, w[:24]).view(32, 1, 24)),
    }
    for name, (call, want) in calls.items():
        with profile() as prof:
            got = call()
        ran = {e.key for e in prof.key_averages()}
        assert torch.equal(got, want) and got.shape == want.shape, name
        assert "aten::bmm" not in ran and ({"aten::mm", "aten::addmm"} & ran), (name, sorted(ran))


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_norm_linear_computes_the_norm_then_the_call_and_traces_as_the_op(tmp_path, op_build_dir, kind):
    """norm_linear is fused_linear of the model's RMSNorm of x (each rounding kind), through the fast entry point,
    the registered op and the Python path alike; meta tensors get its shape, torch.compile traces it as the op, a
    wanted gradient goes through autograd, and a kind the norms do not have is refused."""
    from core.epilogue import Epilogue, compose
    from tests.export_fixtures import load_ops as load

    ops = load(small_export(tmp_path / "out", SMALL + EPILOGUE_KEYS))
    assert ops.compiled() is not None
    norms = ops._patching.fuse.recognise.RMS_NORMS
    gen = torch.Generator().manual_seed(kind)
    x, nw = torch.randn(2, 8, 8, generator=gen).half() * 3, (1 + torch.randn(8, generator=gen) / 2).half()
    w, r = torch.randn(32, 8, generator=gen).half(), torch.randn(2, 8, 24, generator=gen).half()
    normed = norms[kind](x, nw, 1e-5)
    for name in ("none", "silu_mul", "residual"):
        res = r if name == "residual" else None
        weight = w if Epilogue(name).gated else w[:24]
        want = compose(F.linear(normed, weight), Epilogue(name), res)
        for got in (ops.norm_linear(x, nw, 1e-5, kind, weight, None, name, res),
                    torch.ops.hgemm.norm_linear(x, nw, 1e-5, kind, weight, None, ops.EPILOGUE_CODES[name], res),
                    ops.PythonPath.norm_linear(x, nw, 1e-5, kind, weight, None, ops.EPILOGUE_CODES[name], res)):
            assert torch.equal(got, want), name
    meta = [torch.empty(5, 8, dtype=torch.half, device="meta") for _ in range(2)]
    assert ops.norm_linear(meta[0], nw.to("meta"), 1e-5, kind, torch.empty(32, 8, dtype=torch.half, device="meta"),
                           None, "silu_mul").shape == (5, 16)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def f(x, nw, w):
        return ops.norm_linear(x, nw, 1e-5, kind, w, None, "silu_mul")

    with torch.no_grad():
        assert torch.equal(torch.compile(f, fullgraph=True, backend=backend)(x, nw, w), f(x, nw, w))
    assert "hgemm.norm_linear" in " ".join(targets)
    wg = w[:24].float().clone().requires_grad_()
    ops.norm_linear(x.float(), nw.float(), 1e-5, kind, wg, None, "silu").sum().backward()
    assert wg.grad is not None
    with pytest.raises(ValueError, match="0, 1 or 2"):
        ops.norm_linear(x, nw, 1e-5, 3, w, None, "none")
