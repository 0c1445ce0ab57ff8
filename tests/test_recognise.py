"""Modules recognised by what they compute (agent/export/runtime/hgemm_recognise.py), here BERT's blocks: q/k/v by
any of their usual names, a Linear and its activation, and a Linear whose output is added to a residual before a
norm (or without one); fused, an encoder's output matches the unfused one's and `unfuse` puts it back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agent.export.runtime import hgemm_fuse
from tests.test_fuse import MLP, MatmulRotary, RMSNorm, TorchOps, compiles_whole

recognise = hgemm_fuse.recognise


class SelfAttention(nn.Module):
    """BERT's names: query, key, value (T5's: q, k, v)."""

    def __init__(self, hidden: int, names=("query", "key", "value"), bias=True):
        super().__init__()
        self.names = names
        for n in names:
            setattr(self, n, nn.Linear(hidden, hidden, bias=bias))

    def forward(self, x):
        q, k, v = (getattr(self, n)(x).unflatten(-1, (4, -1)).transpose(1, 2) for n in self.names)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)


class Output(nn.Module):
    """BERT's output blocks: LayerNorm(dropout(dense(h)) + r); `norm=False`: a pre-norm BERT's, dense(h) + r."""

    def __init__(self, inner: int, hidden: int, norm: bool = True, p: float = 0.0):
        super().__init__()
        self.dense, self.dropout = nn.Linear(inner, hidden), nn.Dropout(p)
        if norm:
            self.LayerNorm = nn.LayerNorm(hidden)

    def forward(self, hidden_states, input_tensor):
        h = self.dropout(self.dense(hidden_states)) + input_tensor
        return self.LayerNorm(h) if hasattr(self, "LayerNorm") else h


class Intermediate(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.dense, self.intermediate_act_fn = nn.Linear(hidden, inner), nn.GELU()

    def forward(self, x):
        return self.intermediate_act_fn(self.dense(x))


class EncoderLayer(nn.Module):
    def __init__(self, hidden=64, inner=128, names=("query", "key", "value"), norm=True, p=0.0):
        super().__init__()
        self.self_attn_block = SelfAttention(hidden, names)
        self.attention_output = Output(hidden, hidden, norm, p)
        self.intermediate, self.output = Intermediate(hidden, inner), Output(inner, hidden, norm, p)

    def forward(self, x):
        h = self.attention_output(self.self_attn_block(x), x)
        return self.output(self.intermediate(h), h)


@pytest.mark.parametrize("names, norm", [(("query", "key", "value"), True), (("q", "k", "v"), False)])
def test_an_encoder_layer_fuses_its_qkv_its_activation_and_its_residual_adds(names, norm):
    torch.manual_seed(0)
    model, x = nn.Sequential(EncoderLayer(names=names, norm=norm), EncoderLayer(names=names, norm=norm)).eval(), \
        torch.randn(2, 7, 64)
    with torch.no_grad():
        ref = model(x)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert recognise.qkv_names(model[0].self_attn_block) == names
    assert recognise.residual_norm(model[0].output) == ("dense", "LayerNorm" if norm else None)
    assert recognise.plain_mlp(model[0].intermediate, hgemm_fuse._epilogue_module(TorchOps), single=True) == (
        "dense", None, "gelu", False)
    assert recognise.plain_mlp(model[0].intermediate, hgemm_fuse._epilogue_module(TorchOps)) is None  # two Linears
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert (counts["qkv"], counts["mlp_act"], counts["residual_norm"]) == (2, 2, 4)
    TorchOps.calls = []
    with torch.no_grad():
        out = model(x)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    # a layer: q/k/v, the attention's output + x, the intermediate's GEMM and GELU, the output's GEMM + h
    assert [c[0] for c in TorchOps.calls] == ["none", "residual", "gelu", "residual"] * 2
    with torch.no_grad():  # each block as it computes, bit for bit (its residual added once, before its norm)
        h = torch.randn(2, 7, 128)
        assert torch.equal(model[0].output(h, x), Output.forward(model[0].output, h, x))
    assert "the residual add (before a norm) in the GEMM" in "; ".join(hgemm_fuse.describe(model))
    assert hgemm_fuse.unfuse(model) == 8
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(x), ref)


class NormThenAdd(Output):
    def forward(self, hidden_states, input_tensor):  # the residual after the norm
        return self.LayerNorm(self.dense(hidden_states)) + input_tensor


class ScaledResidual(Output):
    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + 0.5 * input_tensor)


class Projection(nn.Module):
    """A Linear and a norm, one input: no residual."""

    def __init__(self):
        super().__init__()
        self.dense, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.dense(x))


def test_what_does_not_add_its_residual_before_its_norm_stays_as_it_is():
    for block in (NormThenAdd(64, 64), ScaledResidual(64, 64), Projection()):
        assert recognise.residual_norm(block) is None, type(block).__name__
        assert hgemm_fuse.fuse(block, TorchOps)["residual_norm"] == 0
        hgemm_fuse.unfuse(block)
    two = SelfAttention(64, names=("query", "key", "values"))  # no third name of a set
    assert recognise.qkv_names(two) is None


def test_an_output_block_with_a_dropout_runs_its_own_forward_in_training_mode():
    block, h, x = Output(64, 64, p=0.5), torch.randn(3, 64), torch.randn(3, 64)
    assert hgemm_fuse.fuse(block.eval(), TorchOps)["residual_norm"] == 1
    block.train()
    TorchOps.calls = []
    with torch.no_grad():
        block(h, input_tensor=x)  # by keyword too
    assert TorchOps.calls == []
    block.eval()
    with torch.no_grad():
        assert torch.equal(block(h, input_tensor=x), Output.forward(block, h, x))
    assert TorchOps.calls == [("residual", (64, 64))]
    hgemm_fuse.unfuse(block)


def test_a_fused_encoder_compiles_whole():
    torch.manual_seed(0)
    compiles_whole(nn.Sequential(EncoderLayer(), EncoderLayer()).eval(), torch.randn(2, 7, 64))


class Conv1D(nn.Module):
    """transformers' Conv1D, as it is written there: a weight K x N, x @ W + b by addmm."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight, self.bias = nn.Parameter(torch.randn(nx, nf) * 0.1), nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


