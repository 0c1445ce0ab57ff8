"""Decoder-layer fusions (agent/export/runtime/hgemm_fuse.py) on tiny Hugging Face-style modules written here: each
fusion is recognised, the logits match the unfused model's, `unfuse` restores the exact parameters, no weight is
held twice, and the fused model runs under torch.compile(fullgraph=True). The shape recorder names the fused
problems."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agent.export.runtime import hgemm_fuse
from agent.recorder import record_gemm_shapes
from core import epilogue
from tests.test_e2e_tools import load_tool

recognise = hgemm_fuse.recognise


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, as it is written there."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's: times (1 + weight), in fp32, rounded once. Not Llama's."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).type_as(x)


class HalfScaleNorm(RMSNorm):
    """Llama's steps with the weight halved: neither Llama's nor Gemma's."""

    def forward(self, x):
        return super().forward(x) * 0.5


class WeightlessNorm(RMSNorm):
    """Llama's formula without its weight: the same as Llama's only where the weight is all ones."""

    def forward(self, x):
        h = x.to(torch.float32)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


class Attention(nn.Module):
    """q/k/v/o projections around causal attention with grouped KV heads, as Llama's (no rotary)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, bias: bool):
        super().__init__()
        self.head_dim, self.heads, self.kv_heads = hidden // heads, heads, kv_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def projections(self, hidden_states):
        return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in self.projections(hidden_states))
        k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj, self.act_fn = nn.Linear(inter, hidden, bias=False), act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden: int, inter: int, act: nn.Module, bias: bool, norm=RMSNorm):
        super().__init__()
        self.self_attn, self.mlp = Attention(hidden, 4, 2, bias), MLP(hidden, inter, act)
        self.input_layernorm, self.post_attention_layernorm = norm(hidden), norm(hidden)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                                          attention_mask=attention_mask, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class TupleLayer(Layer):
    def forward(self, hidden_states, attention_mask=None, **kwargs):  # an older convention: a tuple, no annotation
        return (super().forward(hidden_states, attention_mask, **kwargs),)


class Model(nn.Module):
    def __init__(self, layers: int = 2, act: nn.Module | None = None, bias: bool = False, layer=Layer, norm=RMSNorm):
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.layers = nn.ModuleList(layer(64, 96, act or nn.SiLU(), bias, norm) for _ in range(layers))
        self.norm = norm(64)
        self.lm_head = nn.Linear(64, 50, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            out = layer(h, attention_mask=None)
            h = out[0] if isinstance(out, tuple) else out
        return self.lm_head(self.norm(h))


TorchOps = load_tool("arch_probe").TorchOps  # PyTorch's ops where the kernels would run
OpaqueOps = load_tool("arch_probe").OpaqueOps  # the same behind custom ops, opaque to torch.compile as the export's


def model_and_ids(**kw):
    torch.manual_seed(0)
    return Model(**kw).eval(), torch.randint(50, (2, 9))


def storage_bytes(model: nn.Module) -> int:
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("bias, act, epilogue", [(False, nn.SiLU(), "silu_mul"),
                                                 (True, nn.GELU(approximate="tanh"), "gelu_mul")])
def test_each_fusion_is_recognised_and_the_logits_match(bias, act, epilogue):
    model, ids = model_and_ids(act=act, bias=bias)
    with torch.no_grad():
        ref = model(ids)
    params = dict(model.named_parameters())
    before, size = {n: p.detach().clone() for n, p in params.items()}, storage_bytes(model)
    classes, text = {n: type(m) for n, m in model.named_modules()}, repr(model)
    assert hgemm_fuse.fuse(model, TorchOps) == dict.fromkeys(hgemm_fuse.KINDS, 0) | {
        "qkv": 2, "gate_up": 2, "o_residual": 2, "down_residual": 2, "rms_norm": 5,  # 2 a layer, 1 final
        "norm_gate_up": 2, "norm_qkv": 2}  # each layer's norms in the GEMM after them (norm_qkv: compiled only)
    assert storage_bytes(model) == size  # merged buffers replace the parameters' storage: nothing held twice
    assert repr(model) == text and all(isinstance(m, classes[n]) for n, m in model.named_modules())
    assert type(model.layers[0]).forward is hgemm_fuse.steps._layer_forward  # the class's: one path to each module
    assert hgemm_fuse.fuse(model, TorchOps) == dict.fromkeys(hgemm_fuse.KINDS, 0)  # fused once
    TorchOps.calls = []
    with torch.no_grad():
        out = model(ids)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    # per layer: the norm, q/k/v in one GEMM of N = 64 + 32 + 32, o_proj + residual, the norm, gate/up gated
    # (N = 2 x 96), down + residual; the final norm
    layer = [("rms_norm", (64,)), ("none", (128, 64)), ("residual", (64, 64)), ("rms_norm", (64,)),
             (epilogue, (192, 64)), ("residual", (64, 96))]
    assert TorchOps.calls == layer + layer + [("rms_norm", (64,))]
    described = hgemm_fuse.describe(model)
    assert described[0].startswith("layers.0: q/k/v as one GEMM, gate/up as one gated GEMM, o_proj + residual, "
                                   "down_proj + residual, 2 RMSNorms in one kernel each")
    assert epilogue in described[0] and described[-1] == "norm: RMSNorm in one kernel"
    assert hgemm_fuse.unfuse(model) == 3 and hgemm_fuse.describe(model) == []
    for n, p in model.named_parameters():  # the same parameter objects, bit for bit, each its own storage again
        assert p is params[n] and torch.equal(p, before[n]), n
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert not any(a.startswith("_hgemm_") for m in model.modules() for a in vars(m))
    assert storage_bytes(model) == size
    with torch.no_grad():
        assert torch.equal(model(ids), ref)


def test_what_is_not_recognised_stays_as_it_is():
    # an activation with no gated epilogue, a norm that is none of the kernel's; a layer that returns a tuple is not
    # Llama's, its adds are fused as hgemm_adds fuses them (the tuple as the layer returns it)
    model, ids = model_and_ids(act=nn.ReLU(), layer=TupleLayer, norm=HalfScaleNorm)
    with torch.no_grad():
        ref = model(ids)
    assert hgemm_fuse.fuse(model, TorchOps) == dict.fromkeys(hgemm_fuse.KINDS, 0) | {"qkv": 2, "down_residual": 2,
                                                                                      "o_residual": 2}
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
        assert isinstance(model.layers[0](torch.randn(2, 3, 64)), tuple)
    hgemm_fuse.unfuse(model)
    model, ids = model_and_ids()
    model.layers[0].forward = model.layers[0].forward  # a forward of its own (a hook's): that layer stays as it is,
    counts = hgemm_fuse.fuse(model, TorchOps)  # but for its attention's q/k/v, which are fused wherever they are
    assert (counts["qkv"], counts["o_residual"]) == (2, 1) and "forward" in vars(model.layers[0])
    assert type(model.layers[0]) is Layer and type(model.layers[0].self_attn.q_proj) is not nn.Linear
    hgemm_fuse.unfuse(model)
    plain = nn.Sequential(nn.Linear(8, 8))
    assert hgemm_fuse.fuse(plain, TorchOps) == dict.fromkeys(hgemm_fuse.KINDS, 0)


class SandwichLayer(Layer):
    """Gemma2's steps: a norm after the attention and around the MLP too, before each residual add; ROLES names the
    norms before and after the attention and before and after the MLP."""

    ROLES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        for name in self.ROLES:
            if not hasattr(self, name):
                self.add_module(name, norm(hidden))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs) -> torch.Tensor:
        pre_attn, post_attn, pre_mlp, post_mlp = (getattr(self, n) for n in self.ROLES)
        h, _ = self.self_attn(hidden_states=pre_attn(hidden_states), attention_mask=attention_mask)
        h = hidden_states + post_attn(h)
        return h + post_mlp(self.mlp(pre_mlp(h)))


class ScaledResidualLayer(Layer):
    """Granite's steps: the branches scaled before each residual add."""

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs) -> torch.Tensor:
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask)
        h = hidden_states + h * 0.25
        return h + self.mlp(self.post_attention_layernorm(h)) * 0.25


