"""A decoder layer's steps: recognised by probe calls with its attention and MLP stood in for (`layer_steps`), and
run fused: Llama's, with its residual adds in the epilogues of o_proj and of the MLP's last projection (o_proj's
alone where the MLP is an MoE block); and a layer with norms after its attention and MLP (Gemma 2's, Olmo 2's),
with each add in the norm kernel before it (other layers' adds: hgemm_adds.py). Shipped in an export beside
hgemm_fuse.py, which loads it after hgemm_recognise.py; the forwards here run as the fused modules' class methods
(hgemm_fuse's set_forward).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import sys

import torch
from torch import nn

recognise = sys.modules[__name__.replace("__hgemm_steps", "__hgemm_recognise")]  # hgemm_fuse loads it first


class _Stand(nn.Module):
    """A stand-in for a decoder layer's attention (a pair, as attentions return: its output and `extra`, an object
    of its own) or MLP in the probes of a layer's steps: a fixed elementwise function of its input; `flat`: its
    rows as one matrix (tokens x hidden, as MoE blocks return them). It keeps each call's arguments (`calls`)."""

    def __init__(self, scale: float, pair: bool, flat: bool = False):
        super().__init__()
        self.scale, self.pair, self.flat, self.extra, self.calls = scale, pair, flat, object(), []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        y = torch.tanh(x) * self.scale + 0.25
        y = y.reshape(-1, y.shape[-1]) if self.flat else y
        return (y, self.extra) if self.pair else y


def required_args(layer: nn.Module) -> dict:
    """The arguments the layer's forward requires besides its input, each None (for a probe call)."""
    return {q.name: None for q in list(inspect.signature(type(layer).forward).parameters.values())[2:]
            if q.default is inspect.Parameter.empty and q.kind in NAMED}


@contextlib.contextmanager
def distinct_weights(layer: nn.Module, skip: tuple):
    """The layer's parameters but those of its children `skip` (the stood-in attention and MLP) given random values
    of their own while the block runs, then put back bit for bit: at init a model's norms all hold ones (and zeros),
    so a probe call could not tell which norm the layer applies where, nor see a scale of ones on a residual."""
    params = [q for n, q in layer.named_parameters()
              if n.split(".")[0] not in skip and q.is_floating_point() and not q.is_meta]
    kept = [q.detach().clone() for q in params]
    gen = torch.Generator().manual_seed(7)
    try:
        with torch.no_grad():
            for q in params:
                q.copy_(torch.rand(q.shape, generator=gen) + 0.5)
        yield
    finally:
        with torch.no_grad():
            for q, k in zip(params, kept, strict=True):
                q.copy_(k)


@contextlib.contextmanager
def stood_in(layer: nn.Module, stands: dict):
    """The layer's children named in `stands` replaced by those modules (probe stand-ins) while the block runs, and
    whatever the block puts under those names then replaced by the children again."""
    saved = {n: layer._modules[n] for n in stands}
    layer._modules.update(stands)
    try:
        yield
    finally:
        layer._modules.update(saved)


NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)  # arguments a call can name
# a decoder layer's attention (or linear attention: a hybrid model's other layers), by its names
ATTENTIONS = ("self_attn", "attn", "attention", "self_attention", "linear_attn")
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def attention_name(module: nn.Module) -> str | None:
    """The name of the module's attention child (the first of ATTENTIONS it has), or None."""
    return next((n for n in ATTENTIONS if isinstance(getattr(module, n, None), nn.Module)), None)


def mlp_name(layer: nn.Module) -> str | None:
    """The name of the decoder layer's MLP (or MoE block): `mlp`, else its one child besides its attention, the
    norms its steps name and dropouts (Llama 4's `feed_forward`, Granite-MoE's `block_sparse_moe`), else None."""
    if isinstance(getattr(layer, "mlp", None), nn.Module):
        return "mlp"
    rest = [n for n, c in layer.named_children()
            if n not in ATTENTIONS and n not in NORMS and not isinstance(c, (nn.Dropout, nn.Identity))]
    return rest[0] if len(rest) == 1 else None


