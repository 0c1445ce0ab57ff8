"""A decoder layer's residual adds in its projections' epilogues where its names or steps are not Llama's
(agent/export/runtime/hgemm_adds.py): layers whose attention and MLP both read the layer's input (GPT-J's, Phi's,
GPT-NeoX's, Falcon's, Cohere's steps) or run in turn under names of their own; x in the attention's output
projection, the rest in the MLP's last; the logits match the unfused model's, the layer's arguments reach the
attention as its own forward passes them, arguments that change the steps send the call to the layer's own forward,
layers whose steps differ keep theirs, and an attention that changes its projection's output is an error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agent.export.runtime import hgemm_fuse
from tests.test_fuse import MLP, Attention, Model, PlainMLP, RMSNorm, TorchOps, compiles_whole, fused_as_before

adds = hgemm_fuse.adds


class MaskAttention(Attention):
    """An attention whose arguments have names of its own (GPT-J's and Falcon's take `layer_past`), keeping what
    each call got."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen = []

    def forward(self, hidden_states, mask=None, layer_past=None, scale=1.0):
        self.seen.append((mask, layer_past, scale))
        out, _ = super().forward(hidden_states)
        return out, "weights"


class CohereLayer(nn.Module):
    """One norm for both branches, (x + a) + m."""

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__()
        self.self_attn, self.mlp = Attention(hidden, 4, 2, bias), MLP(hidden, inter, act)
        self.input_layernorm = norm(hidden)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = self.input_layernorm(hidden_states)
        a, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, **kwargs)
        return hidden_states + a + self.mlp(h)


class GPTJBlock(nn.Module):
    """GPT-J's names and order: `attn`, `ln_1`, a plain MLP, (a + m) + x; its arguments renamed for the attention."""

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__()
        self.ln_1, self.attn = norm(hidden), MaskAttention(hidden, 4, 2, bias)
        self.mlp = PlainMLP(hidden, inter, nn.GELU(approximate="tanh"), ("fc_in", "fc_out"))

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
        residual = hidden_states
        hidden_states = self.ln_1(hidden_states)
        attn_output, _ = self.attn(hidden_states=hidden_states, mask=attention_mask, layer_past=layer_past,
                                   scale=0.5)
        return attn_output + self.mlp(hidden_states) + residual


class FalconLayer(nn.Module):
    """Falcon's: a norm for each branch, the attention called positionally, the MLP's output added to in place,
    dropouts, and the attention's weights returned beside the output."""

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__()
        self.self_attention, self.mlp = MaskAttention(hidden, 4, 2, bias), PlainMLP(hidden, inter, nn.GELU())
        self.ln_attn, self.ln_mlp = norm(hidden), norm(hidden)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, attention_mask=None, layer_past=None, **kwargs):
        residual = hidden_states
        attention_output, weights = self.self_attention(self.ln_attn(hidden_states), layer_past=layer_past,
                                                        mask=attention_mask)
        mlp_output = self.mlp(self.ln_mlp(hidden_states))
        mlp_output += attention_output
        return self.dropout(mlp_output) + residual, weights


class PlainCohereLayer(CohereLayer):
    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        self.mlp = PlainMLP(hidden, inter, nn.ReLU())


def parallel_model(layer):
    torch.manual_seed(0)
    return Model(layer=layer).eval(), torch.randint(50, (2, 9))


def fused_beside_reference(layer):
    """A model of `layer`s fused with PyTorch's ops, with what it gave before: (model, ids, x (a layer's input), the
    model's logits on ids, its first layer's output on x, its parameters, fuse's counts)."""
    model, ids = parallel_model(layer)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        ref, ref_layer = model(ids), model.layers[0](x)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, ids, x, ref, ref_layer, before, hgemm_fuse.fuse(model, TorchOps)


@pytest.mark.parametrize("layer, form, epilogue", [(CohereLayer, "xam", "silu_mul"), (PlainCohereLayer, "xam", "relu"),
                                                   (GPTJBlock, "amx", "gelu_tanh"), (FalconLayer, "amx", "gelu")])