class RequiredArgumentLayer(Layer):
    """Llama's steps, with the position embeddings a required argument passed on to the attention (as some
    transformers versions write the layer)."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, **kwargs) -> torch.Tensor:
        return super().forward(hidden_states, attention_mask, position_embeddings=position_embeddings, **kwargs)


class PositionModel(Model):
    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, None)
        return self.lm_head(self.norm(h))


class MergedAttention(Attention):
    """Phi-3's attention: q, k and v already one projection, qkv_proj."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, bias: bool):
        super().__init__(hidden, heads, kv_heads, bias)
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=bias)
        del self.q_proj, self.k_proj, self.v_proj

    def projections(self, hidden_states):
        q_end, k_end = self.heads * self.head_dim, (self.heads + self.kv_heads) * self.head_dim
        qkv = self.qkv_proj(hidden_states)
        return qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]


class WideAttention(Attention):
    """Heads wider than the hidden size over their count (Qwen3's and Gemma's shapes): o_proj maps 2 x hidden back."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, bias: bool):
        super().__init__(2 * hidden, heads, kv_heads, bias)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self, name)
            setattr(self, name, nn.Linear(hidden, old.out_features, bias=bias))
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)


class WideLayer(Layer):
    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        self.self_attn = WideAttention(hidden, 4, 2, bias)


class MergedMLP(nn.Module):
    """Phi-3's MLP: gate and up as one projection, gate's rows first; the activation is `activation_fn`."""

    def __init__(self, hidden: int, inter: int, act: nn.Module):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj, self.activation_fn = nn.Linear(inter, hidden, bias=False), act

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class DropoutLayer(Layer):
    """Phi-3's layer: its attention and MLP merged, a dropout (identity when evaluating) on each branch."""

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        self.self_attn, self.mlp = MergedAttention(hidden, 4, 2, bias), MergedMLP(hidden, inter, act)
        self.resid_attn_dropout, self.resid_mlp_dropout = nn.Dropout(0.1), nn.Dropout(0.1)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs) -> torch.Tensor:
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask)
        h = hidden_states + self.resid_attn_dropout(h)
        return h + self.resid_mlp_dropout(self.mlp(self.post_attention_layernorm(h)))


