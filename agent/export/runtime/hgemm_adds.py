"""A decoder layer's residual adds in its projections' epilogues, for layers whose names or steps are not Llama's
(hgemm_steps.py has those): a layer whose attention and MLP both read its input, x + attn(norm1(x)) +
mlp(norm2(x)) (GPT-J's, Phi's, GPT-NeoX's, Falcon's, Cohere's), and one that runs them in turn under names of its
own, h = x + attn(norm1(x)), h + mlp(norm2(h)) (GPT-2's, Persimmon's, GPT-NeoX's sequential layers), the MLP a child
or two Linear children the layer calls in turn itself (OPT's, XGLM's, BioGPT's, BART's decoders'). Found by probe
calls of the layer's own forward with its attention and MLP stood in for, which also show how the layer passes its
arguments to the attention (`residual_steps`). x is added in the epilogue of the attention's output projection
(`out_projection`) where it has one, and that sum (else the attention's output, or x + a) in the MLP's last
projection's. Shipped in an export beside hgemm_fuse.py, which loads it after hgemm_recognise.py and hgemm_steps.py;
the forward here runs as the fused layer's class method.
"""

from __future__ import annotations

import inspect
import sys
from typing import NamedTuple

import torch
from torch import nn

recognise = sys.modules[__name__.replace("__hgemm_adds", "__hgemm_recognise")]  # hgemm_fuse loads them first
steps = sys.modules[__name__.replace("__hgemm_adds", "__hgemm_steps")]


class Adds(NamedTuple):
    """How the layer runs (residual_steps): the children's names (`attn`, `mlp`; the norm before each, None for
    none, `mlp_norm` "same" for the attention's normed input itself), the MLP's last projection `down` (`mlp` None:
    an MLP inline in the layer, `first` then `down` the layer's own Linear children, called in turn), how the
    attention is called (its input positional or as hidden_states=, each keyword argument from the layer's argument
    of a name or as a constant, the layer's **kwargs passed on or not), the layer's arguments that change its steps
    (`branches`, each with its default: the fused steps run only while they have it), which sum the layer returns
    ("amx": (a + m) + x, "xam": (x + a) + m, "seq": h + m with h = x + a and the MLP on h) and how (`returns`: 0 the
    tensor, n a tuple of it and n - 1 times the attention's second output); the attention's output projection
    (`out`, out_projection), or None; whether the attention returns a pair (its output and another) or a tensor
    (a linear attention's)."""
    attn: str
    attn_norm: str | None
    mlp: str
    mlp_norm: str | None
    down: str
    positional: bool
    attn_args: tuple
    extras: bool
    branches: tuple
    form: str
    returns: int
    out: str | None = None
    pair: bool = True
    first: str | None = None


OUT_NAMES = ("o_proj", "out_proj", "c_proj", "dense")  # an attention's output projection, by its names


def out_projection(attn: nn.Module, hidden: int) -> str | None:
    """The name of the attention's output projection: its one child of OUT_NAMES that is linear_like with `hidden`
    output features, or that of its one child module's where it has none of its own (GPT-Neo's attention wraps the
    one that has it: "attention.out_proj"), or None. Whether the attention returns that projection's output as it
    is shows at each call (hgemm_steps._summed)."""
    names = [n for n in OUT_NAMES if recognise.linear_like(m := getattr(attn, n, None)) and
             recognise.features(m)[1] == hidden]
    inner = list(attn.named_children())
    if not names and len(inner) == 1 and (name := out_projection(inner[0][1], hidden)):
        return f"{inner[0][0]}.{name}"
    return names[0] if len(names) == 1 else None


class _Arg:
    """A probe's value for one of the layer's arguments, to see where the layer passes it."""

    def __init__(self, name: str):
        self.name = name


def inline_mlp(layer: nn.Module, attn: str) -> tuple[str, str] | None:
    """(first, down): the layer's two Linear children (none in its attention) of in/out features (h, i) and (i, h),
    down a linear_like one (first may run a fused activation already: hgemm_inline), one order only; or None."""
    linears = {n: c for n, c in layer.named_children() if n != attn and isinstance(c, nn.Linear)
               and c.weight.dim() == 2 and not c.weight.is_meta}
    if len(linears) != 2:
        return None
    pairs = [(f, d) for f, d in (tuple(linears), tuple(linears)[::-1]) if recognise.linear_like(linears[d])
             and recognise.features(linears[f]) == recognise.features(linears[d])[::-1]]
    return pairs[0] if len(pairs) == 1 else None


