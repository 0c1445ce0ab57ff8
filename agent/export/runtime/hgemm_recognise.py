"""Recognising what hgemm_fuse.py fuses in a Hugging Face model: decoder layers built as Llama's, MLPs that are
down(act(gate(x)) * up(x)) (gate and up as two projections or one), Llama-style RMSNorms and rotary embeddings.
Each is recognised by its modules' names and types and by probe calls that must give the same values bit for bit as
the steps the fused forwards run, not by its class: a model built otherwise (Gemma2's extra norms, Granite's
residual multiplier, Gemma's 1 + weight) keeps its own code there. Shipped in an export beside hgemm_fuse.py, which
loads it.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def gated_epilogue(act: nn.Module) -> str | None:
    """The gated epilogue of an MLP whose activation is `act`: silu_mul, gelu_mul (tanh GELU), or None."""
    name = type(act).__name__
    if isinstance(act, nn.SiLU) or name in ("SiLUActivation", "SiLU"):
        return "silu_mul"
    if (isinstance(act, nn.GELU) and act.approximate == "tanh") or "GELUTanh" in name or name == "PytorchGELUTanh":
        return "gelu_mul"
    return None


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, op for op: x in fp32 times rsqrt(mean(x^2) + eps), rounded to x's dtype,
    times weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _probe_input(like: torch.Tensor, *shape: int, scale: float = 2.0) -> torch.Tensor:
    """Seeded random values of `shape` on `like`'s device and in its dtype, large enough that functions bend on them."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    return (torch.randn(*shape, generator=gen) * scale).to(device=like.device, dtype=like.dtype)


def rms_norm_eps(m: nn.Module) -> float | None:
    """The epsilon of a module that computes Llama's RMSNorm with its one parameter `weight` (checked by a probe
    call against llama_rms_norm: the same values bit for bit), or None."""
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    w = getattr(m, "weight", None)
    if (not isinstance(eps, float) or not isinstance(w, nn.Parameter) or w.dim() != 1 or w.numel() == 0
            or w.is_meta or "forward" in m.__dict__ or list(m.children()) or len(list(m.parameters())) != 1):
        return None
    x = _probe_input(w, 3, w.numel(), scale=3.0)
    try:
        with torch.no_grad():
            out = type(m).forward(m, x)
    except Exception:  # a forward that takes more than one tensor, or not this one
        return None
    ref = llama_rms_norm(x, w.detach(), eps)
    return eps if isinstance(out, torch.Tensor) and out.dtype == ref.dtype and torch.equal(out, ref) else None