class SubNormMLP(MLP):
    """A gated MLP with a norm before down_proj (BitNet's steps, with SiLU): not down(act(gate) * up)."""

    def __init__(self, hidden, inter, act):
        super().__init__(hidden, inter, act)
        self.ffn_sub_norm = RMSNorm(inter)

    def forward(self, x):
        return self.down_proj(self.ffn_sub_norm(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class ScaledOutputMLP(MLP):
    """An MLP that scales down_proj's output before returning it (a gated MLP's steps otherwise)."""

    def forward(self, x):
        return super().forward(x) * 0.5


class ScaledOutputAttention(Attention):
    """An attention that scales o_proj's output before returning it."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        out, weights = super().forward(hidden_states, attention_mask)
        return out * 0.5, weights


def forward_seeing_norms(model, ids) -> tuple[torch.Tensor, list[tuple[int, bool]]]:
    """The model's output, and (kind, residual given) of each ops.rms_norm call it made."""
    seen, real = [], TorchOps.rms_norm

    def rms_norm(x, w, eps, kind=0, residual=None):
        seen.append((kind, residual is not None))
        return real(x, w, eps, kind, residual)
    TorchOps.rms_norm = rms_norm
    try:
        with torch.no_grad():
            return model(ids), seen
    finally:
        TorchOps.rms_norm = real


def fused_as_before(model, ids) -> tuple[int, int, int, int]:
    """Fuses the model with PyTorch's ops, checks its logits against the unfused model's, unfuses it; the counts of
    q/k/v, gate/up, o_proj and down_proj residual fusions."""
    with torch.no_grad():
        ref = model(ids)
    counts = hgemm_fuse.fuse(model, TorchOps)
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    hgemm_fuse.unfuse(model)
    return counts["qkv"], counts["gate_up"], counts["o_residual"], counts["down_residual"]


def test_a_layer_whose_steps_are_neither_llamas_nor_post_norm_keeps_its_residual_adds():
    model, ids = model_and_ids(layer=ScaledResidualLayer)
    assert fused_as_before(model, ids) == (2, 2, 0, 0)
    assert hgemm_fuse.fuse(model, TorchOps)["norm_residual"] == 0
    assert type(model.layers[0]).forward is ScaledResidualLayer.forward
    hgemm_fuse.unfuse(model)


class GlmLayer(SandwichLayer):
    """GLM-4's steps: Gemma 2's under other names, its post_attention_layernorm the norm before the MLP."""

    ROLES = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


POST_NORM_ROLES = {"sandwich": SandwichLayer.ROLES, "glm": GlmLayer.ROLES,
                   "post_norm": (None, "post_attention_layernorm", None, "post_feedforward_layernorm")}


@pytest.mark.parametrize("norm", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("layer", ["sandwich", "post_norm", "glm"])
def test_a_post_norm_layer_adds_each_residual_in_the_norm_before_it(layer, norm):
    """Gemma 2's steps (norms before and after the attention and the MLP), Olmo 2's (after only) and GLM-4's (Gemma
    2's under other names): the norm after each block and the add after it in one rms_norm call; each norm found in
    its role by what it computes (weights of their own: a norm in the wrong role would change the logits)."""
    model, ids = model_and_ids(layer={"sandwich": SandwichLayer, "post_norm": PostNormLayer, "glm": GlmLayer}[layer],
                               norm=norm)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, norm):
                m.weight.uniform_(0.5, 1.5)
        ref = model(ids)
    assert hgemm_fuse.steps.post_norm_roles(model.layers[0]) == POST_NORM_ROLES[layer]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert (counts["qkv"], counts["gate_up"], counts["o_residual"], counts["norm_residual"]) == (2, 2, 0, 2)
    assert type(model.layers[0]).forward is hgemm_fuse.steps._post_norm_forward
    assert model.layers[0]._hgemm_roles == POST_NORM_ROLES[layer]
    out, seen = forward_seeing_norms(model, ids)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert [residual for _, residual in seen].count(True) == 4  # two a layer, each with its residual
    assert "post-norms + residual in one kernel each" in hgemm_fuse.describe(model)[0]
    assert hgemm_fuse.unfuse(model) >= 2 and type(model.layers[0]).forward is not hgemm_fuse.steps._post_norm_forward
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids), ref)


