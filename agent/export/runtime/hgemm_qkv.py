"""q, k and v as one GEMM, patched into an attention in place (hgemm_fuse.py decides where): the three projections'
weights (and biases) merged into one buffer whose slices their parameters become (one copy), q's forward running
the merged GEMM and k's and v's taking their columns of its product where they are called on the same input.
Shipped in an export beside hgemm_fuse.py, which loads it; the forward runs as the projections' class method
(hgemm_fuse's set_forward).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

steps = sys.modules[__name__.replace("__hgemm_qkv", "__hgemm_steps")]  # hgemm_fuse loads it first


class _Product:
    """What q, k and v's forwards share as they run (their slot, steps.slot): the last merged product and its input,
    which of k (1) and v (2) have yet to take their columns of it (`left`), and whether q runs alone (`alone`: a
    product went unused, as a cross-attention's does, whose k and v read another input or are cached); `norm`, set
    by a fused layer for its attention's call under torch.compile: (normed, x, weight, eps, kind), the RMSNorm's
    output the attention was given and what it was computed from (steps._layer_forward)."""

    def __init__(self):
        self.x = self.y = self.norm = None
        self.left, self.alone = 0, False


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    """q's forward runs the merged GEMM (its `_hgemm_weight` and `_hgemm_bias`) and keeps its product; k's and v's
    take their columns of it (`_hgemm_lo` to `_hgemm_hi`) when their input is the same tensor (the product is let go
    once both have), else run their own rows (their parameters, views of the merged ones). Where a product goes
    unused (k or v called on another input, or q again before both took theirs), it is let go and q runs its own
    rows from then on. Where its layer has left the norm q's input came from (`norm`), q runs the norm and the
    merged GEMM in one ops.norm_linear call."""
    shared, index, lo, hi = steps.slot(self), self._hgemm_index, self._hgemm_lo, self._hgemm_hi
    if shared.x is not None and (index == 0 or shared.x is not x or not shared.left & index):
        shared.x = shared.y = None
        shared.alone = True
    if index == 0 and not shared.alone:
        ops, norm = steps.ops_of(self), shared.norm
        if norm is not None and norm[0] is x:  # x is its layer's norm of norm[1]: the norm inside the GEMM's call
            y = ops.norm_linear(norm[1], norm[2], norm[3], norm[4], self._hgemm_weight, self._hgemm_bias, "none")
        else:
            y = ops.linear(x, self._hgemm_weight, self._hgemm_bias)
        shared.x, shared.y, shared.left = x, y, 3
        return shared.y[..., lo:hi]
    if index and shared.x is x:  # k or v on q's input, its columns not taken yet
        y = shared.y
        shared.left &= ~index
        if not shared.left:
            shared.x = shared.y = None
        return y[..., lo:hi]
    return steps.ops_of(self).linear(x, self.weight, self.bias)


def merge(layer, attn: nn.Module, ops, names: tuple[str, str, str]) -> bool:
    """q, k and v (the attention's children `names`) as one GEMM on their merged weight and biases, which their
    parameters become views of (`layer`: hgemm_fuse's _Layer, which records what changed); whether it merged them."""
    q, k, v = (getattr(attn, n) for n in names)
    biases = [p.bias for p in (q, k, v)]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return False
    if len({(p.in_features, p.weight.dtype, p.weight.device) for p in (q, k, v)}) > 1:  # not one input's projections
        return False
    weight = torch.cat([p.weight.detach() for p in (q, k, v)])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    sizes = [p.weight.shape[0] for p in (q, k, v)]
    bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(3)]
    attn.register_buffer("hgemm_qkv_weight", weight, persistent=False)
    attn.register_buffer("hgemm_qkv_bias", bias, persistent=False)
    slot = _Product()  # q's; k and v share it by its key
    for i, (p, (lo, hi)) in enumerate(zip((q, k, v), bounds, strict=True)):
        p.weight.data = weight[lo:hi]  # one copy: the parameters become views of the merge
        if p.bias is not None:
            p.bias.data = bias[lo:hi]
        merged = {"weight": weight, "bias": bias} if i == 0 else {}  # q runs the merged GEMM
        layer.set_forward(p, _forward, ops=ops, slot=slot, index=i, lo=lo, hi=hi, **merged)
        slot = p._hgemm_slot

    def restore():
        for p in (q, k, v):  # their own storage again, the same values
            p.weight.data = p.weight.data.clone()
            if p.bias is not None:
                p.bias.data = p.bias.data.clone()
        del attn.hgemm_qkv_weight, attn.hgemm_qkv_bias

    layer.restore.append(restore)
    layer.kinds.append("qkv")
    return True