def test_a_parallel_layer_adds_its_mlps_output_in_the_mlps_last_gemm(layer, form, epilogue):
    model, ids, x, ref, ref_layer, before, counts = fused_beside_reference(layer)
    assert counts["parallel_residual"] == counts["o_residual"] == 2 and counts["down_residual"] == 0
    found = model.layers[0]._hgemm_adds
    assert found.form == form and found.out == "o_proj"
    assert type(model.layers[0]).forward is adds._adds_forward
    TorchOps.calls = []
    with torch.no_grad():
        out = model(ids)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    # per layer: q/k/v, o_proj with x, the MLP's first GEMM with its activation, its last with x + a
    assert [c[0] for c in TorchOps.calls if c[0] != "rms_norm"] == ["none", "residual", epilogue, "residual"] * 2
    with torch.no_grad():
        fused_layer = model.layers[0](x)
    if isinstance(ref_layer, tuple):  # the output, and the attention's weights as the layer returns them
        assert fused_layer[1:] == ref_layer[1:]
        fused_layer, ref_layer = fused_layer[0], ref_layer[0]
    if layer is PlainCohereLayer:  # (x + a) + m, the layer's own order, bit for bit
        assert torch.equal(fused_layer, ref_layer)
    else:  # (a + m) + x summed as (x + a) + m; Cohere's gate/up merged GEMM may round otherwise
        assert torch.allclose(fused_layer, ref_layer, atol=1e-5, rtol=1e-5)
    assert "the MLP's add in its last GEMM" in hgemm_fuse.describe(model)[0]
    assert hgemm_fuse.unfuse(model) >= 2 and type(model.layers[0]) is layer
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids), ref)


def test_the_layers_arguments_reach_the_attention_as_its_own_forward_passes_them():
    model, ids = parallel_model(FalconLayer)
    found = adds.residual_steps(model.layers[0], "self_attention", "mlp", "fc2")
    assert (found.attn_norm, found.mlp_norm, found.positional, found.extras) == ("ln_attn", "ln_mlp", True, False)
    assert dict(found.attn_args) == {"layer_past": ("arg", "layer_past"), "mask": ("arg", "attention_mask")}
    assert found.returns == 2  # the output and the attention's second output
    found = adds.residual_steps(parallel_model(GPTJBlock)[0].layers[0], "attn", "mlp", "fc_out")
    assert dict(found.attn_args) == {"mask": ("arg", "attention_mask"), "layer_past": ("arg", "layer_past"),
                                     "scale": ("const", 0.5)}
    assert (found.attn_norm, found.mlp_norm, found.positional) == ("ln_1", "same", False)
    layer = FalconLayer(64, 96, None, False, RMSNorm).eval()
    x, mask = torch.randn(2, 5, 64), torch.ones(2, 5)
    with torch.no_grad():
        ref, weights = layer(x, mask, layer_past="cache")
        hgemm_fuse.fuse(layer, TorchOps)
        out, fused_weights = layer(x, attention_mask=mask, layer_past="cache")
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5) and fused_weights == weights == "weights"
    (m1, p1, s1), (m2, p2, s2) = layer.self_attention.seen
    assert m1 is m2 is mask and p1 == p2 == "cache" and s1 == s2 == 1.0
    hgemm_fuse.unfuse(layer)


class FlagLayer(CohereLayer):
    """Returns the attention's weights only when asked: its steps change with an argument."""

    def forward(self, hidden_states, output_attentions=False, **kwargs):
        h = self.input_layernorm(hidden_states)
        a, weights = self.self_attn(h)
        out = hidden_states + a + self.mlp(h)
        return (out, weights) if output_attentions else out