class PostNormLayer(nn.Module):
    """Olmo2's steps: no norm before the attention or the MLP, one after each, before its residual add."""

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__()
        self.self_attn, self.mlp = Attention(hidden, 4, 2, bias), MLP(hidden, inter, act)
        self.post_attention_layernorm, self.post_feedforward_layernorm = norm(hidden), norm(hidden)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = hidden_states + self.post_attention_layernorm(self.self_attn(hidden_states, attention_mask)[0])
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Experts(nn.Module):
    """An MoE block in place of the MLP: two gated experts mixed by a router (no down_proj of its own)."""

    def __init__(self, hidden, inter, act):
        super().__init__()
        self.router, self.experts = nn.Linear(hidden, 2, bias=False), nn.ModuleList(MLP(hidden, inter, act)
                                                                                     for _ in range(2))

    def forward(self, x):
        weights = self.router(x).softmax(-1)
        return sum(weights[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class MoELayer(Layer):
    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        self.mlp = Experts(hidden, inter, act)


class SparseMoELayer(Layer):
    """Granite-MoE's and JetMoE's naming: the MoE block (of class EXPERTS) is not called `mlp` but BLOCK."""

    BLOCK, EXPERTS = "block_sparse_moe", Experts

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        del self.mlp
        setattr(self, self.BLOCK, self.EXPERTS(hidden, inter, act))

    def attended(self, hidden_states, attention_mask):
        """x + attn(norm1(x)), the block's input before its norm."""
        return hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask)[0]

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = self.attended(hidden_states, attention_mask)
        return h + self.block_sparse_moe(self.post_attention_layernorm(h))


def test_a_post_norm_layer_fuses_its_projections_and_keeps_its_adds_without_the_norm_kernel():
    model, ids = model_and_ids(layer=PostNormLayer)
    with torch.no_grad():
        ref = model(ids)
    counts = hgemm_fuse.fuse(model, TorchOps, norms=False)  # the adds go into the norm kernel only
    assert (counts["qkv"], counts["gate_up"], counts["norm_residual"]) == (2, 2, 0)
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    hgemm_fuse.unfuse(model)


def test_an_moe_layer_fuses_its_qkv_o_projs_add_and_each_gated_expert():
    # each expert held as a gated MLP module fuses its gate/up (two a layer); the block's add stays the layer's
    assert fused_as_before(*model_and_ids(layer=SparseMoELayer)) == (2, 4, 2, 0)  # the block by another name
    model, ids = model_and_ids(layer=MoELayer)
    assert fused_as_before(model, ids) == (2, 4, 2, 0)
    with torch.no_grad():
        ref = model(ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    hgemm_fuse.fuse(model, TorchOps)
    assert model.layers[0].mlp.experts[0].gate_proj.weight.numel() == 0  # the interleaved merge is the only copy
    assert hgemm_fuse.describe(model)[0] == ("layers.0: q/k/v as one GEMM, o_proj + residual, 2 RMSNorms in one "
                                             "kernel each, input_layernorm and q/k/v in one call under torch.compile"
                                             " (one kernel where gemv serves)")
    assert hgemm_fuse.describe(model)[1] == "layers.0.mlp.experts.0: gate/up as one gated GEMM (silu_mul)"
    TorchOps.calls = []
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    # per layer through ops: q/k/v, o_proj + residual, each expert's gated GEMM (its down_proj and the router are
    # plain nn.Linear calls, the block's add the layer's)
    layer = ["none", "residual", "silu_mul", "silu_mul"]
    assert [c[0] for c in TorchOps.calls if c[0] != "rms_norm"] == layer + layer
    hgemm_fuse.unfuse(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


class RoutedExperts(Experts):
    """Llama 4's and GPT-OSS's MoE block: its output's rows flat (tokens x hidden), with the router's scores."""

    def forward(self, x):
        return super().forward(x).reshape(-1, x.shape[-1]), self.router(x)


class FeedForwardLayer(SparseMoELayer):
    """Llama 4's naming and steps: the MoE block `feed_forward`, its output unpacked and reshaped by the layer."""

    BLOCK, EXPERTS = "feed_forward", RoutedExperts

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = self.attended(hidden_states, attention_mask)
        out, _ = self.feed_forward(self.post_attention_layernorm(h))
        return h + out.view(h.shape)


class PairExperts(Experts):
    def forward(self, x):  # GPT-OSS's: the layer's shape, with the router's scores
        return super().forward(x), self.router(x)


class UnshapedLayer(FeedForwardLayer):
    EXPERTS = PairExperts

    def forward(self, hidden_states, attention_mask=None, **kwargs):  # takes the block's output as it comes
        h = self.attended(hidden_states, attention_mask)
        return h + self.feed_forward(self.post_attention_layernorm(h))[0]


class ReshapingLayer(Layer):
    """Llama 4's dense layers: the MLP's output reshaped to the layer's (a no-op for a dense MLP's)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask)[0]
        return h + self.mlp(self.post_attention_layernorm(h)).view(h.shape)


def test_a_layer_that_reshapes_its_mlps_output_fuses_both_adds():
    model, ids = model_and_ids(layer=ReshapingLayer)
    assert hgemm_fuse.steps.layer_steps(model.layers[0], "mlp") == ("llama", False, True, False)
    assert fused_as_before(model, ids) == (2, 2, 2, 2)


@pytest.mark.parametrize("layer, flat", [(FeedForwardLayer, True), (UnshapedLayer, False)])
def test_a_layer_that_takes_its_moe_blocks_output_as_a_pair_fuses_o_projs_add(layer, flat):
    model, ids = model_and_ids(layer=layer)
    assert hgemm_fuse.steps.mlp_name(model.layers[0]) == "feed_forward"
    # flat: the layer reshapes what the block returns (flat rows or not); else its probe with flat rows raises
    assert hgemm_fuse.steps.layer_steps(model.layers[0], "feed_forward") == ("llama", True, flat, True)
    assert fused_as_before(model, ids) == (2, 4, 2, 0)


class TupleExperts(Experts):
    def forward(self, x):
        return super().forward(x), None


class EitherLayer(MoELayer):
    """transformers 4's MoE layers: the block's output unpacked where it is a pair (output, router logits)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask)[0]
        out = self.mlp(self.post_attention_layernorm(h))
        return h + (out[0] if isinstance(out, tuple) else out)


def test_a_layer_that_takes_its_moe_blocks_output_as_a_pair_or_a_tensor_fuses_o_projs_add():
    model, ids = model_and_ids(layer=EitherLayer)
    for layer in model.layers:
        layer.mlp.__class__ = TupleExperts  # returns (output, None), as transformers 4's blocks return a pair
    assert hgemm_fuse.steps.layer_steps(model.layers[0], "mlp") == ("llama", False, False, True)
    assert fused_as_before(model, ids)[2] == 2  # o_proj's add fused in both layers, the logits as before


def test_an_moe_block_that_returns_a_tuple_where_the_probe_saw_a_tensor_is_an_error():
    model, ids = model_and_ids(layer=MoELayer)
    assert hgemm_fuse.fuse(model, TorchOps)["o_residual"] == 2
    model.layers[0].mlp.__class__ = TupleExperts  # swapped after the probe (a layer's steps cannot take a tuple)
    with torch.no_grad(), pytest.raises(RuntimeError, match="TupleExperts's output is not what its layer took"):
        model(ids)
    model.layers[0].mlp.__class__ = Experts
    hgemm_fuse.unfuse(model)


class CrossAttention(Attention):
    """k and v from another input of the same width (an encoder's states): each runs its own rows of the merge."""

    def forward(self, hidden_states, context):
        return self.q_proj(hidden_states) + self.k_proj(context) * self.v_proj(context)


class ValueFirstAttention(Attention):
    def forward(self, hidden_states):
        q, v = self.q_proj(hidden_states), self.v_proj(hidden_states)
        return q + self.k_proj(hidden_states) * v


def rows(calls) -> list:
    return [c[1][0] for c in calls]


def test_q_k_v_outside_decoder_layers_are_merged_and_q_runs_alone_once_a_product_goes_unused():
    torch.manual_seed(0)
    tower = nn.ModuleDict({"attn": CrossAttention(64, 4, 4, True), "self": ValueFirstAttention(64, 4, 4, True)})
    x, ctx = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    with torch.no_grad():
        ref, ref_self = tower.attn(x, ctx), tower.self(x)
        assert hgemm_fuse.fuse(tower, TorchOps)["qkv"] == 2
        TorchOps.calls = []
        assert torch.allclose(tower.self(x), ref_self, atol=1e-6) and rows(TorchOps.calls) == [192]  # v before k
        slot = hgemm_fuse.steps.slot
        for merged in (True, False):  # the first call's product goes unused by k and v: q alone from the second
            TorchOps.calls = []
            assert torch.allclose(tower.attn(x, ctx), ref, atol=1e-6)
            assert rows(TorchOps.calls) == [192 if merged else 64, 64, 64]
            assert slot(tower.attn.q_proj).x is None  # let go as soon as k read another input
        assert slot(tower.attn.q_proj).alone and not slot(tower.self.q_proj).alone
        assert slot(tower.attn.q_proj).x is None  # nothing held
    assert hgemm_fuse.unfuse(tower) == 2 and type(tower.attn.q_proj) is nn.Linear


class UnrecordedOps:
    """PyTorch's ops without TorchOps's record of calls (a list that grows makes dynamo recompile every call)."""

    linear = staticmethod(F.linear)


def test_a_compiled_cross_attention_recompiles_once_when_q_goes_alone():
    torch.manual_seed(0)
    tower = nn.ModuleDict({"attn": CrossAttention(64, 4, 4, True)})
    x, ctx = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    with torch.no_grad():
        ref = tower.attn(x, ctx)
        hgemm_fuse.fuse(tower, UnrecordedOps)
        compiled = torch.compile(tower.attn, fullgraph=True, backend=backend)
        assert all(torch.allclose(compiled(x, ctx), ref, atol=1e-6) for _ in range(4))
    assert len(graphs) == 2  # merged on the first call, q alone after it
    hgemm_fuse.unfuse(tower)


def test_projections_of_different_inputs_are_not_merged():
    model, ids = model_and_ids()
    for layer in model.layers:  # k and v read a wider input (as a cross-attention's would): q stays on its own
        attn = layer.self_attn
        attn.k_proj, attn.v_proj = nn.Linear(96, attn.k_proj.out_features), nn.Linear(96, attn.v_proj.out_features)
    assert hgemm_fuse.fuse(model, TorchOps)["qkv"] == 0
    hgemm_fuse.unfuse(model)


def test_a_layer_whose_heads_are_wider_than_its_hidden_size_fuses_its_adds():
    assert fused_as_before(*model_and_ids(layer=WideLayer)) == (2, 2, 2, 2)


def test_a_layer_that_requires_more_arguments_is_probed_with_them_as_none():
    torch.manual_seed(0)
    model, ids = PositionModel(layer=RequiredArgumentLayer).eval(), torch.randint(50, (2, 9))
    assert fused_as_before(model, ids)[2:] == (2, 2)


def test_phi3s_merged_gate_up_is_interleaved_in_place_and_put_back_bit_for_bit():
    model, ids = model_and_ids(layer=DropoutLayer)
    with torch.no_grad():
        ref = model(ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    size = storage_bytes(model)
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert (counts["qkv"], counts["gate_up"], counts["o_residual"], counts["down_residual"]) == (0, 2, 2, 2)
    assert storage_bytes(model) == size and model.layers[0].mlp.gate_up_proj.weight.numel() == 0
    TorchOps.calls = []
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    assert ("silu_mul", (192, 64)) in TorchOps.calls and ("residual", (64, 96)) in TorchOps.calls
    assert hgemm_fuse.unfuse(model) == 3
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert storage_bytes(model) == size


@pytest.mark.parametrize("mlp, fused", [
    (SubNormMLP, (2, 0, 2, 2)),  # not down(act(gate) * up), but down_proj's output is the MLP's: the adds fuse
    (ScaledOutputMLP, (2, 0, 2, 0)),  # down(act(gate) * up) scaled after down_proj: neither gate/up nor down's add
])
def test_an_mlp_whose_steps_are_not_llamas_keeps_what_they_change(mlp, fused):
    model, ids = model_and_ids()
    for layer in model.layers:
        layer.mlp = mlp(64, 96, nn.SiLU())
    with torch.no_grad():
        ref = model(ids)
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert (counts["qkv"], counts["gate_up"], counts["o_residual"], counts["down_residual"]) == fused
    assert type(model.layers[0].mlp) is mlp
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    hgemm_fuse.unfuse(model)


def test_an_attention_that_changes_o_projs_output_is_an_error_not_a_wrong_answer():
    model, ids = model_and_ids()
    model.layers[0].self_attn = ScaledOutputAttention(64, 4, 2, False)
    assert hgemm_fuse.fuse(model, TorchOps)["o_residual"] == 2  # the layer's own steps are Llama's
    with torch.no_grad(), pytest.raises(RuntimeError, match="ScaledOutputAttention returns something other than"):
        model(ids)
    assert hgemm_fuse.steps.slot(model.layers[0].self_attn.o_proj).residual is None  # nothing left for the next call
    hgemm_fuse.unfuse(model)


def compiles_whole(model: nn.Module, x: torch.Tensor, tolerance: float = 1e-5) -> None:
    """Fuses the model with PyTorch's ops behind custom ops (as the export's op is traced), checks that
    torch.compile(fullgraph=True) runs it and gives the unfused model's output, and unfuses it."""
    with torch.no_grad():
        ref = model(x)
        hgemm_fuse.fuse(model, OpaqueOps)
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert torch.allclose(out, ref, atol=tolerance, rtol=tolerance)
    hgemm_fuse.unfuse(model)


class NormCountingOps(OpaqueOps):
    """OpaqueOps that lists each norm_linear call as traced (torch.compile runs the ops' Python once, tracing)."""

    traced: list = []

    @classmethod
    def norm_linear(cls, x, norm_w, eps, kind, w, bias, epilogue, residual=None):
        cls.traced.append((epilogue, tuple(w.shape)))
        return super().norm_linear(x, norm_w, eps, kind, w, bias, epilogue, residual)


def test_compiled_q_k_v_run_the_norm_before_them_and_the_norms_own_kernel_is_dropped():
    model, ids = model_and_ids()
    with torch.no_grad():
        ref = model(ids)
        assert hgemm_fuse.fuse(model, NormCountingOps)["norm_qkv"] == 2
        NormCountingOps.traced = []
        model(ids)
        assert NormCountingOps.traced == [("silu_mul", (192, 64))] * 2  # eager: the MLP's fold only
        NormCountingOps.traced = []
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        try:
            compiled(ids)
            assert set(NormCountingOps.traced) == {("none", (128, 64)), ("silu_mul", (192, 64))}
            TorchOps.calls = []
            out = compiled(ids)
        finally:
            hgemm_fuse.unfuse(model)  # a failure here leaves no fused model for the next test's collection
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    # as run: each norm once (no norm computed for q/k/v and again inside their call), the final one after the layers
    layer = [("rms_norm", (64,)), ("none", (128, 64)), ("residual", (64, 64)), ("rms_norm", (64,)),
             ("silu_mul", (192, 64)), ("residual", (64, 96))]
    assert TorchOps.calls == layer + layer + [("rms_norm", (64,))]


class DropoutAttention(Attention):
    """StarCoder2's attention: a dropout after o_proj (its input itself when evaluating, a new tensor when traced)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        out, _ = super().forward(hidden_states, attention_mask, **kwargs)
        return F.dropout(out, 0.1, self.training), None


class DropoutAttentionLayer(Layer):
    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        self.self_attn = DropoutAttention(hidden, 4, 2, bias)


@pytest.mark.parametrize("layer", [Layer, PostNormLayer, MoELayer, DropoutAttentionLayer, "plain"])
def test_a_fused_model_compiles_whole(layer):
    compiles_whole(*(plain_model(nn.GELU(), ("up_proj", "down_proj"), p=0.1) if layer == "plain" else
                     model_and_ids(layer=layer)))


class WrittenGELU(nn.Module):
    """The tanh GELU written out in the model's dtype, as transformers' NewGELUActivation computes it."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class ReLUSquared(nn.Module):
    def forward(self, x):
        return torch.square(F.relu(x))


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class PlainMLP(nn.Module):
    """Phi's and GPT-NeoX's MLP: second(act(first(x))), a dropout after the activation; `names` its projections'."""

    def __init__(self, hidden, inter, act, names=("fc1", "fc2"), p=0.0):
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(hidden, inter))
        self.act, self.drop = act, nn.Dropout(p)
        setattr(self, names[1], nn.Linear(inter, hidden))

    def forward(self, x):
        return getattr(self, self.names[1])(self.drop(self.act(getattr(self, self.names[0])(x))))


class ParallelLayer(nn.Module):
    """A layer's attention and MLP on the same normed input, both added to it."""

    def __init__(self, layer: Layer):
        super().__init__()
        self.self_attn, self.mlp, self.input_layernorm = layer.self_attn, layer.mlp, layer.input_layernorm

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        h = self.input_layernorm(hidden_states)
        return hidden_states + self.self_attn(h, attention_mask)[0] + self.mlp(h)


def plain_model(act, names=("fc1", "fc2"), p=0.0):
    model, ids = model_and_ids()
    for layer in model.layers:
        layer.mlp = PlainMLP(64, 96, act, names, p)
    return model.eval(), ids


def test_each_activation_the_epilogues_compute_is_recognised_by_what_it_computes():
    for act, name in [(nn.ReLU(inplace=True), "relu"), (nn.SiLU(), "silu"), (nn.GELU(), "gelu"),
                      (nn.GELU(approximate="tanh"), "gelu_tanh"), (WrittenGELU(), "gelu_tanh"),
                      (ReLUSquared(), "relu2")]:
        assert recognise.activation(act, epilogue) == name, act
    for other in (QuickGELU(), nn.Tanh(), nn.PReLU(), nn.Identity(), nn.Linear(4, 4), nn.Softmax(-1)):
        assert recognise.activation(other, epilogue) is None, other
    assert recognise.gated_epilogue(WrittenGELU(), epilogue) == "gelu_mul"
    assert recognise.gated_epilogue(nn.GELU(), epilogue) is None  # no erf-GELU gated epilogue


@pytest.mark.parametrize("act, name", [(nn.GELU(), "gelu"), (WrittenGELU(), "gelu_tanh"), (ReLUSquared(), "relu2")])
@pytest.mark.parametrize("names, parallel", [(("fc1", "fc2"), False), (("up_proj", "down_proj"), False),
                                             (("fc1", "fc2"), True)])
def test_a_plain_mlp_runs_its_activation_in_its_first_gemm(act, name, names, parallel):
    model, ids = plain_model(act, names)
    if parallel:  # Phi's and GPT-NeoX's steps: x + attn(norm(x)) + mlp(norm(x)), not Llama's
        for i, layer in enumerate(model.layers):
            model.layers[i] = ParallelLayer(layer)
    with torch.no_grad():
        ref = model(ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    counts = hgemm_fuse.fuse(model, TorchOps)
    # the MLP's second projection returned as its output in Llama's steps: the residual adds fuse too (StarCoder2's
    # naming, Nemotron's)
    adds = 0 if parallel else 2
    assert (counts["qkv"], counts["gate_up"], counts["mlp_act"], counts["o_residual"]) == (2, 0, 2, adds)
    assert type(model.layers[0].mlp) is not PlainMLP and isinstance(model.layers[0].mlp, PlainMLP)
    TorchOps.calls = []
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    assert TorchOps.calls.count((name, (96, 64))) == 2  # the first GEMM with its activation, once a layer
    assert "the activation in the GEMM before it" in hgemm_fuse.describe(model)[0]
    assert f"({name})" in hgemm_fuse.describe(model)[0]
    assert hgemm_fuse.unfuse(model) == 3 and type(model.layers[0].mlp) is PlainMLP
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids), ref)


def test_a_plain_mlp_with_a_dropout_runs_its_own_forward_in_training_mode():
    model, ids = plain_model(nn.GELU(), p=0.5)
    assert hgemm_fuse.fuse(model, TorchOps)["mlp_act"] == 2  # eval mode: the dropout is an identity
    model.train()
    TorchOps.calls = []
    with torch.no_grad():
        model(ids)
    assert ("gelu", (96, 64)) not in TorchOps.calls
    hgemm_fuse.unfuse(model)


def test_what_is_not_a_plain_mlp_stays_as_it_is():
    for act in (QuickGELU(), nn.Tanh()):  # activations no epilogue computes
        model, ids = plain_model(act)
        assert hgemm_fuse.fuse(model, TorchOps)["mlp_act"] == 0
        hgemm_fuse.unfuse(model)
    model, ids = plain_model(nn.GELU())
    model.layers[0].mlp.drop = nn.LayerNorm(96)  # a third step between the projections
    model.layers[1].mlp.forward = model.layers[1].mlp.forward  # a forward of its own
    assert hgemm_fuse.fuse(model, TorchOps)["mlp_act"] == 0
    hgemm_fuse.unfuse(model)
    model, ids = plain_model(nn.GELU(), p=0.5)
    model.train()  # a dropout that is no identity: the probe call does not match
    assert hgemm_fuse.fuse(model, TorchOps)["mlp_act"] == 0
    hgemm_fuse.unfuse(model)
    # outside any decoder layer: a Sequential that is second(act(first(x)))
    head = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = head(x)
        assert hgemm_fuse.fuse(head, TorchOps)["mlp_act"] == 1 and torch.allclose(head(x), ref, atol=1e-6)
    hgemm_fuse.unfuse(head)


def test_the_recorder_names_the_fused_problems(tmp_path):
    model, ids = model_and_ids(bias=True)
    model = model.half()
    with torch.no_grad(), record_gemm_shapes(tmp_path / "shapes.txt", model=model):
        model(ids)
    lines = [ln.split("#")[0].strip() for ln in (tmp_path / "shapes.txt").read_text().splitlines()
             if ln and not ln.startswith("#")]
    assert lines == ["18_128_64:nk:f16:bias", "18_64_64:nk:f16:residual", "18_192_64:nk:f16:silu_mul",
                     "18_64_96:nk:f16:residual"]  # lm_head's N = 50 is no kernel shape
    assert hgemm_fuse.describe(model) == []  # put back


class MatmulLinear(nn.Linear):
    """Falcon's FalconLinear: x @ W.T, the same values as F.linear."""

    def forward(self, x):
        return x @ self.weight.T


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 0.5


def test_a_linear_subclass_counts_as_plain_only_where_it_computes_f_linear():
    torch.manual_seed(0)
    assert recognise.plain_linear(nn.Linear(8, 16)) and recognise.plain_linear(MatmulLinear(8, 16, bias=False))
    assert not recognise.plain_linear(ScaledLinear(8, 16)) and not recognise.plain_linear(nn.Conv1d(8, 16, 1))
    model, ids = plain_model(nn.GELU())
    for layer in model.layers:  # Falcon's MLP: its projections are MatmulLinear
        mlp = layer.mlp
        for name in ("fc1", "fc2"):
            old = getattr(mlp, name)
            new = MatmulLinear(old.in_features, old.out_features, bias=False)
            setattr(mlp, name, new)
    with torch.no_grad():
        ref = model(ids)
    assert hgemm_fuse.fuse(model, TorchOps)["mlp_act"] == 2
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-5, rtol=1e-5)
    # a fused projection (its class runs a fusion's forward, here o_proj's with the residual) is not plain
    assert not recognise.plain_linear(model.layers[0].self_attn.o_proj)
    hgemm_fuse.unfuse(model)
    assert recognise.plain_linear(model.layers[0].self_attn.o_proj)