def layer_steps(layer: nn.Module, mlp: str = "mlp") -> tuple[str, bool, bool, bool] | None:
    """Whether the decoder layer's own forward runs Llama's steps, returning one tensor, with `mlp` the name of its MLP:
    ("llama", pair, flat, unpacks), x + attn(norm1(x)) and then h + mlp(norm2(h)) (input_layernorm,
    post_attention_layernorm), which `_layer_forward` runs with the adds in the epilogues of o_proj and of the MLP's
    last projection; `pair` where the layer takes the MLP's output only as a pair (output, router scores), `flat`
    where it takes it with its rows flat too (an MoE block's, which the layer reshapes), `unpacks` where it takes a
    pair, as well as a tensor or only (transformers 4's MoE layers unpack their block's pair if it is one); or None.
    Its forward is called with the attention and the MLP stood in for by fixed functions (_Stand; the MLP's output a
    tensor, then a pair, each of the layer's shape and flat: `flat` where the layer takes it flat, so reshapes it)
    and compared with those steps, bit for bit. Arguments the forward requires besides the hidden states (position
    embeddings, in some transformers versions) are given as None: the layer passes them on to the stand-ins, which
    ignore them."""
    o_proj = _probe_parts(layer, mlp)
    if o_proj is None:
        return None
    x = recognise.probe_input(o_proj.weight, 2, 3, o_proj.out_features)
    required = required_args(layer)
    attn, parts = _Stand(1.5, pair=True), ("self_attn", mlp)
    try:
        with stood_in(layer, {"self_attn": attn, mlp: _Stand(-0.75, False)}), distinct_weights(layer, parts):
            return _llama_match(layer, mlp, x, attn, required)
    except Exception:  # a forward that needs more than its input, or other modules' outputs
        return None


def _llama_match(layer: nn.Module, mlp: str, x: torch.Tensor, attn: _Stand, required: dict):
    """layer_steps's comparisons, the attention stood in for by `attn` already."""
    h = x + attn(hidden_states=layer.input_layernorm(x))[0]

    def matches(pair: bool, flat: bool) -> bool:
        layer._modules[mlp] = stand = _Stand(-0.75, pair, flat)
        try:
            out = type(layer).forward(layer, x, **required)
        except Exception:  # a forward that needs more than its input, or takes the MLP's output otherwise
            return False
        y = stand(layer.post_attention_layernorm(h))
        y = (y[0] if pair else y).view(h.shape)
        return isinstance(out, torch.Tensor) and out.dtype == x.dtype and torch.equal(out, h + y)
    for pair in (False, True):
        shaped, flat = matches(pair, False), matches(pair, True)
        if shaped or flat:
            return "llama", pair, flat, pair or matches(True, flat)
    return None


def _probe_parts(layer: nn.Module, mlp: str) -> nn.Linear | None:
    """The layer's self_attn.o_proj (whose weight makes a probe's input) where it is a plain nn.Linear with weights
    and the layer has the child `mlp`, else None."""
    o_proj = getattr(getattr(layer, "self_attn", None), "o_proj", None)
    if not isinstance(o_proj, nn.Linear) or o_proj.weight.is_meta or not isinstance(getattr(layer, mlp, None),
                                                                                     nn.Module):
        return None
    return o_proj