class MaskedLayer(CohereLayer):
    """Computes what it passes to the attention from an argument."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = self.input_layernorm(hidden_states)
        mask = None if attention_mask is None else attention_mask.bool()
        return hidden_states + self.self_attn(h, attention_mask=mask)[0] + self.mlp(h)


@pytest.mark.parametrize("layer, branch", [(FlagLayer, ("output_attentions", True)),
                                           (MaskedLayer, ("attention_mask", torch.ones(2, 9)))])
def test_an_argument_that_changes_the_steps_sends_the_call_to_the_layers_own_forward(layer, branch):
    model, ids = parallel_model(layer)
    found = adds.residual_steps(model.layers[0], "self_attn", "mlp", "down_proj")
    assert found.branches == ((branch[0], None if layer is MaskedLayer else False),)
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        ref, ref_branch = model.layers[0](x), model.layers[0](x, **dict([branch]))
        assert hgemm_fuse.fuse(model, TorchOps)["parallel_residual"] == 2
        TorchOps.calls = []
        out = model.layers[0](x)
        assert ("residual", (64, 96)) in TorchOps.calls  # its default: the fused steps
        TorchOps.calls = []
        out_branch = model.layers[0](x, **dict([branch]))
    assert ("residual", (64, 96)) not in TorchOps.calls  # the layer's own steps
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    out_branch, ref_branch = (t[0] if isinstance(t, tuple) else t for t in (out_branch, ref_branch))
    assert torch.allclose(out_branch, ref_branch, atol=1e-5, rtol=1e-5)
    hgemm_fuse.unfuse(model)


class SequentialLayer(CohereLayer):
    """The attention, then the MLP on a norm of its sum (Persimmon's steps, under names of its own)."""

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        self.ln_2 = norm(hidden)

    def forward(self, hidden_states, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states))[0]
        return h + self.mlp(self.ln_2(h))


def test_a_sequential_layer_under_other_names_adds_in_its_mlps_last_gemm():
    model, ids = parallel_model(SequentialLayer)
    found = adds.residual_steps(model.layers[0], "self_attn", "mlp", "down_proj")
    assert (found.form, found.attn_norm, found.mlp_norm) == ("seq", "input_layernorm", "ln_2")
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert (counts["down_residual"], counts["o_residual"], counts["parallel_residual"]) == (2, 2, 0)
    hgemm_fuse.unfuse(model)
    assert fused_as_before(model, ids) == (2, 2, 2, 2)