def test_the_recorder_names_a_plain_mlps_activation(tmp_path):
    model, ids = plain_model(nn.GELU(), ("up_proj", "down_proj"))
    model = model.half()
    with torch.no_grad(), record_gemm_shapes(tmp_path / "shapes.txt", model=model):
        model(ids)
    lines = [ln.split("#")[0].strip() for ln in (tmp_path / "shapes.txt").read_text().splitlines()
             if ln and not ln.startswith("#")]
    assert "18_96_64:nk:f16:bias:gelu" in lines and "18_64_96:nk:f16:bias:residual" in lines


class Olmo2RMSNorm(RMSNorm):
    """Olmo 2's (and GPT-OSS's): the weight times the fp32 value, rounded once."""

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_only_the_rms_norms_the_kernel_computes_are_recognised_and_they_are_bit_identical(dtype):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 40, dtype=dtype) * 4
    olmo = 0 if dtype == torch.float32 else 2  # in fp32 Olmo 2's rounding is Llama's
    for norm, kind in ((RMSNorm(40, eps=1e-5), 0), (GemmaRMSNorm(40, eps=1e-5), 1), (Olmo2RMSNorm(40, 1e-5), olmo)):
        norm = norm.to(dtype)
        assert recognise.rms_norm_of(norm) == (1e-5, kind), type(norm).__name__
        assert torch.equal(recognise.RMS_NORMS[kind](x, norm.weight, 1e-5), norm(x))
    for other in (HalfScaleNorm(40), WeightlessNorm(40), nn.LayerNorm(40), nn.Linear(40, 40)):
        assert recognise.rms_norm_of(other.to(dtype)) is None, type(other).__name__
    ones = WeightlessNorm(40)
    nn.init.ones_(ones.weight)  # the probe call puts a random weight in: a norm that ignores its weight is none
    assert recognise.rms_norm_of(ones) is None
    olmo = Olmo2RMSNorm(40).to(dtype)
    nn.init.ones_(olmo.weight)  # as initialised: with ones its rounding is Llama's, with the weights loaded later not
    assert recognise.rms_norm_of(olmo) == (1e-6, 0 if dtype == torch.float32 else 2)
    assert torch.equal(olmo.weight, torch.ones_like(olmo.weight))  # its own weight put back