def rotary_cos_sin(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama-style rotary embedding's (cos, sin) in x's dtype: the frequencies position x inv_freq in fp32 by
    broadcasting (one rounding a product, as the matmul of K = 1 gives them), twice over, times `scaling`."""
    freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def is_rotary(m: nn.Module) -> bool:
    """Whether `m` is a rotary embedding whose forward(x, position_ids) gives rotary_cos_sin's (cos, sin) bit for
    bit (a probe call on its device), with fixed frequencies (`inv_freq`, in fp32 or the model's dtype) and
    `attention_scaling`."""
    inv, scaling = getattr(m, "inv_freq", None), getattr(m, "attention_scaling", None)
    if (not isinstance(inv, torch.Tensor) or inv.dim() != 1 or not inv.is_floating_point() or inv.is_meta
            or isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or "forward" in m.__dict__
            or list(m.children()) or any(k in str(getattr(m, "rope_type", "")) for k in ("dynamic", "longrope"))):
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    pos = torch.randint(0, 8192, (2, 5), generator=gen).to(inv.device)
    x = torch.randn(2, 5, 2 * inv.numel(), generator=gen).to(device=inv.device, dtype=torch.float16)
    try:
        with torch.no_grad():
            out = type(m).forward(m, x, pos)
    except Exception:  # another signature
        return False
    ref = rotary_cos_sin(x, pos, inv, scaling)
    return isinstance(out, tuple) and len(out) == 2 and all(
        isinstance(o, torch.Tensor) and o.dtype == r.dtype and o.shape == r.shape and torch.equal(o, r)
        for o, r in zip(out, ref, strict=True))


def plain_linear(m) -> bool:
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and "forward" not in m.__dict__


def act_of(mlp: nn.Module) -> nn.Module | None:
    """The MLP's activation: `act_fn` (Llama's name) or `activation_fn` (Phi-3's)."""
    act = getattr(mlp, "act_fn", None)
    return act if act is not None else getattr(mlp, "activation_fn", None)


def probe_mlp(mlp: nn.Module) -> tuple[str | None, bool]:
    """One call of the MLP's own forward on random input, with a hook on down_proj: how it holds its gate and up
    projections where it computes down(act(gate(x)) * up(x)) (the same values bit for bit): "pair" (gate_proj and
    up_proj, Llama's), "merged" (one gate_up_proj whose rows are gate's, then up's, Phi-3's) or None; and whether it
    returns down_proj's output as it is (the output object itself), so that a residual added in down_proj's epilogue
    is what the layer adds."""
    act, down = act_of(mlp), mlp.down_proj
    steps = None
    if act is not None and plain_linear(getattr(mlp, "gate_proj", None)) and plain_linear(getattr(mlp, "up_proj",
                                                                                                   None)):
        kind, first = "pair", mlp.gate_proj

        def steps(x):
            return down(act(mlp.gate_proj(x)) * mlp.up_proj(x))
    elif (act is not None and plain_linear(getattr(mlp, "gate_up_proj", None))
          and mlp.gate_up_proj.out_features % 2 == 0):
        kind, first = "merged", mlp.gate_up_proj

        def steps(x):
            gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
            return down(act(gate) * up)
    else:
        kind, first = None, next(m for m in (getattr(mlp, "up_proj", None), down) if plain_linear(m))
    if first.weight.is_meta:
        return None, False
    x, seen = _probe_input(first.weight, 3, first.in_features), []
    hook = down.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        out = type(mlp).forward(mlp, x)
    except Exception:  # another signature
        return None, False
    finally:
        hook.remove()
    if not isinstance(out, torch.Tensor):
        return None, False
    returns_down = len(seen) == 1 and out is seen[0]
    if steps is None:
        return None, returns_down
    ref = steps(x)
    return (kind if out.dtype == ref.dtype and torch.equal(out, ref) else None), returns_down


class _Stand(nn.Module):
    """A stand-in for a decoder layer's attention (a pair, as attentions return) or MLP in `layer_is_llama`'s probe:
    a fixed elementwise function of its input."""

    def __init__(self, scale: float, pair: bool):
        super().__init__()
        self.scale, self.pair = scale, pair

    def forward(self, *args, **kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        y = torch.tanh(x) * self.scale + 0.25
        return (y, None) if self.pair else y


def layer_is_llama(layer: nn.Module) -> bool:
    """Whether the decoder layer's own forward returns x + attn(norm1(x)) and then h + mlp(norm2(h)) as one tensor,
    Llama's steps, which hgemm_fuse's `_layer_forward` runs with the adds fused: its forward called with the attention
    and the MLP stood in for by fixed functions (_Stand), against those steps, bit for bit. Arguments the forward
    requires besides the hidden states (position embeddings, in some transformers versions) are given as None: the
    layer passes them on to the stand-ins, which ignore them."""
    o_proj = layer.self_attn.o_proj
    if o_proj.weight.is_meta:
        return False
    x = _probe_input(o_proj.weight, 2, 3, o_proj.out_features)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = {q.name: None for q in list(inspect.signature(type(layer).forward).parameters.values())[2:]
                if q.default is inspect.Parameter.empty and q.kind in named}
    attn, mlp = _Stand(1.5, pair=True), _Stand(-0.75, pair=False)
    saved = layer._modules["self_attn"], layer._modules["mlp"]
    layer._modules["self_attn"], layer._modules["mlp"] = attn, mlp
    try:
        out = type(layer).forward(layer, x, **required)
        h = x + attn(hidden_states=layer.input_layernorm(x))[0]
        ref = h + mlp(layer.post_attention_layernorm(h))
    except Exception:  # a forward that needs more than its input, or other modules' outputs
        return False
    finally:
        layer._modules["self_attn"], layer._modules["mlp"] = saved
    return isinstance(out, torch.Tensor) and out.dtype == ref.dtype and torch.equal(out, ref)


def decoder_layers(model: nn.Module):
    """(name, module) of every decoder layer `fuse` looks into: a module with an attention (`self_attn`), usually an
    MLP (`mlp`) beside it, none with a forward of its own; what in it is fused is each part's own test (q/k/v: plain
    q_proj, k_proj, v_proj; gate/up: probe_mlp, where the MLP has a plain down_proj; the residual adds: llama_parts
    and layer_is_llama). Layers that are not Llama's (norms after the attention, an MoE block for the MLP) may still
    have their q/k/v or gate/up fused."""
    for name, m in model.named_modules():
        attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
        if not isinstance(attn, nn.Module):
            continue
        if any("forward" in x.__dict__ for x in (m, attn, mlp) if x is not None):  # a forward of its own (a hook's)
            continue                                                                # would shadow ours
        yield name, m


def llama_parts(layer: nn.Module) -> bool:
    """Whether the layer has the parts Llama's steps name: o_proj and down_proj (plain nn.Linear), input_layernorm
    and post_attention_layernorm."""
    projections = getattr(layer.self_attn, "o_proj", None), getattr(getattr(layer, "mlp", None), "down_proj", None)
    norms = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
    return all(plain_linear(p) for p in projections) and all(isinstance(n, nn.Module) for n in norms)
