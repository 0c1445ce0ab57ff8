"""An activation a layer applies inline to a Linear child's output (OPT's and BART's fc1), moved into that Linear's
GEMM (agent/export/runtime/hgemm_inline.py): recognised by what the layer computes with it moved, the logits match
the unfused model's, and layers that use the activation otherwise keep it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agent.export.runtime import hgemm_fuse
from tests.test_fuse import Attention, TorchOps, WrittenGELU, compiles_whole

inline = hgemm_fuse.inline


class OPTLayer(nn.Module):
    """OPT's steps: norms, the attention, then fc1, the activation and fc2 in the layer's own forward."""

    def __init__(self, hidden=64, inner=96, act=None):
        super().__init__()
        self.self_attn, self.self_attn_layer_norm = Attention(hidden, 4, 2, True), nn.LayerNorm(hidden)
        self.fc1, self.fc2, self.final_layer_norm = nn.Linear(hidden, inner), nn.Linear(inner, hidden), \
            nn.LayerNorm(hidden)
        self.activation_fn = act if act is not None else nn.ReLU()

    def forward(self, hidden_states, attention_mask=None):
        h = hidden_states + self.self_attn(self.self_attn_layer_norm(hidden_states), attention_mask)[0]
        return h + self.fc2(nn.functional.dropout(self.activation_fn(self.fc1(self.final_layer_norm(h))), 0.1,
                                                  training=self.training))


class TwiceLayer(OPTLayer):
    def forward(self, hidden_states, attention_mask=None):  # the activation on the output too
        return self.activation_fn(super().forward(hidden_states, attention_mask))


class BeforeLayer(OPTLayer):
    def forward(self, hidden_states, attention_mask=None):  # the activation before fc1
        h = hidden_states + self.self_attn(hidden_states, attention_mask)[0]
        return h + self.fc2(self.fc1(self.activation_fn(h)))


def stack(layer, act=None):
    torch.manual_seed(0)
    return nn.Sequential(*(layer(act=act) for _ in range(2))).eval(), torch.randn(2, 7, 64)


def run(layers, x):
    with torch.no_grad():
        return layers(x)


@pytest.mark.parametrize("act, epilogue", [(nn.ReLU(), "relu"), (WrittenGELU(), "gelu_tanh"), (nn.GELU(), "gelu")])
def test_an_inline_activation_moves_into_its_linears_gemm(act, epilogue):
    layers, x = stack(OPTLayer, act)
    ref = run(layers, x)
    assert inline.inline_activation(layers[0], hgemm_fuse._epilogue_module(TorchOps)) == ("fc1", "activation_fn",
                                                                                            epilogue)
    counts = hgemm_fuse.fuse(layers, TorchOps)
    assert (counts["qkv"], counts["mlp_act"]) == (2, 2)
    assert isinstance(layers[0].activation_fn, nn.Identity)
    TorchOps.calls = []
    out = run(layers, x)  # with relu the same ops in the same order; a GELU as the epilogue computes it
    assert torch.equal(out, ref) if epilogue == "relu" else torch.allclose(out, ref, atol=1e-6, rtol=1e-6)
    assert (epilogue, (96, 64)) in TorchOps.calls
    assert f"({epilogue})" in hgemm_fuse.describe(layers)[0]
    assert hgemm_fuse.unfuse(layers) == 2 and layers[0].activation_fn is not None
    assert not isinstance(layers[0].activation_fn, nn.Identity) and type(layers[0].fc1) is nn.Linear
    assert torch.equal(run(layers, x), ref)


@pytest.mark.parametrize("layer", [TwiceLayer, BeforeLayer])
def test_an_activation_used_otherwise_stays_in_the_layer(layer):
    layers, x = stack(layer)
    ref = run(layers, x)
    assert inline.inline_activation(layers[0], hgemm_fuse._epilogue_module(TorchOps)) is None
    assert hgemm_fuse.fuse(layers, TorchOps)["mlp_act"] == 0
    assert torch.allclose(run(layers, x), ref, atol=1e-5, rtol=1e-5)
    hgemm_fuse.unfuse(layers)


class AfterSecondLayer(OPTLayer):
    def forward(self, hidden_states, attention_mask=None):  # the activation after fc2: fc2's to take
        h = hidden_states + self.self_attn(hidden_states, attention_mask)[0]
        return h + self.activation_fn(self.fc2(self.fc1(h)))


def test_the_activation_moves_into_the_linear_it_follows():
    layers, x = stack(AfterSecondLayer)
    ref = run(layers, x)
    assert inline.inline_activation(layers[0], hgemm_fuse._epilogue_module(TorchOps)) == ("fc2", "activation_fn",
                                                                                            "relu")
    hgemm_fuse.fuse(layers, TorchOps)
    TorchOps.calls = []
    assert torch.equal(run(layers, x), ref) and ("relu", (64, 96)) in TorchOps.calls
    hgemm_fuse.unfuse(layers)


class CrossBranchLayer(OPTLayer):
    """Uses the activation in its cross-attention branch too, which runs only with an encoder's states."""

    def __init__(self, act=None):
        super().__init__(act=act)
        self.encoder_attn = Attention(64, 4, 2, True)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        h = super().forward(hidden_states, attention_mask)
        if encoder_hidden_states is not None:
            h = h + self.activation_fn(self.encoder_attn(encoder_hidden_states)[0])
        return h


def test_an_activation_in_a_branch_only_an_encoders_states_take_stays_in_the_layer():
    layers, x = stack(CrossBranchLayer)
    assert inline.inline_activation(layers[0], hgemm_fuse._epilogue_module(TorchOps)) is None


def test_a_model_with_a_moved_activation_compiles_whole():
    compiles_whole(*stack(OPTLayer, nn.GELU()), tolerance=1e-6)


class NoCrossLayer(OPTLayer):
    """XGLM's without cross-attention: it takes an encoder's states but has no module to read them (it raises)."""

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        if encoder_hidden_states is not None:
            hidden_states = hidden_states + self.encoder_attn(encoder_hidden_states)[0]
        return super().forward(hidden_states, attention_mask)


def test_a_layer_that_cannot_take_an_encoders_states_moves_its_activation():
    layers, x = stack(NoCrossLayer)
    assert inline.inline_activation(layers[0], hgemm_fuse._epilogue_module(TorchOps)) == ("fc1", "activation_fn",
                                                                                            "relu")
