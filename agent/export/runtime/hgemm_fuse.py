"""Fusions of decoder layers: what a serving engine merges, patched into a Hugging Face model in place.

Recognised: a decoder layer with `self_attn` (q_proj, k_proj, v_proj, o_proj: nn.Linear) and `mlp` (gate_proj,
up_proj, down_proj: nn.Linear, and act_fn) between `input_layernorm` and `post_attention_layernorm`: Llama, Mistral,
Qwen2 (q/k/v with biases) and any decoder built the same way. What `fuse(model, ops)` does to each:

- qkv: q, k and v as one GEMM of N = q + k + v on one merged weight (and merged biases); q_proj, k_proj and v_proj
  keep their parameters as views of it (one copy), and the three calls the attention makes on the same input take
  their columns of the one product;
- gate_up: gate and up as one gated GEMM (`silu_mul`, or `gelu_mul` for a tanh-GELU), its weight the two
  interleaved in blocks of 8 rows (hgemm_epilogue.interleave_gate_up), the only copy: gate_proj's and up_proj's
  parameters keep their identity but give up their storage until `unfuse` writes it back, bit for bit;
- o_residual, down_residual: where the layer's forward returns a tensor (transformers 5's decoder layers), the
  layer runs as the same steps with the residual adds fused into o_proj and down_proj (`residual` epilogue);
- rms_norm: every module of the model (in a decoder layer or not) that computes Llama's RMSNorm (a probe call at
  fuse time matches `llama_rms_norm` bit for bit; Gemma's 1 + weight does not) runs as `ops.rms_norm`, one kernel
  where the model runs eight; only where `ops` has rms_norm.

`ops` computes: `ops.linear(x, w, bias)` (F.linear) and `ops.fused_linear(x, w, bias, epilogue, residual)` (and
may carry `ops.epilogue`, core/epilogue.py as the export ships it);
hgemm_ops passes itself (exported kernels, PyTorch where none serves), the shape recorder an object that records the
problems and computes with PyTorch. What is not recognised stays as it is. Works eager, in CUDA graphs and under
torch.compile(fullgraph=True).
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

KINDS = ("qkv", "gate_up", "o_residual", "down_residual", "rms_norm")
_fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder layer -> _Layer (what fuse changed)
_forwards: weakref.WeakSet = weakref.WeakSet()  # every module whose forward a fused layer replaced


def _epilogue_module(ops):
    """The epilogues' definitions: the export's copy of core/epilogue.py (`ops.epilogue`), or core.epilogue."""
    epilogue = getattr(ops, "epilogue", None)
    if epilogue is None:
        from core import epilogue
    return epilogue


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


def rms_norm_eps(m: nn.Module) -> float | None:
    """The epsilon of a module that computes Llama's RMSNorm with its one parameter `weight` (checked by a probe
    call against llama_rms_norm: the same values bit for bit), or None."""
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    w = getattr(m, "weight", None)
    if (not isinstance(eps, float) or not isinstance(w, nn.Parameter) or w.dim() != 1 or w.numel() == 0
            or w.is_meta or "forward" in m.__dict__ or list(m.children()) or len(list(m.parameters())) != 1):
        return None
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, w.numel(), generator=gen).to(device=w.device, dtype=w.dtype) * 3
    try:
        with torch.no_grad():
            out = type(m).forward(m, x)
    except Exception:  # a forward that takes more than one tensor, or not this one
        return None
    ref = llama_rms_norm(x, w.detach(), eps)
    return eps if isinstance(out, torch.Tensor) and out.dtype == ref.dtype and torch.equal(out, ref) else None


def _norm(layer: _Layer, m: nn.Module, eps: float, ops) -> None:
    layer.set_forward(m, lambda x: ops.rms_norm(x, m.weight, eps))
    layer.kinds.append("rms_norm")


def _plain_linear(m) -> bool:
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and "forward" not in m.__dict__


def _returns_tensor(layer: nn.Module) -> bool:
    ann = inspect.signature(type(layer).forward).return_annotation
    return ann is torch.Tensor or ann in ("torch.Tensor", "Tensor")


class _Holder:
    """What a patched forward reads beside its input: merged weights, a product shared by q, k and v, a residual."""

    def __init__(self, ops, **fields):
        self.ops, self.x, self.y, self.residual = ops, None, None, None
        self.__dict__.update(fields)


class _Layer:
    """One fused decoder layer: the modules whose forward was replaced, and how to put everything back."""

    def __init__(self, name: str):
        self.name, self.forwards, self.kinds, self.restore = name, [], [], []

    def set_forward(self, module: nn.Module, forward) -> None:
        self.forwards.append(module)
        _forwards.add(module)
        module.forward = forward


def _qkv(layer: _Layer, attn: nn.Module, ops) -> None:
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    biases = [p.bias for p in (q, k, v)]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return
    weight = torch.cat([p.weight.detach() for p in (q, k, v)])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    sizes = [p.weight.shape[0] for p in (q, k, v)]
    bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(3)]
    attn.register_buffer("hgemm_qkv_weight", weight, persistent=False)
    attn.register_buffer("hgemm_qkv_bias", bias, persistent=False)
    for p, (lo, hi) in zip((q, k, v), bounds, strict=True):  # one copy: the parameters become views of the merge
        p.weight.data = weight[lo:hi]
        if p.bias is not None:
            p.bias.data = bias[lo:hi]
    holder = _Holder(ops, weight=weight, bias=bias, bounds=bounds)

    def project(index: int):
        lo, hi = bounds[index]

        def forward(x: torch.Tensor) -> torch.Tensor:
            if index == 0:  # q: the merged product, kept for k and v
                holder.x, holder.y = x, ops.linear(x, holder.weight, holder.bias)
                return holder.y[..., lo:hi]
            if holder.x is x:
                y = holder.y
                if index == 2:
                    holder.x = holder.y = None
                return y[..., lo:hi]
            return ops.linear(x, holder.weight[lo:hi], None if holder.bias is None else holder.bias[lo:hi])

        return forward

    for i, p in enumerate((q, k, v)):
        layer.set_forward(p, project(i))

    def restore():
        for p in (q, k, v):  # their own storage again, the same values
            p.weight.data = p.weight.data.clone()
            if p.bias is not None:
                p.bias.data = p.bias.data.clone()
        del attn.hgemm_qkv_weight, attn.hgemm_qkv_bias

    layer.restore.append(restore)
    layer.kinds.append("qkv")


def _gate_up(layer: _Layer, mlp: nn.Module, ops) -> _Holder | None:
    epilogue = gated_epilogue(mlp.act_fn)
    gate, up = mlp.gate_proj, mlp.up_proj
    if epilogue is None or (gate.bias is None) != (up.bias is None) or gate.weight.shape != up.weight.shape:
        return None
    merge = _epilogue_module(ops).interleave_gate_up
    weight = merge(gate.weight.detach(), up.weight.detach(), dim=0)
    bias = None if gate.bias is None else merge(gate.bias.detach(), up.bias.detach(), dim=0)
    mlp.register_buffer("hgemm_gate_up_weight", weight, persistent=False)
    mlp.register_buffer("hgemm_gate_up_bias", bias, persistent=False)
    params = [p for p in (gate.weight, up.weight, gate.bias, up.bias) if p is not None]
    for p in params:  # the merged buffer is the only copy
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    holder = _Holder(ops, weight=weight, bias=bias, epilogue=epilogue)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(ops.fused_linear(x, holder.weight, holder.bias, holder.epilogue, None))

    layer.set_forward(mlp, forward)

    def restore():
        split = _epilogue_module(ops).split_gate_up
        gate.weight.data, up.weight.data = (t.contiguous() for t in split(mlp.hgemm_gate_up_weight, dim=0))
        if gate.bias is not None:
            gate.bias.data, up.bias.data = (t.contiguous() for t in split(mlp.hgemm_gate_up_bias, dim=0))
        del mlp.hgemm_gate_up_weight, mlp.hgemm_gate_up_bias

    layer.restore.append(restore)
    layer.kinds.append("gate_up")
    return holder


def _with_residual(layer: _Layer, proj: nn.Linear, ops) -> _Holder:
    """proj's forward adds the residual its layer left in the holder (once), in the GEMM's epilogue."""
    holder = _Holder(ops)

    def forward(x: torch.Tensor) -> torch.Tensor:
        r = holder.residual
        if r is None:
            return ops.linear(x, proj.weight, proj.bias)
        holder.residual = None
        return ops.fused_linear(x, proj.weight, proj.bias, "residual", r)

    layer.set_forward(proj, forward)
    return holder


def _residuals(layer: _Layer, module: nn.Module, ops) -> None:
    attn, mlp = module.self_attn, module.mlp
    o_res, down_res = _with_residual(layer, attn.o_proj, ops), _with_residual(layer, mlp.down_proj, ops)
    signature = inspect.signature(type(module).forward)

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:  # arguments by position: by name, as the layer's own forward would pass them on
            bound = signature.bind(module, hidden_states, *args, **kwargs).arguments
            kwargs = {**{k: v for k, v in bound.items() if k not in ("self", "hidden_states", "kwargs")},
                      **bound.get("kwargs", {})}
        o_res.residual = hidden_states
        out = attn(hidden_states=module.input_layernorm(hidden_states), **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out  # o_proj added the residual
        down_res.residual = hidden
        return mlp(module.post_attention_layernorm(hidden))  # down_proj adds it

    layer.set_forward(module, forward)
    layer.kinds += ["o_residual", "down_residual"]


def decoder_layers(model: nn.Module):
    """(name, module) of every decoder layer `fuse` recognises."""
    for name, m in model.named_modules():
        attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(m, n) for n in ("input_layernorm",
                                                                         "post_attention_layernorm")):
            continue
        if all(_plain_linear(getattr(attn, n, None)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and all(
                _plain_linear(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")) \
                and hasattr(mlp, "act_fn"):
            yield name, m


def fuse(model: nn.Module, ops, norms: bool = True) -> dict[str, int]:
    """Fuse every recognised decoder layer of `model` and, where `norms` and `ops` has rms_norm, every Llama-style
    RMSNorm (once; a fused layer is left alone); returns how many of each kind (KINDS) were fused."""
    counts = dict.fromkeys(KINDS, 0)
    norms = norms and hasattr(ops, "rms_norm")
    for name, module in list(decoder_layers(model)):
        if module in _fused:
            continue
        layer = _fused[module] = _Layer(name)
        with torch.no_grad():
            _qkv(layer, module.self_attn, ops)
            _gate_up(layer, module.mlp, ops)
            if _returns_tensor(module):
                _residuals(layer, module, ops)
            for norm in (module.input_layernorm, module.post_attention_layernorm):
                eps = rms_norm_eps(norm) if norms and not owns(norm) else None
                if eps is not None:
                    _norm(layer, norm, eps, ops)
        for kind in layer.kinds:
            counts[kind] += 1
    for name, module in list(model.named_modules()) if norms else ():  # the norms outside decoder layers
        eps = None if module in _fused or owns(module) else rms_norm_eps(module)
        if eps is not None:
            _norm(_fused.setdefault(module, _Layer(name)), module, eps, ops)
            counts["rms_norm"] += 1
    return counts


def unfuse(model: nn.Module) -> int:
    """Undo `fuse` on every layer of `model`: forwards, parameters (their own storage, the same values) and buffers
    as they were; returns how many layers were restored."""
    restored = 0
    for module in list(model.modules()):
        layer = _fused.pop(module, None)
        if layer is None:
            continue
        for m in layer.forwards:
            m.__dict__.pop("forward", None)
            _forwards.discard(m)
        with torch.no_grad():
            for restore in layer.restore:
                restore()
        restored += 1
    return restored


def owns(module: nn.Module) -> bool:
    """Whether a fused layer runs this module with a forward of its own."""
    return module in _forwards


def describe(model: nn.Module) -> list[str]:
    """One line per fused layer: its name and what runs fused there."""
    words = {"qkv": "q/k/v as one GEMM", "gate_up": "gate/up as one gated GEMM", "o_residual": "o_proj + residual",
             "down_residual": "down_proj + residual", "rms_norm": "RMSNorm in one kernel"}
    lines = []
    for module in model.modules():
        layer = _fused.get(module)
        if layer is not None:
            extra = ""
            if "gate_up" in layer.kinds:
                extra = f" ({gated_epilogue(module.mlp.act_fn)})"
            kinds = [k for k in KINDS if k in layer.kinds]
            norms = layer.kinds.count("rms_norm")
            lines.append(f"{layer.name}: " + ", ".join(words[k] if k != "rms_norm" or norms == 1 else
                                                       f"{norms} RMSNorms in one kernel each" for k in kinds) + extra)
    return lines