def test_a_gemma_model_runs_its_norms_as_the_kernel_with_gemmas_rounding():
    model, ids = model_and_ids(norm=GemmaRMSNorm)
    with torch.no_grad():
        ref = model(ids)
    assert hgemm_fuse.fuse(model, TorchOps)["rms_norm"] == 5
    out, seen = forward_seeing_norms(model, ids)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5) and seen == [(1, False)] * 5
    hgemm_fuse.unfuse(model)


class MatmulRotary(nn.Module):
    """A rotary embedding as older transformers versions wrote it: the frequencies by a batched matmul of K = 1."""

    def __init__(self, dim: int = 16, scaling: float = 1.0, rope_type: str = "default"):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)
        self.attention_scaling, self.rope_type = scaling, rope_type

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv.float() @ position_ids[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class UnscaledRotary(MatmulRotary):
    """Forgets its scaling: not the same (cos, sin) where the scaling is not 1."""

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def test_a_rotary_embedding_computes_its_frequencies_by_broadcasting_bit_for_bit():
    model, ids = model_and_ids()
    model.rotary = MatmulRotary(scaling=0.75)
    model.others = nn.ModuleList([MatmulRotary(rope_type="dynamic"), UnscaledRotary(scaling=0.75)])
    x, pos = torch.randn(3, 6, 8).half(), torch.randint(0, 4096, (3, 6))
    want = model.rotary(x, pos)
    assert recognise.is_rotary(model.rotary) and recognise.is_rotary(UnscaledRotary())  # scaling 1: the same
    assert recognise.is_rotary(MatmulRotary().half())  # frequencies in the model's dtype (model.to(float16))
    counts = hgemm_fuse.fuse(model, TorchOps)
    assert counts["rotary"] == 1 and type(model.rotary).forward is hgemm_fuse.steps._rotary_forward
    assert type(model.rotary).__name__ == "MatmulRotary" and isinstance(model.rotary, MatmulRotary)
    assert all(type(m).forward is not hgemm_fuse.steps._rotary_forward for m in model.others)  # dynamic; unscaled
    got = model.rotary(x, pos)
    assert all(torch.equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want, strict=True))
    assert "rotary: rotary frequencies by broadcasting, no matmul" in hgemm_fuse.describe(model)
    hgemm_fuse.unfuse(model)
    assert type(model.rotary) is MatmulRotary and not any(n.startswith("_hgemm") for n in vars(model.rotary))