def test_a_gpt2_mlp_of_conv1d_layers_fuses_with_its_weights_stored_once_as_n_by_k():
    class GPT2MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.c_proj, self.act = Conv1D(128, 64), Conv1D(64, 128), nn.GELU(approximate="tanh")

        def forward(self, x):
            return self.c_proj(self.act(self.c_fc(x)))

    class PairAttention(SelfAttention):
        def forward(self, x):
            return super().forward(x), None

    class Block(nn.Module):  # GPT-2's steps and names: ln_1, attn, ln_2, mlp
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(64), PairAttention(64), nn.LayerNorm(64), GPT2MLP()

        def forward(self, hidden_states):
            a, _ = self.attn(self.ln_1(hidden_states))
            h = a + hidden_states
            return h + self.mlp(self.ln_2(h))

    torch.manual_seed(0)
    model, x = nn.Sequential(Block(), Block()).eval(), torch.randn(2, 7, 64)
    assert recognise.conv1d(model[0].mlp.c_fc) and not recognise.conv1d(nn.Linear(4, 4))
    with torch.no_grad():
        ref = model(x)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert (counts["qkv"], counts["mlp_act"], counts["down_residual"]) == (2, 2, 2)
    w = model[0].mlp.c_fc.weight
    assert w.shape == (64, 128) and w.t().is_contiguous() and w.untyped_storage().nbytes() == 64 * 128 * 4
    TorchOps.calls = []
    with torch.no_grad():
        assert torch.allclose(model(x), ref, atol=1e-5, rtol=1e-5)
    assert ("gelu_tanh", (128, 64)) in TorchOps.calls and ("residual", (64, 128)) in TorchOps.calls  # N x K weights
    hgemm_fuse.unfuse(model)
    assert model[0].mlp.c_fc.weight.is_contiguous()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


class BloomGELU(nn.Module):
    def forward(self, x):  # BLOOM's tanh GELU, sqrt(2/pi) written as 0.79788456
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class ResidualMLP(nn.Module):
    """BLOOM's and MPT's MLPs: the residual an argument, added after the second projection (a dropout between)."""

    def __init__(self, act=None):
        super().__init__()
        self.dense_h_to_4h, self.gelu_impl, self.dense_4h_to_h = nn.Linear(64, 256), act or BloomGELU(), \
            nn.Linear(256, 64)

    def forward(self, hidden_states, residual):
        out = self.dense_4h_to_h(self.gelu_impl(self.dense_h_to_4h(hidden_states)))
        return nn.functional.dropout(out, 0.1, self.training) + residual


