"""Recognising the modules hgemm_fuse.py fuses in a Hugging Face model: MLPs that are down(act(gate(x)) * up(x))
(gate and up as two projections or one) or second(act(first(x))), the activations the epilogues compute, Llama-,
Gemma- and Olmo-2-style RMSNorms, Linear subclasses that compute F.linear, rotary embeddings (a decoder layer's
steps: hgemm_steps.py). Each is recognised by its modules' names and types and by probe calls that must give the
same values bit for bit as the steps the fused forwards run, not by its class: a model built otherwise keeps its own
code there. Shipped in an export beside hgemm_fuse.py, which loads it.
"""

from __future__ import annotations

import inspect
import weakref
from typing import NamedTuple

import torch
from torch import nn


def activation(act, epilogue) -> str | None:
    """Which of the epilogues' activations (`epilogue`: core/epilogue.py, or the export's copy) the module `act`
    computes: one without parameters, children or a forward of its own whose output on fp64 values from -12 to 12
    is that activation's within 1e-7 (relative: fp32's rounding), so that a formula written out (transformers'
    NewGELUActivation for the tanh GELU, BLOOM's with sqrt(2/pi) as 0.79788456) counts as the function it computes,
    and one that is another function (QuickGELU, a clipped GELU, ReLU squared) does not; or None."""
    if (not isinstance(act, nn.Module) or list(act.parameters()) or list(act.children()) or list(act.buffers())
            or "forward" in act.__dict__):
        return None
    x = torch.linspace(-12, 12, 4801, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act(x.clone())  # a clone: an in-place activation may write its input
    except Exception:  # a module that is no elementwise function
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
        return None
    return next((name for name in epilogue.ACTIVATIONS
                 if torch.allclose(y, epilogue.activate(x, name), rtol=1e-7, atol=1e-12)), None)


def gated_epilogue(act, epilogue) -> str | None:
    """The gated epilogue of an MLP whose activation is `act` (silu_mul, gelu_mul: `activation` of their gate's
    function), or None."""
    return {gate: name for name, gate in epilogue.GATED.items()}.get(activation(act, epilogue))


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x in fp32 times rsqrt(mean(x^2) + eps), as every RMSNorm below computes it first."""
    h = x.to(torch.float32)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, op for op: the normalised x rounded to x's dtype, times weight."""
    return weight * _normalised(x, eps).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' GemmaRMSNorm.forward (Qwen3-Next's too), op for op: the normalised x times 1 + weight in fp32,
    rounded once to x's dtype."""
    return (_normalised(x, eps) * (1.0 + weight.float())).type_as(x)


def weight_fp32_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Olmo2RMSNorm.forward (GPT-OSS's, DeepSeek-V4's too), op for op: weight times the normalised x
    in fp32, rounded once to x's dtype."""
    return (weight * _normalised(x, eps)).to(x.dtype)


RMS_NORMS = (llama_rms_norm, gemma_rms_norm, weight_fp32_rms_norm)  # by the norm kernel's `kind`