class MropeRotary(UnscaledRotary):
    """Qwen3.5's text rotary: positions in 3 rows (2-D positions broadcast to them), each frequency taken from the
    row its section names; on 2-D positions the plain rotary's (cos, sin), bit for bit."""

    def forward(self, x, position_ids):
        if position_ids.dim() == 2:
            position_ids = position_ids.expand(3, -1, -1)
        freqs = position_ids[..., None].float() * self.inv_freq  # 3 x batch x positions x dim / 2
        rows = torch.arange(freqs.shape[-1]) % 3
        freqs = freqs.gather(0, rows.expand(1, *freqs.shape[1:]))[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def test_a_rotary_embedding_given_positions_the_probe_did_not_try_runs_its_own_forward():
    model, ids = model_and_ids()
    model.rotary = MropeRotary()
    assert hgemm_fuse.fuse(model, TorchOps)["rotary"] == 1  # matches on 2-D positions
    x, pos = torch.randn(2, 6, 8).half(), torch.randint(0, 4096, (2, 6))
    rows = torch.stack([pos, pos + 7, pos * 2])  # an image's 3 rows of positions differ
    got, want = model.rotary(x, rows), MropeRotary.forward(model.rotary, x, rows)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) and got[0].shape == (2, 6, 16)
    assert all(torch.equal(g, w) for g, w in zip(model.rotary(x, pos), MropeRotary.forward(model.rotary, x, pos),
                                                 strict=True))
    hgemm_fuse.unfuse(model)