def post_norm_roles(layer: nn.Module, mlp: str = "mlp") -> tuple[str | None, str, str | None, str] | None:
    """The children of a decoder layer whose steps put a norm after its attention and after its MLP, each before
    its residual add: x + post_attn(attn(pre_attn(x))), then h + post_mlp(mlp(pre_mlp(h))), as (pre_attn,
    post_attn, pre_mlp, post_mlp), a pre norm None where there is none (Gemma 2's and 3's names; GLM-4's, its
    post_attention_layernorm before the MLP; Olmo 2's without pre norms), which `_post_norm_forward` runs with each
    add in the norm before it; or None. Found by one probe call of the layer's forward with its attention and MLP
    stood in for (_Stand) and its other children's weights random (distinct_weights: no two norms compute the
    same), compared bit for bit with every assignment of its children with a weight of the hidden size to the
    roles."""
    o_proj = _probe_parts(layer, mlp)
    if o_proj is None:
        return None
    hidden = o_proj.out_features
    names = [n for n, c in layer.named_children() if n not in ("self_attn", mlp) and isinstance(
        w := getattr(c, "weight", None), torch.Tensor) and w.shape == (hidden,) and not w.is_meta]
    if not 2 <= len(names) <= 6:
        return None
    x = recognise.probe_input(o_proj.weight, 2, 3, hidden)
    attn, stand, parts = _Stand(1.5, pair=True), _Stand(-0.75, pair=False), ("self_attn", mlp)
    try:
        with stood_in(layer, {"self_attn": attn, mlp: stand}), distinct_weights(layer, parts), torch.no_grad():
            out = type(layer).forward(layer, x, **required_args(layer))
            if not isinstance(out, torch.Tensor) or out.dtype != x.dtype:
                return None
            run = {n: getattr(layer, n) for n in names} | {None: lambda t: t}
            for (post_a, post_m), (pre_a, pre_m) in itertools.product(itertools.permutations(names, 2),
                                                                      itertools.product([None, *names], repeat=2)):
                roles = (pre_a, post_a, pre_m, post_m)
                used = [n for n in roles if n is not None]
                if len(used) != len(set(used)):
                    continue
                h = x + run[post_a](attn(hidden_states=run[pre_a](x))[0])
                if torch.equal(out, h + run[post_m](stand(run[pre_m](h)))):
                    return roles
    except Exception:  # a forward that needs more than its input, or other modules' outputs
        return None
    return None


def decoder_layers(model: nn.Module):
    """(name, module, its attention's name) of every decoder layer `fuse` looks into: a module with an attention
    (attention_name), usually an MLP (mlp_name) beside it, none with a forward of its own; what in it is fused is
    each part's own test (q/k/v: recognise.qkv_names; gate/up: probe_mlp; the residual adds: llama_parts and
    layer_steps, or hgemm_adds.residual_steps; the post-norms' adds: layer_steps and rms_norm_of). Layers whose
    steps are none of these may still have their q/k/v or gate/up fused."""
    for name, m in model.named_modules():
        attn_name = attention_name(m)
        if attn_name is None:
            continue
        attn, mlp = getattr(m, attn_name), getattr(m, mlp_name(m) or "", None)
        if any("forward" in x.__dict__ for x in (m, attn, mlp) if x is not None):  # a forward of its own (a hook's)
            continue                                                                # would shadow ours
        yield name, m, attn_name


def llama_parts(layer: nn.Module, mlp: str | None, down: str | None = "down_proj") -> bool:
    """Whether the layer has the parts Llama's steps name: o_proj and, unless `down` is None, the last projection
    `down` of its MLP `mlp` (plain nn.Linear), input_layernorm and post_attention_layernorm."""
    projections = [getattr(getattr(layer, "self_attn", None), "o_proj", None)]
    if down is not None:
        projections.append(getattr(getattr(layer, mlp or "", None), down, None))
    norms = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
    return all(recognise.plain_linear(p) for p in projections) and all(isinstance(n, nn.Module) for n in norms)


_OPS: dict = {}  # id(ops) -> ops, for every `ops` a module was fused with (kept alive)
_SLOTS: dict = {}  # key -> the state a fused module changes as it runs (Pending, hgemm_qkv's product)
_slot_keys = itertools.count()


def keep_ops(ops) -> int:
    """The key by which a fused module finds `ops` (`ops_of(module)`), kept from now on."""
    _OPS[id(ops)] = ops
    return id(ops)


def ops_of(module: nn.Module):
    """The `ops` `module` was fused with, by the key it holds (`_hgemm_ops_key`)."""
    return _OPS[module._hgemm_ops_key]


def keep_slot(state) -> int:
    """The key by which fused modules find `state`, an object they change as they run (`slot(module)`); dropped by
    `drop_slot` when they are put back."""
    key = next(_slot_keys)
    _SLOTS[key] = state
    return key


def slot(module: nn.Module):
    """The state `module` changes as it runs, by the key it holds (`_hgemm_slot`)."""
    return _SLOTS[module._hgemm_slot]


def drop_slot(key: int) -> None:
    _SLOTS.pop(key, None)


class Pending:
    """A projection's residual, left by its layer for the projection's next call, and the sum that call computed
    (which the layer checks)."""

    def __init__(self):
        self.residual = self.sum = None


