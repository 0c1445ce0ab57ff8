"""hgemm_ops.patch / unpatch on small modules (CPU), through the compiled op and through the Python path: which
layers are routed, that results do not change, that unpatch restores the model exactly, matmul=True, gradients,
and torch.compile over a patched model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.export_fixtures import load_ops, small_export

KEYS = ["16_24_8:nk:f16", "16_24_8:nk:bf16:bias", "16_24_8:kn:f16", "16_24_8:kn:f16:bias"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tuned = nn.Linear(8, 24, bias=False).half()  # (N, K) = (24, 8) f16, no bias: tuned
        self.tuned_bias = nn.Linear(8, 24).bfloat16()  # bf16 with a bias: tuned
        self.biased = nn.Linear(8, 24).half()  # f16 tuned without a bias only: not routed
        self.untuned = nn.Linear(24, 8, bias=False).half()
        self.table = nn.Parameter(torch.randn(8, 24).half())  # K x N

    def forward(self, x):  # x: (2, 8, 8) -> M = 16
        h = self.tuned(x)
        return self.untuned(h), self.tuned_bias(x.bfloat16()), self.biased(x), x @ self.table, self.tuned(x[0])


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D as GPT-2 uses it: torch.addmm(b, x, W) with W K x N (nx x nf)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class Spy:
    """Stands in for the launch path, counting calls by name and passing them on."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def mm(self, a, b, bias=None):
        self.calls.append(("mm", tuple(a.shape), bias is not None))
        return self.inner.mm(a, b, bias)

    def linear(self, x, w, bias=None):
        self.calls.append(("linear", tuple(x.shape), bias is not None))
        return self.inner.linear(x, w, bias)


@pytest.fixture(params=["compiled", "python"])
def ops(request, tmp_path, monkeypatch):
    if request.param == "python":
        monkeypatch.setenv("HGEMM_OPS_COMPILED", "0")
    else:
        request.getfixturevalue("op_build_dir")
    mod = load_ops(small_export(tmp_path / "out", KEYS))
    assert mod.path() == request.param
    return mod


def test_patch_routes_tuned_layers_and_unpatch_restores(ops):
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 8, 8).half()
    before = {name: dict(m.__dict__) for name, m in net.named_modules()}
    with torch.no_grad():
        want = net(x)
        assert ops.patch(net)["linear"] == 2 and ops.patch(net)["linear"] == 0  # patching twice changes nothing more
        assert "forward" in net.tuned.__dict__ and "forward" in net.tuned_bias.__dict__
        assert "forward" not in net.biased.__dict__ and "forward" not in net.untuned.__dict__
        spy = ops._eager = Spy(ops._eager)
        got = net(x)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # M is checked per call: the call with M = 8 goes through the op too, which falls back to F.linear itself
    assert spy.calls == [("linear", (2, 8, 8), False), ("linear", (2, 8, 8), True), ("linear", (8, 8), False)]
    assert ops.unpatch(net) == 2 and ops.unpatch(net) == 0
    assert {name: dict(m.__dict__) for name, m in net.named_modules()} == before


def test_gpt2_style_conv1d_layers_are_routed_through_mm_with_their_bias(ops):
    torch.manual_seed(2)
    tuned, untuned = Conv1D(24, 8).half(), Conv1D(8, 24).half()  # (K, N) = (8, 24) tuned with a bias; (24, 8) not
    x = torch.randn(2, 8, 8).half()
    with torch.no_grad():
        want = untuned(tuned(x))
        model = nn.Sequential(tuned, untuned)
        assert ops.patch(model)["linear"] == 1 and "forward" in tuned.__dict__ and "forward" not in untuned.__dict__
        spy = ops._eager = Spy(ops._eager)
        assert torch.equal(model(x), want)  # on the CPU the op computes addmm itself: the same bits
    assert spy.calls == [("mm", (2, 8, 8), True)]
    assert ops.unpatch(model) == 1 and "forward" not in tuned.__dict__


def test_matmul_mode_routes_addmm_with_a_bias_vector_and_functional_linear(ops):
    w, bias, x = torch.randn(8, 24).half(), torch.randn(24).half(), torch.randn(16, 8).half()
    w_nk, b16 = torch.randn(24, 8).bfloat16(), torch.randn(24).bfloat16()

    class Net(nn.Module):
        def forward(self, x):
            return (torch.addmm(bias, x, w), torch.addmm(bias, x, w, beta=2.0),  # the second: scaled, not ours
                    F.linear(x.bfloat16(), w_nk, bias=b16), F.linear(x, w.t().contiguous()))  # both tuned

    net = Net()
    with torch.no_grad():
        want = net(x)
        ops.patch(net, matmul=True)
        spy = ops._eager = Spy(ops._eager)
        got = net(x)
    assert all(torch.equal(g, v) for g, v in zip(got, want, strict=True))
    assert spy.calls == [("mm", (16, 8), True), ("linear", (16, 8), True), ("linear", (16, 8), False)]


def test_matmul_mode_and_own_forwards(ops):
    net, x = Net(), torch.randn(2, 8, 8).half()
    own = net.tuned.forward  # a forward of its own, as hooks and wrappers set: restored as it was
    net.tuned.forward = own

    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    net.custom = Custom(8, 24, bias=False).half()  # a subclass with its own forward: never routed
    with torch.no_grad():
        want = net(x)
        assert ops.patch(net, matmul=True)["linear"] == 2
        spy = ops._eager = Spy(ops._eager)
        got = net(x)
        torch.matmul(x, net.table)  # outside the model's forward: not routed
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert ("mm", (2, 8, 8), False) in spy.calls and sum(c[0] == "mm" for c in spy.calls) == 1
    assert ops.unpatch(net) == 3  # the model's wrapper and two layers
    assert net.tuned.forward is own and "forward" not in net.__dict__ and "forward" not in net.custom.__dict__