def _holder(layer: nn.Module, found) -> nn.Module:
    """The module whose child the MLP's last projection is: the MLP, or the layer where the MLP is inline."""
    return layer if found.mlp is None else getattr(layer, found.mlp)


def residual_steps(layer: nn.Module, attn: str, mlp: str | None, down: str | None) -> Adds | None:
    """Whether the layer's own forward computes x + attn(norm1(x)) + mlp(norm2(x)), added as (a + m) + x or
    (x + a) + m, or h + mlp(norm2(h)) with h = x + attn(norm1(x)), `down` the MLP's last projection (`mlp` None: the
    layer's inline_mlp, down(first(.)), the layer's own children): how (Adds), or None. Its forward is called with
    the attention and the MLP stood in for (hgemm_steps._Stand): with its arguments' defaults (required ones None),
    then once more for each argument with a value of its own in its place, which shows under which name the
    attention gets it; an argument whose value changes the steps or is passed only when given (a flag that adds the
    attention's weights to what the layer returns, an encoder's states that start a cross-attention) is a branch:
    the fused steps run while it has its default, the layer's own forward otherwise.
    """
    first = None
    if mlp is None:
        if (found := inline_mlp(layer, attn)) is None:
            return None
        first, down = found
    lin = getattr(layer if mlp is None else getattr(layer, mlp), down)
    if lin.weight.is_meta:
        return None
    x = recognise.probe_input(lin.weight, 2, 3, recognise.features(lin)[1])
    stood = (attn, mlp) if mlp is not None else (attn, first, down)  # the children the probes stand in for
    with steps.distinct_weights(layer, stood):  # which norm is which: not by values they share at init
        return _residual_steps(layer, attn, (mlp, first, down), x)


def _residual_steps(layer: nn.Module, attn: str, mlp: tuple, x: torch.Tensor) -> Adds | None:
    """residual_steps's probe calls on x, the layer's weights made distinct; `mlp` (its name, first, down)."""
    params = list(inspect.signature(type(layer).forward).parameters.values())[2:]
    named, base = [q for q in params if q.kind in steps.NAMED], steps.required_args(layer)
    for pair in (True, False):  # the attention's output as a pair, else as a tensor (a linear attention's)
        if (ref := _probe(layer, attn, mlp, x, base, pair)) is not None:
            break
    else:
        return None
    attn_args, branches = dict(ref[0]), []
    for q in named:
        got = _probe(layer, attn, mlp, x, base | {q.name: _Arg(q.name)}, pair)
        passed = [k for k, v in (got[0] if got else ()) if v == ("arg", q.name)]
        if got is None or got[2] != ref[2] or any(k not in attn_args for k in passed):
            if q.default is inspect.Parameter.empty:  # a required argument that changes the steps
                return None
            branches.append((q.name, q.default))
            continue
        attn_args.update(dict.fromkeys(passed, ("arg", q.name)))
    extras = any(q.kind == inspect.Parameter.VAR_KEYWORD for q in params)
    if extras:
        got = _probe(layer, attn, mlp, x, base | {"hgemm_probe": _Arg("**")}, pair)
        extras = got is not None and got[1] and got[2] == ref[2]
    attn_norm, mlp_norm, positional, form, returns = ref[2]
    return Adds(attn, attn_norm, mlp[0], mlp_norm, mlp[2], positional, tuple(attn_args.items()), extras,
                tuple(branches), form, returns, out_projection(getattr(layer, attn), x.shape[-1]), pair, mlp[1])