def _residual_forward(self, x: torch.Tensor) -> torch.Tensor:
    """A projection (an nn.Linear or a Conv1D) that adds the residual its layer left for it (once, its slot's
    Pending), in the GEMM's epilogue; it keeps the sum for its layer to check that the sum is what the attention
    returns."""
    pending, w = slot(self), recognise.nk_weight(self)
    if pending.residual is None:
        return ops_of(self).linear(x, w, self.bias)
    r, pending.residual = pending.residual, None
    pending.sum = ops_of(self).fused_linear(x, w, self.bias, "residual", r)
    return pending.sum


def as_nk(layer, m: nn.Module) -> None:
    """A Conv1D's weight stored N x K (its parameter a transposed view of that, the same values, one copy) so that
    nk_weight is contiguous for the kernels; put back K x N by `unfuse` (`layer`: hgemm_fuse's _Layer)."""
    if isinstance(m, nn.Linear) or m.weight.t().is_contiguous():
        return
    m.weight.data = m.weight.data.t().contiguous().t()

    def restore():
        m.weight.data = m.weight.data.contiguous()

    layer.restore.append(restore)


def _by_name(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> dict:
    """A fused layer's arguments besides the hidden states, by name, as the layer's own forward would pass them on."""
    if not args:
        return kwargs
    bound = self._hgemm_signature.bind(self, hidden_states, *args, **kwargs).arguments
    return {**{k: v for k, v in bound.items() if k not in ("self", "hidden_states", "kwargs")},
            **bound.get("kwargs", {})}


def _layer_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The decoder layer's steps with both residual adds left on o_proj and the MLP's last projection; under
    torch.compile, where q/k/v are merged and input_layernorm is an RMSNorm ops.rms_norm runs (`_hgemm_qkv_norm`:
    q's name), q runs the norm inside its GEMM's call (hgemm_qkv._forward) when the attention gives it the norm's
    output, and the norm computed here goes unused unless the attention uses it otherwise."""
    kwargs = _by_name(self, hidden_states, args, kwargs)
    attn, mlp = self.self_attn, getattr(self, self._hgemm_mlp)
    slot(attn.o_proj).residual = hidden_states
    normed, product = self.input_layernorm(hidden_states), None
    if self._hgemm_qkv_norm and torch.compiler.is_compiling():  # q's merged GEMM runs the norm itself
        norm, product = self.input_layernorm, slot(getattr(attn, self._hgemm_qkv_norm))
        product.norm = (normed, hidden_states, norm.weight, norm._hgemm_eps, norm._hgemm_kind)
    out = attn(hidden_states=normed, **kwargs)
    if product is not None:
        product.norm = None  # nothing of this call kept: inductor drops the norm's own kernel where q ran it
    hidden = _summed(attn, attn.o_proj, out[0] if isinstance(out, tuple) else out)  # o_proj added the residual
    if self._hgemm_down is None:  # an MLP whose output is not its last projection's (an MoE block): its add as it was
        out = mlp(self.post_attention_layernorm(hidden))
        _, flat, unpacks = self._hgemm_mlp_output
        out = out[0] if unpacks and isinstance(out, tuple) else out
        if not isinstance(out, torch.Tensor) or (out.shape != hidden.shape and not flat):  # flat: the layer reshapes
            raise RuntimeError(f"hgemm: {type(mlp).__name__}'s output is not what its layer took when patched; "
                               "patch this model with fuse=False")
        return hidden + out.view(hidden.shape)
    down = getattr(mlp, self._hgemm_down)
    slot(down).residual = hidden
    if self._hgemm_fold:  # the norm inside gate/up's GEMM: the gated MLP's steps (hgemm_fuse._gate_up), inline
        norm = self.post_attention_layernorm
        y = ops_of(self).norm_linear(hidden, norm.weight, norm._hgemm_eps, norm._hgemm_kind,
                                     mlp.hgemm_gate_up_weight, mlp.hgemm_gate_up_bias, mlp._hgemm_epilogue, None)
        return _summed(mlp, down, down(y))
    return _summed(mlp, down, mlp(self.post_attention_layernorm(hidden)))  # down added it


def _post_norm_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The steps of a decoder layer with norms after its attention and MLP (post_norm_roles), each of those norms
    and the residual add after it in one call of ops.rms_norm."""
    kwargs = _by_name(self, hidden_states, args, kwargs)
    (eps1, kind1), (eps2, kind2) = self._hgemm_norms
    pre_attn, post_attn, pre_mlp, post_mlp = self._hgemm_roles
    out = self.self_attn(hidden_states=hidden_states if pre_attn is None else getattr(self, pre_attn)(hidden_states),
                         **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    h = ops_of(self).rms_norm(out, getattr(self, post_attn).weight, eps1, kind1, hidden_states)
    out = getattr(self, self._hgemm_mlp)(h if pre_mlp is None else getattr(self, pre_mlp)(h))
    return ops_of(self).rms_norm(out, getattr(self, post_mlp).weight, eps2, kind2, h)


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs) -> tuple:
    # not as the probe called it (Qwen3.5's 3 rows of positions for mrope; a layer type): the module's own forward
    if position_ids.dim() != 2 or args or kwargs:
        return self._hgemm_base.forward(self, x, position_ids, *args, **kwargs)
    return recognise.rotary_cos_sin(x, position_ids, self.inv_freq, self.attention_scaling)


def _norm_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if args or kwargs:  # more than the probe gave it (a Mamba-2 mixer's gated norm, with its gate): its own forward
        return self._hgemm_base.forward(self, x, *args, **kwargs)
    return ops_of(self).rms_norm(x, self.weight, self._hgemm_eps, self._hgemm_kind)


def _summed(block: nn.Module, proj: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """`out`, the block's output, after checking that it is the sum its projection computed (a block that changes
    its projection's output, or does not call it, would have the residual added in the wrong place or not at all).
    Under torch.compile's tracing an op that returns its input in eager (dropout outside training) gives a new
    tensor, so there the check is that the projection added the residual and `out` has the sum's shape."""
    pending = slot(proj)
    summed = pending.sum
    if not (out is summed or (torch.compiler.is_compiling() and summed is not None
                              and isinstance(out, torch.Tensor) and out.shape == summed.shape)):
        pending.residual = None
        raise RuntimeError(f"hgemm: {type(block).__name__} returns something other than its {type(proj).__name__}'s "
                           "output with the residual fused into it; patch this model with fuse=False")
    pending.sum = None
    return out


def residuals(layer, module: nn.Module, ops, mlp: str, down: str | None, mlp_output=(False, False, False),
              fold: bool = False, qkv_norm: str = "") -> None:
    """The layer's residual adds in the epilogues of o_proj and of its MLP's (the child `mlp`'s) last projection
    `down`; with `down` None, the MLP's add stays as the layer runs it, its output taken as `mlp_output` says (a
    pair, its rows flat: layer_steps) (`layer`: hgemm_fuse's _Layer, which records what changed). `fold`: the MLP
    is gate/up as one gated GEMM and post_attention_layernorm an RMSNorm ops.rms_norm runs, so the layer runs the
    two as one ops.norm_linear call (the norm inside the GEMM where the export has that kernel). `qkv_norm`: q's name
    where q/k/v are merged and input_layernorm is an RMSNorm ops.rms_norm runs, so that under torch.compile q runs
    the norm inside its GEMM's call (_layer_forward)."""
    projections = [module.self_attn.o_proj] + ([] if down is None else [getattr(getattr(module, mlp), down)])
    fold = fold and down is not None  # the fold runs down's step itself
    for proj in projections:
        layer.set_forward(proj, _residual_forward, ops=ops, slot=Pending())
    layer.set_forward(module, _layer_forward, ops=ops, signature=inspect.signature(type(module).forward), mlp=mlp,
                      down=down, mlp_output=tuple(mlp_output), fold=int(fold), qkv_norm=qkv_norm)
    layer.kinds += (["o_residual", "down_residual"][:len(projections)] + (["norm_gate_up"] if fold else [])
                    + (["norm_qkv"] if qkv_norm else []))


def post_norms(layer, module: nn.Module, ops, mlp: str, norms: list, roles: tuple) -> None:
    """The layer's norms after its attention and its MLP (the child `mlp`; `roles`: post_norm_roles) with the
    residual adds after them in one ops.rms_norm call each (`norms`: each post norm's recognise.rms_norm_of)."""
    layer.set_forward(module, _post_norm_forward, ops=ops, signature=inspect.signature(type(module).forward),
                      mlp=mlp, norms=norms, roles=tuple(roles))
    layer.kinds.append("norm_residual")
