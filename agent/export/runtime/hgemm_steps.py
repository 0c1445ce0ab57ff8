"""The steps of a fused decoder layer (hgemm_fuse.py decides where, from hgemm_recognise.layer_steps): Llama's, with
its residual adds in the epilogues of o_proj and of the MLP's last projection; and a layer with norms after its
attention and MLP (Gemma 2's, Olmo 2's), with each add in the norm kernel before it. Shipped in an export beside
hgemm_fuse.py, which loads it; the forwards here run as the fused modules' class methods (hgemm_fuse's set_forward).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def _residual_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A projection that adds the residual its layer left on it (once), in the GEMM's epilogue; it keeps the sum
    for its layer to check that the sum is what the attention returns."""
    r = self._hgemm_residual
    if r is None:
        return self._hgemm_ops.linear(x, self.weight, self.bias)
    self._hgemm_residual = None
    self._hgemm_sum = self._hgemm_ops.fused_linear(x, self.weight, self.bias, "residual", r)
    return self._hgemm_sum


def _by_name(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> dict:
    """A fused layer's arguments besides the hidden states, by name, as the layer's own forward would pass them on."""
    if not args:
        return kwargs
    bound = self._hgemm_signature.bind(self, hidden_states, *args, **kwargs).arguments
    return {**{k: v for k, v in bound.items() if k not in ("self", "hidden_states", "kwargs")},
            **bound.get("kwargs", {})}


def _layer_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The decoder layer's steps with both residual adds left on o_proj and the MLP's last projection."""
    kwargs = _by_name(self, hidden_states, args, kwargs)
    attn, mlp = self.self_attn, self.mlp
    attn.o_proj._hgemm_residual = hidden_states
    out = attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    hidden = _summed(attn, attn.o_proj, out[0] if isinstance(out, tuple) else out)  # o_proj added the residual
    down = getattr(mlp, self._hgemm_down)
    down._hgemm_residual = hidden
    return _summed(mlp, down, mlp(self.post_attention_layernorm(hidden)))  # down added it


def _post_norm_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The steps of a decoder layer with norms after its attention and MLP (recognise.layer_steps's "post_norm"),
    each of those norms and the residual add after it in one call of ops.rms_norm."""
    kwargs = _by_name(self, hidden_states, args, kwargs)
    (eps1, kind1), (eps2, kind2) = self._hgemm_norms
    pre = getattr(self, "input_layernorm", None)
    out = self.self_attn(hidden_states=hidden_states if pre is None else pre(hidden_states), **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    h = self._hgemm_ops.rms_norm(out, self.post_attention_layernorm.weight, eps1, kind1, hidden_states)
    pre = getattr(self, "pre_feedforward_layernorm", None)
    out = self.mlp(h if pre is None else pre(h))
    return self._hgemm_ops.rms_norm(out, self.post_feedforward_layernorm.weight, eps2, kind2, h)


def _summed(block: nn.Module, proj: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """`out`, the block's output, after checking that it is the sum its projection computed (a block that changes
    its projection's output, or does not call it, would have the residual added in the wrong place or not at all)."""
    if out is not proj._hgemm_sum:
        proj._hgemm_residual = None
        raise RuntimeError(f"hgemm: {type(block).__name__} returns something other than its {type(proj).__name__}'s "
                           "output with the residual fused into it; patch this model with fuse=False")
    proj._hgemm_sum = None
    return out


def residuals(layer, module: nn.Module, ops, down: str) -> None:
    """The layer's residual adds in the epilogues of o_proj and of its MLP's last projection `down` (`layer`:
    hgemm_fuse's _Layer, which records what changed)."""
    for proj in (module.self_attn.o_proj, getattr(module.mlp, down)):
        layer.set_forward(proj, _residual_forward, ops=ops, residual=None, sum=None)
    layer.set_forward(module, _layer_forward, signature=inspect.signature(type(module).forward), down=down)
    layer.kinds += ["o_residual", "down_residual"]


def post_norms(layer, module: nn.Module, ops, norms: list) -> None:
    """The layer's norms after its attention and MLP with the residual adds after them in one ops.rms_norm call each
    (`norms`: each norm's recognise.rms_norm_of)."""
    layer.set_forward(module, _post_norm_forward, ops=ops, signature=inspect.signature(type(module).forward),
                      norms=norms)
    layer.kinds.append("norm_residual")