def test_an_mlp_that_takes_its_residual_adds_it_in_its_second_gemm():
    torch.manual_seed(0)
    mlp, h, r = ResidualMLP().eval(), torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    assert recognise.activation(mlp.gelu_impl, hgemm_fuse._epilogue_module(TorchOps)) == "gelu_tanh"
    assert recognise.plain_mlp(mlp, hgemm_fuse._epilogue_module(TorchOps)) == ("dense_h_to_4h", "dense_4h_to_h",
                                                                               "gelu_tanh", True)
    with torch.no_grad():
        ref = mlp(h, r)
    counts = hgemm_fuse.fuse(mlp, TorchOps)
    assert (counts["mlp_act"], counts["down_residual"]) == (1, 1)
    TorchOps.calls = []
    with torch.no_grad():  # the residual by keyword and positionally
        assert torch.allclose(mlp(h, residual=r), ref, atol=1e-6, rtol=1e-6)
        assert torch.allclose(mlp(h, r), ref, atol=1e-6, rtol=1e-6)
    assert TorchOps.calls == [("gelu_tanh", (256, 64)), ("residual", (64, 256))] * 2
    mlp.train()  # its dropout is a function call: its own forward
    TorchOps.calls = []
    with torch.no_grad():
        mlp(h, r)
    assert TorchOps.calls == []
    hgemm_fuse.unfuse(mlp)
    mlp.eval()
    with torch.no_grad():
        assert torch.equal(mlp(h, r), ref)


class TwiceResidualMLP(ResidualMLP):
    def forward(self, hidden_states, residual):
        return super().forward(hidden_states, residual) + residual


def test_an_mlp_that_adds_its_residual_otherwise_is_not_a_chain():
    assert recognise.plain_mlp(TwiceResidualMLP().eval(), hgemm_fuse._epilogue_module(TorchOps)) is None


class GatedRMSNorm(RMSNorm):
    """A Mamba-2 mixer's norm (Bamba's, Granite 4.0-H's): an RMSNorm where its caller gives no gate."""

    def forward(self, hidden_states, gate=None):
        if gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate.float())
        return super().forward(hidden_states)


class LayerTypeRotary(MatmulRotary):
    """A rotary embedding with frequencies per layer type (Gemma 3's): Llama's where it is given none."""

    def forward(self, x, position_ids, layer_type=None):
        return super().forward(x, position_ids)


class RoutedMLP(MLP):
    """A gated MLP whose forward takes another argument, as some MoE blocks' experts do: Llama's without it."""

    def forward(self, x, scale=None):
        out = super().forward(x)
        return out if scale is None else out * scale


def test_a_norm_or_rotary_called_with_more_than_the_probe_gave_it_runs_its_own_forward():
    gated, rotary = GatedRMSNorm(16), LayerTypeRotary()
    assert recognise.rms_norm_of(gated) == (1e-6, 0) and recognise.is_rotary(rotary)  # without the extras, Llama's

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.proj, self.rotary = GatedRMSNorm(16), nn.Linear(16, 16), LayerTypeRotary()

        def forward(self, x, pos):
            cos, sin = self.rotary(x, pos, "sliding_attention")
            return self.norm(x, self.proj(x)) + self.norm(x) + cos.sum() + sin.sum()

    mixer = Mixer()
    x, pos = torch.randn(2, 3, 16), torch.randint(0, 64, (2, 3))
    want = mixer(x, pos)
    counts = hgemm_fuse.fuse(mixer, TorchOps)
    assert counts["rms_norm"] == 1 and counts["rotary"] == 1
    assert torch.equal(mixer(x, pos), want)  # the gated and typed calls reach the modules' own forwards


def test_a_gated_mlp_whose_forward_takes_more_than_x_stays_its_own():
    assert recognise.probe_mlp(MLP(16, 32, nn.SiLU()))[0] == "pair"
    assert recognise.probe_mlp(RoutedMLP(16, 32, nn.SiLU()))[0] is None  # its gate/up weights could not be merged