def test_a_patched_model_deleted_without_unpatch_is_freed(ops):
    net = Net()
    net.tuned.forward = net.tuned.forward  # a forward of its own, bound to the layer
    net.forward = net.forward
    assert ops.patch(net, matmul=True)["linear"] == 2
    layer, model = weakref.ref(net.tuned), weakref.ref(net)
    del net
    gc.collect()
    assert layer() is None and model() is None


def test_gradients_through_a_patched_model(ops):
    torch.manual_seed(1)
    lin = nn.Linear(8, 24, bias=False).half()
    x = torch.randn(16, 8).half()
    lin(x).float().square().sum().backward()
    want = lin.weight.grad.clone()
    lin.weight.grad = None
    ops.patch(lin)
    lin(x).float().square().sum().backward()
    assert torch.equal(lin.weight.grad, want)


def test_torch_compile_over_a_patched_model(ops):
    net, x = Net(), torch.randn(2, 8, 8).half()
    with torch.no_grad():
        want = net(x)
        ops.patch(net)
        compiled = torch.compile(net, fullgraph=True, backend="aot_eager")
        got = compiled(x)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_gpt2_records_and_routes_every_projection(tmp_path, monkeypatch):
    """Hugging Face GPT-2 (Conv1D projections with biases, a tied lm_head): its recorded shapes, exported, route
    every projection; the output is unchanged (on the CPU the op computes what PyTorch does)."""
    transformers = pytest.importorskip("transformers")
    from agent.recorder import record_gemm_shapes

    monkeypatch.setenv("HGEMM_OPS_COMPILED", "0")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).half().eval()
    ids = torch.randint(128, (2, 8))
    with torch.no_grad(), record_gemm_shapes(tmp_path / "shapes.txt") as rec:
        want = model(ids).logits
    keys = sorted(p.key for p in rec.problems)
    assert "16_192_64:kn:f16:bias" in keys and "16_64_256:kn:f16:bias" in keys  # c_attn, mlp c_proj
    ops = load_ops(small_export(tmp_path / "out", keys))
    with torch.no_grad():
        done = ops.patch(model)
        # the MLP fused (c_fc + GELU, mlp c_proj + residual), attn c_proj + residual; routed: c_attn and c_fc (whose
        # weight the fused MLP reads) per block, lm_head
        assert (done["mlp_act"], done["down_residual"], done["o_residual"], done["linear"]) == (2, 2, 2, 2 * 2 + 1)
        assert torch.allclose(model(ids).logits, want, atol=1e-2, rtol=1e-2)  # the GELU as the epilogue computes it
    assert ops.unpatch(model) == 5 + 2  # the routed layers and the two fused blocks
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_patch_fuses_decoder_layers_and_says_what_it_did(tmp_path, op_build_dir):
    from tests.test_fuse import model_and_ids

    model, ids = model_and_ids(layers=2, bias=True)
    model = model.half()
    ops = load_ops(small_export(tmp_path / "out", ["18_64_96:nk:f16:residual"]))
    with torch.no_grad():
        want = model(ids)
        done = ops.patch(model)
        assert done == {"qkv": 2, "gate_up": 2, "mlp_act": 0, "o_residual": 2, "down_residual": 2,
                        "parallel_residual": 0, "norm_residual": 0, "residual_norm": 0, "rms_norm": 5,
                        "norm_gate_up": 2, "norm_qkv": 2, "rotary": 0, "linear": 0}
        assert ops.explain_model(model)[0].startswith("layers.0: q/k/v as one GEMM")
        assert torch.allclose(model(ids).float(), want.float(), atol=2e-2, rtol=2e-2)  # PyTorch serves the CPU
    assert ops.unpatch(model) == 3 and ops.explain_model(model) == []  # two layers and the final norm
    with torch.no_grad():
        assert torch.equal(model(ids), want)


def test_patch_shortens_inductors_kernel_names_until_the_last_model_is_unpatched(ops, monkeypatch):
    """Triton's cache cuts a kernel's file names at 150 characters and inductor's static launcher looks for the whole
    name: patch makes inductor's names short where they are its default, unpatch of the last patched model puts them
    back, and a naming the user chose is left alone (docs/decisions.md `short-kernel-names`)."""
    from torch._inductor import config

    gc.collect()  # other tests' patched models, let go of
    monkeypatch.setattr(ops._patching, "_names", [])
    first, second = Net(), Net()
    with config.patch({"triton.descriptive_names": "original_aten"}):
        ops.patch(first)
        assert config.triton.descriptive_names is False
        ops.patch(second)
        ops.unpatch(first)
        assert config.triton.descriptive_names is False  # `second` is still patched
        ops.unpatch(second)
        assert config.triton.descriptive_names == "original_aten"
        ops.patch(nn.Sequential(nn.Linear(3, 5)))  # nothing tuned: nothing patched, names unchanged
        assert config.triton.descriptive_names == "original_aten"
    with config.patch({"triton.descriptive_names": "torch"}):
        ops.patch(first)
        assert config.triton.descriptive_names == "torch"
        ops.unpatch(first)