class ScalingAttention(Attention):
    """An attention that scales its output projection's output before returning it."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        out, extra = super().forward(hidden_states, attention_mask)
        return out * 0.5, extra


def test_an_attention_that_changes_its_projections_output_is_an_error_at_its_first_call():
    model, ids = parallel_model(SequentialLayer)
    for layer in model.layers:
        layer.self_attn.__class__ = ScalingAttention
    assert hgemm_fuse.fuse(model, TorchOps)["o_residual"] == 2  # the probe stands in for the attention
    with torch.no_grad(), pytest.raises(RuntimeError, match="ScalingAttention returns something other than"):
        model(ids)
    assert hgemm_fuse.steps.slot(model.layers[0].self_attn.o_proj).residual is None  # left clean
    hgemm_fuse.unfuse(model)


def test_an_attention_without_one_output_projection_keeps_its_add():
    model, ids = parallel_model(SequentialLayer)
    for layer in model.layers:
        layer.self_attn.dense = nn.Linear(64, 64)  # two candidates: which one the attention returns is not known
    assert adds.out_projection(model.layers[0].self_attn, 64) is None
    assert fused_as_before(model, ids) == (2, 2, 0, 2)


class ScaledBranchLayer(CohereLayer):
    def forward(self, hidden_states, **kwargs):
        h = self.input_layernorm(hidden_states)
        return hidden_states + self.self_attn(h)[0] + self.mlp(h) * 0.5


class ScaledSequentialLayer(SequentialLayer):
    def forward(self, hidden_states, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states))[0]
        return h * 0.5 + self.mlp(self.ln_2(h))


@pytest.mark.parametrize("layer", [ScaledBranchLayer, ScaledSequentialLayer])
def test_a_layer_whose_adds_are_not_plain_keeps_its_own_forward(layer):
    model, ids = parallel_model(layer)
    with torch.no_grad():
        ref = model(ids)
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert counts["parallel_residual"] == counts["down_residual"] == 0 and counts["qkv"] == counts["gate_up"] == 2
    assert type(model.layers[0]).forward is layer.forward
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    hgemm_fuse.unfuse(model)


def test_a_parallel_layer_runs_its_own_forward_in_training_mode():
    model, ids = parallel_model(FalconLayer)
    hgemm_fuse.fuse(model, TorchOps)
    model.train()
    TorchOps.calls = []
    torch.manual_seed(1)
    with torch.no_grad():
        out = model(ids)
    assert ("residual", (64, 96)) not in TorchOps.calls  # its dropout ran: the layer's own steps
    hgemm_fuse.unfuse(model)
    torch.manual_seed(1)
    with torch.no_grad():
        assert torch.allclose(model(ids), out, atol=1e-5, rtol=1e-5)


def test_a_compiled_parallel_model_runs_whole():
    compiles_whole(*parallel_model(GPTJBlock))


class KwargsAttention(Attention):
    def __init__(self, *args):
        super().__init__(*args)
        self.seen = []

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        self.seen.append(kwargs)
        return super().forward(hidden_states, attention_mask)


@pytest.mark.parametrize("positional", [False, True])
def test_a_layers_extra_keywords_reach_the_attention_as_its_own_forward_passes_them(positional):
    torch.manual_seed(0)
    layer = CohereLayer(64, 96, nn.SiLU(), False, RMSNorm).eval()
    layer.self_attn = KwargsAttention(64, 4, 2, False)
    x, mask = torch.randn(2, 5, 64), torch.ones(2, 5)
    with torch.no_grad():
        ref = layer(x, mask, extra="e") if positional else layer(x, attention_mask=mask, extra="e")
        assert hgemm_fuse.fuse(layer, TorchOps)["parallel_residual"] == 1
        out = layer(x, mask, extra="e") if positional else layer(x, attention_mask=mask, extra="e")
    assert layer._hgemm_adds.extras and torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert layer.self_attn.seen == [{"extra": "e"}] * 2
    hgemm_fuse.unfuse(layer)


def test_which_norm_is_which_does_not_rest_on_values_they_share_at_init():
    """At init both norms hold ones: the layer's steps are found with them made distinct, so the fused layer applies
    each where the layer does once they differ (weights loaded after patch)."""
    model, ids = parallel_model(SequentialLayer)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.fill_(1.0)  # as transformers' init leaves them
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert counts["down_residual"] == 2 and model.layers[0]._hgemm_adds.mlp_norm == "ln_2"
    assert torch.equal(model.layers[0].ln_2.weight, torch.ones(64))  # put back after the probe
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
        fused = model(ids)
    hgemm_fuse.unfuse(model)
    with torch.no_grad():
        assert torch.allclose(fused, model(ids), atol=1e-5, rtol=1e-5)


class LinearAttention(Attention):
    """A hybrid model's linear attention: its output alone, a tensor, not a pair."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return super().forward(hidden_states, attention_mask)[0]