class ResidualScaleLayer(Layer):
    """Doge's steps: the residual scaled by a weight of the layer's own (ones at init) before each add."""

    def __init__(self, hidden, inter, act, bias, norm):
        super().__init__(hidden, inter, act, bias, norm)
        self.input_residual, self.post_attention_residual = nn.Parameter(torch.ones(hidden)), nn.Parameter(
            torch.ones(hidden))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs) -> torch.Tensor:
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask)
        h = self.input_residual * hidden_states + h
        return self.post_attention_residual * h + self.mlp(self.post_attention_layernorm(h))


def test_a_residual_scaled_by_a_weight_that_is_ones_at_init_keeps_its_adds():
    model, ids = model_and_ids(layer=ResidualScaleLayer)
    assert fused_as_before(model, ids)[2:] == (0, 0)  # neither add fused
    assert torch.equal(model.layers[0].input_residual, torch.ones(64))  # put back after the probe


def test_a_fused_model_deleted_without_unfuse_is_freed_with_what_its_modules_kept():
    model, ids = model_and_ids()
    slots = len(hgemm_fuse.steps._SLOTS)
    hgemm_fuse.fuse(model, TorchOps)
    with torch.no_grad():
        model(ids)
    layer = weakref.ref(model.layers[0])
    assert len(hgemm_fuse.steps._SLOTS) > slots
    del model
    gc.collect()
    assert layer() is None and len(hgemm_fuse.steps._SLOTS) == slots  # its weights and slots let go