def _probe(layer, attn: str, mlp: tuple, x: torch.Tensor, given: dict, pair: bool = True):
    """One probe call of residual_steps, the attention stood in for by one that returns a pair (`pair`) or a tensor,
    the MLP (`mlp`: its name, or None and the layer's first and last projections) by one that returns a tensor:
    (the attention's keyword arguments, each (name, ("arg", the layer's argument) or ("const", value))); whether it
    got the layer's **kwargs; (attn_norm, mlp_norm, positional, form, returns)), or None."""
    name, first, down = mlp
    stand_a, stand_m, stand_f = steps._Stand(1.5, pair=pair), steps._Stand(-0.75, pair=False), None
    stands = {attn: stand_a, name: stand_m} if first is None else {
        attn: stand_a, first: (stand_f := steps._Stand(0.5, pair=False)), down: stand_m}
    try:
        with steps.stood_in(layer, stands):
            out = type(layer).forward(layer, x, **given)
    except Exception:  # a forward that uses an argument itself, or needs more than its input
        return None
    if len(stand_a.calls) != 1 or len(stand_m.calls) != 1 or (stand_f and len(stand_f.calls) != 1):
        return None
    if stand_f:  # down called right on first's output: nothing of the layer's between them
        d_args, d_kwargs = stand_m.calls[0]
        if d_kwargs or len(d_args) != 1 or not torch.equal(d_args[0], stand_f(stand_f.calls[0][0][0])):
            return None
    (a_args, a_kwargs), (m_args, m_kwargs) = stand_a.calls[0], (stand_f or stand_m).calls[0]
    positional = "hidden_states" not in a_kwargs
    a_in = a_args[0] if positional and len(a_args) == 1 else a_kwargs.get("hidden_states")
    if not isinstance(a_in, torch.Tensor) or (a_args and not positional) or m_kwargs or len(m_args) != 1:
        return None
    attn_args, passed = [], False
    for k, v in a_kwargs.items():
        if k == "hidden_states":
            continue
        if isinstance(v, _Arg):
            passed |= v.name == "**"
            if v.name != "**":
                attn_args.append((k, ("arg", v.name)))
        elif v is None or isinstance(v, (bool, int, float, str)):
            attn_args.append((k, ("const", v)))
        else:  # something the layer computed
            return None
    skip, m_in = tuple(stands), m_args[0]
    a, m = stand_a(a_in), stand_m(stand_f(m_in) if stand_f else m_in)
    a, m = a[0] if pair else a, m.reshape(x.shape) if m.numel() == x.numel() else m  # rows flattened: as x's
    h = x + a
    attn_norm = _norm_of(layer, x, a_in, skip)
    mlp_norm = "same" if m_in is a_in else _norm_of(layer, x, m_in, skip)
    sequential = mlp_norm is False
    if sequential:  # the MLP reads the attention's sum, or a norm of it
        mlp_norm = None if _same_rows(m_in, h) else _norm_of(layer, h, m_in, skip)
    if attn_norm is False or mlp_norm is False:
        return None
    o, rest = (out, ()) if isinstance(out, torch.Tensor) else (out[0], out[1:]) if isinstance(out, tuple) else (0, 0)
    if not isinstance(o, torch.Tensor) or o.dtype != x.dtype or any(r is not stand_a.extra for r in rest):
        return None
    if sequential:
        form = "seq" if torch.equal(o, h + m) else None
    else:
        form = "amx" if torch.equal(o, (a + m) + x) else "xam" if torch.equal(o, h + m) else None
    if form is None:
        return None
    return tuple(attn_args), passed, (attn_norm, mlp_norm, positional, form, 0 if o is out else 1 + len(rest))


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same rows bit for bit, whatever their leading dimensions (OPT's layer flattens
    its tokens before the MLP)."""
    return a.shape[-1] == b.shape[-1] and a.numel() == b.numel() and torch.equal(a.reshape(b.shape), b)


def _norm_of(layer: nn.Module, x: torch.Tensor, seen: torch.Tensor, skip: tuple) -> str | None | bool:
    """Which child of the layer (none of `skip`) gave `seen` from x (bit for bit, any leading dimensions); None
    where `seen` is x; False."""
    if seen is x:
        return None
    for n, c in layer.named_children():
        if n not in skip and not isinstance(c, (nn.Dropout, nn.Identity)):
            try:
                out = c(x)
            except Exception:  # a child that is no norm of the input
                continue
            if isinstance(out, torch.Tensor) and _same_rows(out, seen):
                return n
    return False


def _branched(values: dict, branches: tuple) -> bool:
    """Whether any branch argument has a value other than its default."""
    return any(not (values[n] is d or (type(values[n]) is type(d) and isinstance(d, (bool, int, float, str))
                                       and values[n] == d)) for n, d in branches)


def _adds_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    """The layer's steps (residual_steps), x added in the epilogue of the attention's output projection where it has
    one, and in the epilogue of the MLP's last projection that sum (or, without an output projection, the
    attention's output); in training mode, or with a branch argument given, the layer's own forward."""
    p, defaults = self._hgemm_adds, self._hgemm_defaults
    # positional arguments (or a required one missing): bound as the layer binds them; all() rather than a set
    # against dict keys, a comparison torch.compile does not trace in every install
    if args or not all(k in kwargs for k in self._hgemm_required):
        bound = self._hgemm_signature.bind(self, hidden_states, *args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        extra = values.get(self._hgemm_varkw) or {}
    else:  # keywords only (as Hugging Face models call their layers): no binding on every call
        values, extra = defaults | kwargs, {k: v for k, v in kwargs.items() if k not in defaults}
    if self.training or _branched(values, p.branches):
        return self._hgemm_base.forward(self, hidden_states, *args, **kwargs)
    x = hidden_states
    a_in = x if p.attn_norm is None else getattr(self, p.attn_norm)(x)
    given = {k: values[v] if kind == "arg" else v for k, (kind, v) in p.attn_args}
    if p.extras:
        given.update(extra)
    attn, mlp = getattr(self, p.attn), _holder(self, p)
    if p.out is not None:
        steps.slot(attn.get_submodule(p.out)).residual = x
    out = attn(a_in, **given) if p.positional else attn(hidden_states=a_in, **given)
    if isinstance(out, tuple) != p.pair:
        raise RuntimeError(f"hgemm: {type(attn).__name__} returns a {type(out).__name__}, not the "
                           f"{'pair' if p.pair else 'tensor'} its layer took when patched; patch this model with "
                           "fuse=False")
    a = out[0] if p.pair else out
    down = getattr(mlp, p.down)
    if p.out is None and p.form == "amx":  # (a + m) + x
        m_in = a_in if p.mlp_norm == "same" else x if p.mlp_norm is None else getattr(self, p.mlp_norm)(x)
        steps.slot(down).residual = a
        o = steps._summed(mlp, down, _run_mlp(self, p, mlp, down, m_in)) + x
    else:  # (x + a) + m, x + a by the output projection where it has one; the MLP on a norm of x or of x + a ("seq")
        h = x + a if p.out is None else steps._summed(attn, attn.get_submodule(p.out), a)
        base = h if p.form == "seq" else x
        m_in = a_in if p.mlp_norm == "same" else base if p.mlp_norm is None else getattr(self, p.mlp_norm)(base)
        steps.slot(down).residual = h
        o = steps._summed(mlp, down, _run_mlp(self, p, mlp, down, m_in))
    return o if not p.returns else (o, *[out[1]] * (p.returns - 1))


def _run_mlp(layer: nn.Module, p: Adds, mlp: nn.Module, down: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP on x: its child's forward, or down(first(x)) where the layer calls them itself."""
    return mlp(x) if p.first is None else down(getattr(layer, p.first)(x))


def fuse_adds(layer, module: nn.Module, ops, found: Adds) -> None:
    """The layer's steps as `found` (residual_steps) says, with its adds in its projections' epilogues (`layer`:
    hgemm_fuse's _Layer, which records what changed)."""
    projections = [getattr(_holder(module, found), found.down)]
    if found.out is not None:
        projections.append(getattr(module, found.attn).get_submodule(found.out))
    for proj in projections:
        steps.as_nk(layer, proj)
        layer.set_forward(proj, steps._residual_forward, ops=ops, slot=steps.Pending())
    signature = inspect.signature(type(module).forward)
    params = list(signature.parameters.values())[2:]
    varkw = next((q.name for q in params if q.kind == inspect.Parameter.VAR_KEYWORD), None)
    named = [q for q in params if q.kind in steps.NAMED]
    layer.set_forward(module, _adds_forward, signature=signature, adds=found, varkw=varkw,
                      defaults={q.name: q.default for q in named if q.default is not inspect.Parameter.empty},
                      required={q.name for q in named if q.default is inspect.Parameter.empty})
    layer.kinds.append("down_residual" if found.form == "seq" else "parallel_residual")
    if found.out is not None:
        layer.kinds.append("o_residual")