def probe_input(like: torch.Tensor, *shape: int, scale: float = 2.0) -> torch.Tensor:
    """Seeded random values of `shape` on `like`'s device and in its dtype, large enough that functions bend on them."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    return (torch.randn(*shape, generator=gen) * scale).to(device=like.device, dtype=like.dtype)


def takes_only(m: nn.Module, n: int) -> bool:
    """Whether the forward of m's class takes exactly n arguments besides self, with no optional extras: a fused
    forward of those n then serves every call the module gets (an MLP's extra argument would not reach it)."""
    try:
        params = list(inspect.signature(type(m).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return len(params) == n and all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def rms_norm_of(m: nn.Module) -> tuple[float, int] | None:
    """(epsilon, kind) of a module that computes one of RMS_NORMS (kind: its index; Llama's first, where two agree,
    as in fp32) with its one parameter `weight` (checked by a probe call, with a random weight in place of its own
    for the call, since a weight of ones or zeros, as models are initialised, makes several kinds agree: the same
    values bit for bit), or None. Its forward may take more (a gated norm's gate): the probe calls it with x alone,
    and the fused forward runs the module's own where a call gives more."""
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    w = getattr(m, "weight", None)
    if (not isinstance(eps, float) or not isinstance(w, nn.Parameter) or w.dim() != 1 or w.numel() == 0
            or w.is_meta or "forward" in m.__dict__ or list(m.children()) or len(list(m.parameters())) != 1):
        return None
    x, weight, own = probe_input(w, 3, w.numel(), scale=3.0), 1 + probe_input(w, w.numel(), scale=0.5), w.data
    try:
        with torch.no_grad():
            w.data = weight
            out = type(m).forward(m, x)
    except Exception:  # a forward that takes more than one tensor, or not this one
        return None
    finally:
        w.data = own
    for kind, norm in enumerate(RMS_NORMS):
        ref = norm(x, weight, eps)
        if isinstance(out, torch.Tensor) and out.dtype == ref.dtype and torch.equal(out, ref):
            return eps, kind
    return None


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
    """Whether `m` computes F.linear(x, m.weight, m.bias): an nn.Linear with nn.Linear's forward, or of a subclass
    whose forward gives the same values bit for bit on a probe call (Falcon's FalconLinear, x @ W.T; checked once
    per module and class); not one with a forward of its own in its instance dict, nor one a fusion runs."""
    if not isinstance(m, nn.Linear) or "forward" in m.__dict__:
        return False
    cls = type(m)
    if cls.forward is nn.Linear.forward:
        return True
    if "_hgemm_base" in vars(cls):  # a fused module's class (hgemm_fuse's set_forward)
        return False
    return _probed(m)


def conv1d(m) -> bool:
    """Whether `m` is transformers' Conv1D (GPT-2's projections: addmm(bias, x, W), W K x N) computing
    F.linear(x, W.T, bias) bit for bit on a probe call (checked once per module and class); not one a fusion runs."""
    w = getattr(m, "weight", None)
    if (type(m).__name__ != "Conv1D" or "forward" in m.__dict__ or "_hgemm_base" in vars(type(m))
            or not isinstance(w, torch.Tensor) or w.dim() != 2 or getattr(m, "nf", None) != w.shape[1]):
        return False
    return _probed(m)


def linear_like(m) -> bool:
    """A plain_linear or a conv1d: what the fused forwards can run as a GEMM of an N x K weight (nk_weight)."""
    return plain_linear(m) or conv1d(m)


def features(m: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear_like module."""
    return (m.in_features, m.out_features) if isinstance(m, nn.Linear) else tuple(m.weight.shape)


def nk_weight(m: nn.Module) -> torch.Tensor:
    """A linear_like module's weight as N x K (a Conv1D's transposed: contiguous once hgemm_steps.as_nk ran)."""
    return m.weight if isinstance(m, nn.Linear) else m.weight.t()


def _probed(m: nn.Module) -> bool:
    seen = _linear_like.get(m)
    if seen is None or seen[0] is not type(m):
        seen = _linear_like[m] = (type(m), _computes_linear(m))
    return seen[1]


QKV_NAMES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"))  # Llama's, BERT's, T5's


def qkv_names(attn: nn.Module) -> tuple[str, str, str] | None:
    """The names of the module's q, k and v projections (one of QKV_NAMES), each a plain_linear (what hgemm_fuse
    merges), or None."""
    return next((names for names in QKV_NAMES if all(plain_linear(getattr(attn, n, None)) for n in names)), None)


_linear_like: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (its class, _computes_linear)


def _computes_linear(m: nn.Module) -> bool:
    w = nk_weight(m)
    if w.is_meta or w.dim() != 2 or not w.is_floating_point():
        return False
    x = probe_input(w, 3, w.shape[1])
    try:
        with torch.no_grad():
            out, ref = type(m).forward(m, x), torch.nn.functional.linear(x, w, m.bias)
    except Exception:  # another signature
        return False
    return isinstance(out, torch.Tensor) and out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out, ref)


def act_of(mlp: nn.Module) -> nn.Module | None:
    """The MLP's activation: `act_fn` (Llama's name) or `activation_fn` (Phi-3's)."""
    act = getattr(mlp, "act_fn", None)
    return act if act is not None else getattr(mlp, "activation_fn", None)


def probe_mlp(mlp: nn.Module, down: str = "down_proj", first: str = "up_proj") -> tuple[str | None, bool]:
    """One call of the MLP's own forward on random input, with a hook on its last projection `down`: how it holds
    its gate and up projections where it computes down(act(gate(x)) * up(x)) (the same values bit for bit): "pair"
    (gate_proj and up_proj, Llama's), "merged" (one gate_up_proj whose rows are gate's, then up's, Phi-3's) or None;
    and whether it returns down's output as it is (the output object itself), so that a residual added in down's
    epilogue is what the layer adds. `first`: a projection of the MLP's input, for the probe's width where the MLP
    has no gate."""
    act, down = act_of(mlp), getattr(mlp, down)
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
        kind, first = None, next(m for m in (getattr(mlp, first, None), down) if linear_like(m))
    if first.weight.is_meta:
        return None, False
    x, seen = probe_input(first.weight, 3, features(first)[0]), []
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
    same = out.dtype == ref.dtype and torch.equal(out, ref)
    return (kind if same and takes_only(mlp, 1) else None), returns_down  # the gated forward takes x alone


class Chain(NamedTuple):
    """An MLP without a gate (plain_mlp): its first and second projections' names (second None: act(first(x))), the
    epilogue of its activation, and whether its forward(h, r) adds a residual r it is given (BLOOM's, MPT's)."""
    first: str
    second: str | None
    epilogue: str
    residual: bool


def plain_mlp(m: nn.Module, epilogue, single: bool = False) -> Chain | None:
    """How a module computes second(act(first(x))) with two plain nn.Linear (or Conv1D: linear_like) children and an
    activation child the epilogues compute (`activation`; dropouts besides, nothing else), or second(act(first(h)))
    + r where its forward takes (h, r), checked by a probe call: the same values bit for bit; where `single`, also
    act(first(x)) with one (BERT's intermediate block); or None."""
    children = dict(m.named_children())
    linears = [n for n, c in children.items() if linear_like(c)]
    acts = [c for n, c in children.items() if n not in linears and not isinstance(c, nn.Dropout)]
    if ("forward" in m.__dict__ or len(linears) not in ((1, 2) if single else (2,)) or len(acts) != 1
            or list(m.parameters(recurse=False)) or any(children[n].weight.is_meta for n in linears)):
        return None
    name = activation(acts[0], epilogue)
    if name is None:
        return None
    taken = [q for q in list(inspect.signature(type(m).forward).parameters.values())[1:]
             if q.default is inspect.Parameter.empty and q.kind != inspect.Parameter.VAR_KEYWORD]
    residual = len(taken) == 2 and len(linears) == 2
    for first, second in (linears, linears[::-1]) if len(linears) == 2 else ((linears[0], None),):
        lin1, lin2 = children[first], children[second] if second else (lambda t: t)
        if second and (features(lin1)[1] != features(lin2)[0] or lin1.weight.dtype != lin2.weight.dtype):
            continue
        x = probe_input(lin1.weight, 3, features(lin1)[0])
        r = probe_input(lin1.weight, 3, features(lin2)[1], scale=-0.5) if residual else None
        try:
            with torch.no_grad():
                out, ref = type(m).forward(m, x, *[r] if residual else []), lin2(acts[0](lin1(x)))
        except Exception:  # another signature
            return None
        ref = ref + r if residual else ref
        if isinstance(out, torch.Tensor) and out.dtype == ref.dtype and torch.equal(out, ref):
            return Chain(first, second, name, residual)
    return None


def residual_norm(m: nn.Module) -> tuple[str, str | None] | None:
    """(linear, norm) of a module whose own forward(h, r) computes norm(linear(h) + r) with one plain nn.Linear
    child and one other (BERT's output blocks: the residual added before their LayerNorm), or linear(h) + r with
    the Linear alone (norm None: pre-norm BERTs'), dropouts besides, checked by a probe call: the same values bit
    for bit; or None."""
    children = dict(m.named_children())
    linears = [n for n, c in children.items() if plain_linear(c)]
    others = [n for n, c in children.items() if n not in linears and not isinstance(c, nn.Dropout)]
    if "forward" in m.__dict__ or len(linears) != 1 or len(others) > 1 or list(m.parameters(recurse=False)):
        return None
    lin, norm = children[linears[0]], children[others[0]] if others else (lambda t: t)
    if lin.weight.is_meta:
        return None
    h, r = probe_input(lin.weight, 3, lin.in_features), probe_input(lin.weight, 3, lin.out_features, scale=-0.5)
    try:
        with torch.no_grad():
            out, ref = type(m).forward(m, h, r), norm(lin(h) + r)
    except Exception:  # another signature
        return None
    ok = isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor) and out.dtype == ref.dtype
    return (linears[0], (others or [None])[0]) if ok and torch.equal(out, ref) else None