class HybridLayer(nn.Module):
    """Qwen3.5's linear-attention layers: Llama's steps with `linear_attn`, which returns a tensor."""

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__()
        self.linear_attn, self.mlp = LinearAttention(hidden, 4, 2, bias), MLP(hidden, inter, act)
        self.input_layernorm, self.post_attention_layernorm = norm(hidden), norm(hidden)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = hidden_states + self.linear_attn(hidden_states=self.input_layernorm(hidden_states),
                                             attention_mask=attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def test_a_linear_attention_that_returns_a_tensor_has_both_adds_fused():
    model, ids = parallel_model(HybridLayer)
    with torch.no_grad():
        ref = model(ids)
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert (counts["o_residual"], counts["down_residual"], counts["qkv"], counts["gate_up"]) == (2, 2, 2, 2)
    found = model.layers[0]._hgemm_adds
    assert (found.attn, found.pair, found.out, found.form) == ("linear_attn", False, "o_proj", "seq")
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    hgemm_fuse.unfuse(model)
    with torch.no_grad():
        assert torch.equal(model(ids), ref)


@pytest.mark.parametrize("layer", [None, PlainCohereLayer, GPTJBlock])
def test_fused_modules_below_a_layer_hold_only_plain_values(layer):
    """A fused attention, MLP, projection or norm holds ints, floats, strings and tensors besides its own children;
    what its forward changes as it runs lives outside it (steps.slot), so that torch.compile can skip the guards of
    a whole attention or MLP while their dicts are unchanged (with a plain object among them, torch 2.11 checked
    every guard of every layer's attention and MLP at every call)."""
    model, ids = parallel_model(layer) if layer else (Model().eval(), torch.randint(50, (2, 9)))
    hgemm_fuse.fuse(model, TorchOps)
    with torch.no_grad():
        model(ids)
    layers = set(model.layers)  # a layer's own values are guarded whatever they are (its class is new)
    held = {(name, k): type(v) for name, m in model.named_modules() if m not in layers for k, v in vars(m).items()
            if k.startswith("_hgemm_") and k not in ("_hgemm_signature", "_hgemm_fused")}  # neither read when run
    assert held and all(issubclass(t, (int, float, str, type(None), torch.Tensor)) for t in held.values()), held
    assert any(k == "_hgemm_slot" for _, k in held)  # the projections' state is outside them
    hgemm_fuse.unfuse(model)


class InlineMLPLayer(nn.Module):
    """OPT's steps: the MLP's two Linear children and its activation called by the layer itself, on its tokens
    flattened into rows."""

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__()
        self.self_attn = Attention(hidden, 4, 2, bias)
        self.self_attn_layer_norm, self.final_layer_norm = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.fc1, self.fc2, self.activation_fn = nn.Linear(hidden, inter), nn.Linear(inter, hidden), nn.ReLU()

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.self_attn_layer_norm(hidden_states),
                                          attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        shape = hidden_states.shape
        hidden_states = residual = hidden_states.reshape(-1, hidden_states.size(-1))
        hidden_states = self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(hidden_states))))
        return (residual + hidden_states).view(shape)


class ScaledInlineMLPLayer(InlineMLPLayer):
    """Something of the layer's own between the MLP's two projections: its add is not fc2's output plus h."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = hidden_states + self.self_attn(self.self_attn_layer_norm(hidden_states))[0]
        return h + self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(h))) * 0.5)


@pytest.mark.parametrize("layer, adds_fused", [(InlineMLPLayer, 2), (ScaledInlineMLPLayer, 0)])
def test_an_mlp_inline_in_the_layer_takes_the_add_in_its_last_linear(layer, adds_fused):
    model, ids, x, ref, ref_layer, before, counts = fused_beside_reference(layer)
    assert (counts["o_residual"], counts["down_residual"], counts["mlp_act"]) == (adds_fused, adds_fused, 2)
    TorchOps.calls = []
    with torch.no_grad():
        assert torch.equal(model.layers[0](x), ref_layer)  # the layer's adds in its own order: bit for bit
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    if adds_fused:
        found = model.layers[0]._hgemm_adds
        assert (found.mlp, found.first, found.down, found.mlp_norm, found.form) == (
            None, "fc1", "fc2", "final_layer_norm", "seq")
        # per layer: q/k/v, o_proj with x, fc1 with its activation, fc2 with x + a
        assert [c[0] for c in TorchOps.calls if c[0] != "rms_norm"][-4:] == ["none", "residual", "relu", "residual"]
    assert hgemm_fuse.unfuse(model) >= 2 and type(model.layers[0]) is layer
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    if adds_fused:
        compiles_whole(model, ids)


class WrappedAttention(nn.Module):
    """GPT-Neo's attention: a module around the one with the projections, returning its output as it is."""

    def __init__(self, hidden, heads, kv_heads, bias):
        super().__init__()
        self.attention = Attention(hidden, heads, kv_heads, bias)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return self.attention(hidden_states, attention_mask=attention_mask)


class WrappedSequentialLayer(SequentialLayer):
    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        self.self_attn = WrappedAttention(hidden, 4, 2, bias)


def test_an_attention_wrapping_the_one_with_the_output_projection_adds_x_there():
    model, ids = parallel_model(WrappedSequentialLayer)
    assert adds.out_projection(model.layers[0].self_attn, 64) == "attention.o_proj"
    assert fused_as_before(model, ids) == (2, 2, 2, 2)
    compiles_whole(model, ids)
