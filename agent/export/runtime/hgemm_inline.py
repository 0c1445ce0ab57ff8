"""An activation a layer applies inline to one of its Linear children's output (BART's, OPT's, Whisper's, XGLM's
`activation_fn(fc1(x))`, written in the layer's own forward, not in an MLP module), moved into that Linear's GEMM
epilogue: the Linear runs `ops.fused_linear(x, W, b, act)` and the activation child becomes an identity. Decided by
probe calls of the layer's own forward (its attentions stood in for), before and after the move, the same values
bit for bit. Shipped in an export beside hgemm_fuse.py, which loads it after hgemm_recognise.py and hgemm_steps.py.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

recognise = sys.modules[__name__.replace("__hgemm_inline", "__hgemm_recognise")]  # hgemm_fuse loads them first
steps = sys.modules[__name__.replace("__hgemm_inline", "__hgemm_steps")]


class _Folded(nn.Module):
    """The probe's stand-in for a Linear with the activation moved into it."""

    def __init__(self, linear: nn.Linear, act: nn.Module):
        super().__init__()
        self.linear, self.act = linear, act

    def forward(self, x):
        return self.act(self.linear(x))


def _first(out):
    return out[0] if isinstance(out, tuple) and out else out


def inline_activation(layer: nn.Module, epilogue) -> tuple[str, str, str] | None:
    """(linear, activation, epilogue name) of a layer with one activation child the epilogues compute
    (recognise.activation) that its own forward applies once, right to that plain Linear child's output and nowhere
    else: the layer's output with the activation moved into the Linear equals its own, bit for bit, on a probe call
    with its attentions (children with q/k/v projections) stood in for; or None."""
    children = dict(layer.named_children())
    linears = [n for n, c in children.items() if recognise.plain_linear(c) and not c.weight.is_meta]
    acts = [(n, name) for n, c in children.items() if n not in linears and (name := recognise.activation(c, epilogue))]
    attns = [n for n, c in children.items() if recognise.qkv_names(c) or n in steps.ATTENTIONS]
    if len(acts) != 1 or not linears or not attns or "forward" in layer.__dict__:
        return None
    act_name, epi = acts[0]
    required = steps.required_args(layer)
    widths = {children[n].in_features for n in linears}
    with steps.stood_in(layer, {n: steps._Stand(1.5, pair=True) for n in attns}):
        for width in widths:
            x = recognise.probe_input(children[linears[0]].weight, 2, 3, width)
            ref = _call(layer, x, required)
            if ref is None:  # another input width, or a forward that needs more than its input
                continue
            calls = [(required, ref)]
            if "encoder_hidden_states" in inspect.signature(type(layer).forward).parameters:
                # a decoder layer's cross-attention branch too, where the layer has one (one without raises there,
                # as it would in use)
                given = required | {"encoder_hidden_states": x * 0.5}
                if (crossed := _call(layer, x, given)) is not None:
                    calls.append((given, crossed))
            if not all(isinstance(ref, torch.Tensor) for _, ref in calls):
                return None
            for name in linears:
                if all(_folded_equal(layer, name, act_name, x, given, ref) for given, ref in calls):
                    return name, act_name, epi
    return None


def _call(layer: nn.Module, x: torch.Tensor, given: dict):
    """The layer's output (its first, where a tuple) on x, or None where its forward raises."""
    try:
        return _first(type(layer).forward(layer, x, **given))
    except Exception:
        return None


def _folded_equal(layer: nn.Module, name: str, act_name: str, x: torch.Tensor, given: dict, ref: torch.Tensor) -> bool:
    """Whether the layer's output on x with the activation moved into the Linear `name` is `ref`, bit for bit."""
    linear, act = layer._modules[name], layer._modules[act_name]
    layer._modules[name], layer._modules[act_name] = _Folded(linear, act), nn.Identity()
    try:
        out = _call(layer, x, given)
    finally:
        layer._modules[name], layer._modules[act_name] = linear, act
    return isinstance(out, torch.Tensor) and out.dtype == ref.dtype and torch.equal(out, ref)


def _act_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    return steps.ops_of(self).fused_linear(x, self.weight, self.bias, self._hgemm_epilogue, None)


def fold(layer, module: nn.Module, ops, found: tuple[str, str, str]) -> None:
    """The activation `found` names moved into its Linear's epilogue (`layer`: hgemm_fuse's _Layer)."""
    linear, act_name, epilogue = found
    act = module._modules[act_name]
    layer.set_forward(module._modules[linear], _act_linear_forward, ops=ops, epilogue=epilogue)
    module._modules[act_name] = nn.Identity()

    def restore():
        module._modules[act_name] = act

    layer.restore.append(restore)
    layer.kinds.append("mlp_act")
    layer.epilogues.append(epilogue)
