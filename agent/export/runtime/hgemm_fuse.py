"""Fusions of decoder layers: what a serving engine merges, patched into a Hugging Face model in place.

Looked into: a decoder layer with an attention (`self_attn`, `attn`, `attention`, `self_attention`, or a hybrid
model's `linear_attn`) and, usually, an MLP (`mlp`, or the layer's one other child); hgemm_recognise.py and
hgemm_steps.py decide what in it is fused, by probe calls with the layer's other weights made distinct
(hgemm_steps.distinct_weights: at init its norms all hold ones).
Llama, Mistral, Qwen2 (q/k/v with biases), Phi-3 (q/k/v already one projection, gate and up one gate_up_proj) and
any decoder built the same way fuse all of what follows; layers with norms after the attention and the MLP (Olmo2,
Gemma2) their q/k/v, gate/up and the adds after the norms; MoE layers their q/k/v and o_proj's residual add;
other layers (GPT-J, Phi, Falcon, Cohere, GPT-2) both adds
(tools/arch_probe.py checks every causal LM of the installed transformers). Outside such layers: attentions, gated
and gateless MLPs (an MoE block's shared expert), norms and rotary embeddings on their own. What `fuse(model, ops)`
does to each:

- qkv: q, k and v as one GEMM of N = q + k + v on one merged weight (and merged biases), in any module with plain
  q_proj, k_proj and v_proj (or BERT's query, key and value, T5's q, k and v: hgemm_qkv.py); they keep their
  parameters as views of it (one copy), and the calls the attention makes on the same input take their columns of
  the one product (where one goes unused, as a cross-attention's would, q runs its own rows from then on);
- gate_up: where the MLP's own forward is down(act(gate(x)) * up(x)) (a probe call: the same values bit for bit),
  gate and up as one gated GEMM (`silu_mul`, or `gelu_mul` for a tanh-GELU), its weight the two interleaved in
  blocks of 8 rows (hgemm_epilogue.interleave_gate_up), the only copy: gate_proj's and up_proj's parameters (or
  gate_up_proj's) keep their identity but give up their storage until `unfuse` writes it back, bit for bit;
- mlp_act: an MLP that is second(act(first(x))) (recognise.plain_mlp; its projections nn.Linear or transformers'
  Conv1D, whose weight is then stored N x K, its parameter a transposed view), or outside decoder layers one that is
  act(first(x)) (BERT's intermediate block), runs its first GEMM with the activation in its epilogue (its
  dropouts, identities in eval mode, skipped; in training mode with a dropout its own forward); one whose
  forward(h, r) is second(act(first(h))) + r (BLOOM's, MPT's) adds r in the second GEMM too (down_residual);
- mlp_act in a layer: an activation the layer applies inline to a Linear child's output (OPT's, BART's fc1;
  hgemm_inline.py) moves into that Linear's epilogue;
- residual_norm: a module whose forward(h, r) is norm(linear(h) + r), or linear(h) + r (BERT's output blocks;
  recognise.residual_norm), runs the add in the GEMM's epilogue, then its norm;
- o_residual, down_residual: where the layer's own forward is Llama's, x + attn(norm1(x)) and then h + mlp(norm2(h)),
  returning a tensor (a probe call with the attention and the MLP stood in for by fixed functions: the same values
  bit for bit; Gemma2's extra norms and Granite's residual multiplier are not), and its MLP returns its last
  projection's output as it is (down_proj, or a plain MLP's second: a probe call), the layer runs as the same steps
  with the residual adds fused into o_proj and that projection (`residual` epilogue); where the MLP returns
  something else (an MoE block), o_proj's add alone; an attention that changes o_proj's output before returning it
  is an error at its first call (hgemm_steps.py);
- parallel_residual, and down_residual in other layers: where the layer's own forward is x + attn(norm1(x)) +
  mlp(norm2(x)) (GPT-J's, Phi's, GPT-NeoX's, Falcon's, Cohere's), or h = x + attn(norm1(x)) then h + mlp(norm2(h))
  under names that are not Llama's (GPT-2's, Persimmon's), and its MLP returns its last projection's output as it
  is, x + a runs in the epilogue of the attention's output projection (o_residual; its one child named o_proj,
  out_proj, c_proj or dense, returned as it is or an error at the first call) and the MLP's add in that
  projection's (x + a + m summed in that order; without an output projection, the MLP's add of the attention's
  output, of x plus it, or of h, as the layer adds) (probe calls with the attention and the MLP stood in for, which
  also show under which names the layer passes its arguments to the attention, and which of its arguments change
  its steps: with one of those given, or in training mode, the layer runs its own forward; hgemm_adds.py);
- norm_residual: where the layer's steps put a norm after the attention and after the MLP, each before its residual
  add (Gemma 2's, Olmo 2's, GLM-4's: which child is which norm found by a probe call, not by its name), and `ops`
  has rms_norm, each of those norms and its add run as one ops.rms_norm call (hgemm_steps.py);
- rms_norm: every module that computes Llama's RMSNorm or Gemma's (1 + weight; recognise.rms_norm_of) runs as
  `ops.rms_norm`, one kernel where the model runs eight or nine; only where `ops` has rms_norm;
- rotary: a rotary embedding whose (cos, sin) equal `rotary_cos_sin`'s bit for bit (recognise.is_rotary) computes
  its frequencies by broadcasting, not by the batched matmul of K = 1 that older transformers versions run (a
  cuBLAS call that torch.compile's default mode leaves outside its fused kernels).

`ops` computes: `ops.linear(x, w, bias)` (F.linear) and `ops.fused_linear(x, w, bias, epilogue, residual)` (and
may carry `ops.epilogue`, core/epilogue.py as the export ships it); hgemm_ops passes itself (exported kernels,
PyTorch where none serves), the shape recorder an object that records the problems and computes with PyTorch. What
is not recognised stays as it is. Works eager, in CUDA graphs and under torch.compile(fullgraph=True).

A fused module keeps its identity, parameters and place in the model; its class becomes a subclass of its own (same
name) whose forward is one of these files', reading what it needs from attributes `fuse` sets (`_hgemm_*`; below a
decoder layer ints, floats, strings and tensors only), so that torch.compile reaches every module by one path
(closures over modules made dynamo guard each module a second time); `ops` and what a forward changes as it runs are
found by keys (hgemm_steps.ops_of, hgemm_steps.slot), outside the modules, so that dynamo can skip the guards of an
attention or MLP whose dicts did not change (decision `fused-classes`).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
import weakref
from pathlib import Path

import torch
from torch import nn


def _beside(name: str) -> types.ModuleType:
    """A runtime file next to this one as a module of its own (an export's folder is no package), loaded once."""
    full = f"{__name__}__{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, Path(__file__).with_name(f"{name}.py"))
        sys.modules[full] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[full])
    return sys.modules[full]


recognise = _beside("hgemm_recognise")
steps = _beside("hgemm_steps")
qkv = _beside("hgemm_qkv")
inline = _beside("hgemm_inline")
adds = _beside("hgemm_adds")

KINDS = ("qkv", "gate_up", "mlp_act", "o_residual", "down_residual", "parallel_residual", "norm_residual",
         "residual_norm", "rms_norm", "norm_gate_up", "norm_qkv", "rotary")
_FUSED = "_hgemm_fused"  # a fused decoder layer's _Layer (what fuse changed), in the layer's own dict: a dict of
#                          layers would keep them alive through the _Layer's references to them
_forwards: weakref.WeakSet = weakref.WeakSet()  # every module whose forward a fused layer replaced
_classes: dict = {}  # (a module's class, a forward of these files) -> the subclass that runs it


def _epilogue_module(ops):
    """The epilogues' definitions: the export's copy of core/epilogue.py (`ops.epilogue`), or core.epilogue."""
    epilogue = getattr(ops, "epilogue", None)
    if epilogue is None:
        from core import epilogue
    return epilogue


def _norm(layer: _Layer, m: nn.Module, found: tuple[float, int], ops) -> None:
    """An RMSNorm (recognise.rms_norm_of's `found`: its epsilon and rounding kind) as ops.rms_norm."""
    layer.set_forward(m, steps._norm_forward, ops=ops, eps=found[0], kind=found[1])
    layer.kinds.append("rms_norm")


class _Layer:
    """One fused decoder layer: the modules whose forward was replaced, and how to put everything back."""

    def __init__(self, name: str):
        self.name, self.forwards, self.kinds, self.restore, self.epilogues = name, [], [], [], []

    def set_forward(self, module: nn.Module, forward, ops=None, slot=None, **state) -> None:
        """`module` runs `forward(self, ...)`: its class becomes the subclass of its own that has it (one per class
        and forward, with the class's name), `ops` is what steps.ops_of(module) returns, `slot` (an object the forward
        changes as it runs, or the key of one set before) what steps.slot(module) returns, and each of `state`
        becomes its attribute `_hgemm_<name>`. The module itself holds only values its forward reads (ints, strings,
        tensors): so torch.compile can skip its guards, and its parent's, while their dicts are unchanged."""
        base = type(module)
        cls = _classes.get((base, forward))
        if cls is None:
            cls = _classes[(base, forward)] = type(base.__name__, (base,), {
                "forward": forward, "__module__": base.__module__, "__qualname__": base.__qualname__,
                "_hgemm_base": base})
        if ops is not None:
            state["ops_key"] = steps.keep_ops(ops)
        if slot is not None:
            if not isinstance(slot, int):
                slot = steps.keep_slot(slot)
                weakref.finalize(module, steps.drop_slot, slot)  # a model deleted without unpatch lets it go too
            state["slot"] = slot
        for name, value in state.items():
            object.__setattr__(module, f"_hgemm_{name}", value)
        module.__class__ = cls
        self.forwards.append(module)
        _forwards.add(module)

    @staticmethod
    def put_back(module: nn.Module) -> None:
        """`module` as it was before set_forward: its own class, no `_hgemm_` attributes."""
        module.__class__ = type(module)._hgemm_base
        if "_hgemm_slot" in module.__dict__:
            steps.drop_slot(module.__dict__["_hgemm_slot"])
        for name in [n for n in module.__dict__ if n.startswith("_hgemm_")]:
            del module.__dict__[name]
        _forwards.discard(module)


def _gate_up_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(steps.ops_of(self).fused_linear(x, self.hgemm_gate_up_weight, self.hgemm_gate_up_bias,
                                                          self._hgemm_epilogue, None))


def _gate_up(layer: _Layer, mlp: nn.Module, ops, kind: str) -> None:
    """gate and up (two projections, or one gate_up_proj of gate's rows then up's: `kind`) as one gated GEMM on
    their interleaved weight, the only copy."""
    epilogue = recognise.gated_epilogue(recognise.act_of(mlp), _epilogue_module(ops))
    owners = (mlp.gate_proj, mlp.up_proj) if kind == "pair" else (mlp.gate_up_proj,)
    if epilogue is None or len({m.bias is None for m in owners}) > 1 or len({m.weight.shape for m in owners}) > 1:
        return None

    def halves(name: str):  # gate's and up's weight or bias, or None
        first = getattr(owners[0], name)
        if first is None:
            return None
        return tuple(getattr(m, name).detach() for m in owners) if kind == "pair" else first.detach().chunk(2, dim=0)

    merge = _epilogue_module(ops).interleave_gate_up
    for name in ("weight", "bias"):
        parts = halves(name)
        mlp.register_buffer(f"hgemm_gate_up_{name}", None if parts is None else merge(*parts, dim=0),
                            persistent=False)
    params = [p for m in owners for p in (m.weight, m.bias) if p is not None]
    for p in params:  # the merged buffer is the only copy
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    layer.set_forward(mlp, _gate_up_forward, ops=ops, epilogue=epilogue)

    def restore():
        split = _epilogue_module(ops).split_gate_up
        for name, owner_params in (("weight", [m.weight for m in owners]), ("bias", [m.bias for m in owners])):
            merged_buffer = getattr(mlp, f"hgemm_gate_up_{name}")
            if merged_buffer is None:
                continue
            gate_up = split(merged_buffer, dim=0)
            values = gate_up if kind == "pair" else (torch.cat(gate_up, dim=0),)
            for p, v in zip(owner_params, values, strict=True):
                p.data = v.contiguous()
        del mlp.hgemm_gate_up_weight, mlp.hgemm_gate_up_bias

    layer.restore.append(restore)
    layer.kinds.append("gate_up")
    layer.epilogues.append(epilogue)


def _act_mlp_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adds = self._hgemm_adds
    if self.training and (self._hgemm_dropout or adds):  # dropouts that are no identities (a residual MLP's may
        return self._hgemm_base.forward(self, x, *args, **kwargs)  # be a function call): its own forward
    first = getattr(self, self._hgemm_first)
    y = steps.ops_of(self).fused_linear(x, recognise.nk_weight(first), first.bias, self._hgemm_epilogue, None)
    if self._hgemm_second is None:
        return y
    second = getattr(self, self._hgemm_second)
    if not adds:
        return second(y)
    r = args[0] if len(args) == 1 and not kwargs else list(  # positional, as BLOOM and MPT call it: no binding
        self._hgemm_signature.bind(self, x, *args, **kwargs).arguments.values())[2]
    return steps.ops_of(self).fused_linear(y, recognise.nk_weight(second), second.bias, "residual", r)


def _residual_norm_forward(self, *args, **kwargs) -> torch.Tensor:
    if self.training and self._hgemm_dropout:  # its dropouts are no identities: its own forward
        return self._hgemm_base.forward(self, *args, **kwargs)
    h, r = args if len(args) == 2 and not kwargs else list(  # positional, as BERT calls it: no binding
        self._hgemm_signature.bind(self, *args, **kwargs).arguments.values())[1:3]
    lin = getattr(self, self._hgemm_linear)
    y = steps.ops_of(self).fused_linear(h, lin.weight, lin.bias, "residual", r)
    return y if self._hgemm_norm is None else getattr(self, self._hgemm_norm)(y)


def _act_mlp(layer: _Layer, mlp: nn.Module, ops, found) -> None:
    """An MLP second(act(first(x))), act(first(x)), or second(act(first(h))) + r (recognise.plain_mlp's Chain
    `found`), with the activation in the first GEMM (and the residual in the second's)."""
    steps.as_nk(layer, getattr(mlp, found.first))
    if found.residual:
        steps.as_nk(layer, getattr(mlp, found.second))
    dropout = any(isinstance(c, nn.Dropout) and c.p > 0 for c in mlp.children())
    layer.set_forward(mlp, _act_mlp_forward, ops=ops, first=found.first, second=found.second,
                      epilogue=found.epilogue, adds=found.residual, dropout=dropout,
                      signature=inspect.signature(type(mlp).forward))
    layer.kinds += ["mlp_act"] + (["down_residual"] if found.residual else [])
    layer.epilogues.append(found.epilogue)


def fuse(model: nn.Module, ops, norms: bool = True) -> dict[str, int]:
    """Fuse every recognised decoder layer of `model`, then elsewhere every attention's q/k/v, MLP
    second(act(first(x))) (recognise.plain_mlp), rotary embedding (is_rotary) and, where `norms` and `ops` has
    rms_norm, Llama-style RMSNorm (once; a fused layer is left alone); returns how many of each kind (KINDS) were
    fused."""
    counts = dict.fromkeys(KINDS, 0)
    norms = norms and hasattr(ops, "rms_norm")
    for name, module, attn_name in list(steps.decoder_layers(model)):
        if _FUSED in module.__dict__:
            continue
        layer = module.__dict__[_FUSED] = _Layer(name)
        with torch.no_grad():
            # probes first, on the modules as they are
            mlp_name = steps.mlp_name(module)
            mlp = getattr(module, mlp_name or "", None)
            plain = recognise.plain_mlp(mlp, _epilogue_module(ops)) if mlp is not None else None
            first, down = plain[:2] if plain else ("up_proj", "down_proj")  # the MLP's first and last projection
            has_down = recognise.linear_like(getattr(mlp, down, None))
            gated, returns_down = recognise.probe_mlp(mlp, down, first) if has_down else (None, False)
            down = down if returns_down else None  # None: only o_proj takes its residual add
            llama = steps.llama_parts(module, mlp_name, down)  # the parts of Llama's steps
            found = steps.layer_steps(module, mlp_name) if mlp is not None and llama else None
            kind, *mlp_output = found or (None, False, False, False)
            # a layer that takes the MLP's output as a pair cannot take down's tensor; one that reshapes it can
            llama = llama and kind == "llama" and (down is None or not mlp_output[0])
            roles = steps.post_norm_roles(module, mlp_name) if norms and mlp is not None and kind is None else None
            post = [recognise.rms_norm_of(getattr(module, roles[i])) for i in (1, 3)] if roles else [None]
            post_norm = all(post)  # the norms after the attention and the MLP are ones the norm kernel computes
            names = recognise.qkv_names(getattr(module, attn_name))
            merged = names[0] if names and qkv.merge(layer, getattr(module, attn_name), ops, names) else ""
            if gated:
                _gate_up(layer, mlp, ops, gated)
            elif plain:
                _act_mlp(layer, mlp, ops, plain)
            elif mlp is None and (act := inline.inline_activation(module, _epilogue_module(ops))):
                inline.fold(layer, module, ops, act)  # OPT's, BART's fc1 and activation, inline in the layer
            if llama:
                pair = (getattr(module, n, None) for n in ("input_layernorm", "post_attention_layernorm"))
                folds = [norms and hasattr(ops, "norm_linear") and norm is not None and not owns(norm)
                         and recognise.rms_norm_of(norm) is not None for norm in pair]
                steps.residuals(layer, module, ops, mlp_name, down, mlp_output, bool(gated and folds[1]),
                                merged if folds[0] else "")
            elif post_norm:
                steps.post_norms(layer, module, ops, mlp_name, post, roles)
            elif kind is None and (down is not None or mlp is None):  # mlp None: an MLP inline in the layer
                found = adds.residual_steps(module, attn_name, mlp_name, down)
                if found is not None:
                    adds.fuse_adds(layer, module, ops, found)
            for norm in (getattr(module, n, None) for n in ("input_layernorm", "post_attention_layernorm")):
                found = recognise.rms_norm_of(norm) if norms and norm is not None and not owns(norm) else None
                if found is not None:
                    _norm(layer, norm, found, ops)
        if not layer.kinds:  # nothing recognised: the layer stays as it was
            del module.__dict__[_FUSED]
        for kind in layer.kinds:
            counts[kind] += 1
    for name, module in list(model.named_modules()):  # what decoder layers do not hold
        if _FUSED in module.__dict__ or owns(module):
            continue
        layer = module.__dict__[_FUSED] = _Layer(name)
        with torch.no_grad():
            _fuse_alone(layer, module, ops, norms)
        if not layer.kinds:
            del module.__dict__[_FUSED]
        for kind in layer.kinds:
            counts[kind] += 1
    return counts


def _fuse_alone(layer: _Layer, module: nn.Module, ops, norms: bool) -> None:
    """A module outside the decoder layers `fuse` looks into, if it is one of: an attention with plain q, k and v
    projections (recognise.qkv_names: a vision tower's, a cross-attention's, BERT's), a gated MLP
    (recognise.probe_mlp: an MoE block's shared expert, experts held as modules), a gateless MLP or a Linear and its
    activation (recognise.plain_mlp), a Linear whose output is added to a residual before a norm
    (recognise.residual_norm: BERT's output blocks), an RMSNorm (where `norms`), a rotary embedding."""
    names = recognise.qkv_names(module)
    if names:
        qkv.merge(layer, module, ops, names)
        return
    found = recognise.rms_norm_of(module) if norms else None
    plain = recognise.plain_mlp(module, _epilogue_module(ops), single=True) if found is None else None
    gated = (recognise.probe_mlp(module)[0] if found is None and plain is None and recognise.act_of(module) is not None
             and recognise.plain_linear(getattr(module, "down_proj", None)) else None)
    if found is not None:
        _norm(layer, module, found, ops)
    elif plain is not None:
        _act_mlp(layer, module, ops, plain)
    elif gated is not None:
        _gate_up(layer, module, ops, gated)
    elif recognise.is_rotary(module):
        layer.set_forward(module, steps._rotary_forward)
        layer.kinds.append("rotary")
    elif (added := recognise.residual_norm(module)) is not None:
        dropout = any(isinstance(c, nn.Dropout) and c.p > 0 for c in module.children())
        layer.set_forward(module, _residual_norm_forward, ops=ops, signature=inspect.signature(type(module).forward),
                          linear=added[0], norm=added[1], dropout=dropout)
        layer.kinds.append("residual_norm")


def unfuse(model: nn.Module) -> int:
    """Undo `fuse` on every layer of `model`: forwards, parameters (their own storage, the same values) and buffers
    as they were; returns how many layers were restored."""
    restored = 0
    for module in list(model.modules()):
        layer = module.__dict__.pop(_FUSED, None)
        if layer is None:
            continue
        for m in layer.forwards:
            _Layer.put_back(m)
        with torch.no_grad():
            for restore in layer.restore:
                restore()
        restored += 1
    return restored


def owns(module: nn.Module) -> bool:
    """Whether a fused layer runs this module with a forward of its own."""
    return module in _forwards


def patched_any() -> bool:
    """Whether any module still runs a fused layer's forward."""
    return len(_forwards) > 0


def describe(model: nn.Module) -> list[str]:
    """One line per fused layer: its name and what runs fused there."""
    words = {"qkv": "q/k/v as one GEMM", "gate_up": "gate/up as one gated GEMM",
             "mlp_act": "the activation in the GEMM before it", "o_residual": "o_proj + residual",
             "down_residual": "down_proj + residual",
             "parallel_residual": "the MLP's add in its last GEMM (attention and MLP in parallel)",
             "norm_residual": "post-norms + residual in one kernel each",
             "residual_norm": "the residual add (before a norm) in the GEMM",
             "rms_norm": "RMSNorm in one kernel",
             "norm_gate_up": "post_attention_layernorm and gate/up in one call (one kernel where gemv serves)",
             "norm_qkv": "input_layernorm and q/k/v in one call under torch.compile (one kernel where gemv serves)",
             "rotary": "rotary frequencies by broadcasting, no matmul"}
    lines = []
    for module in model.modules():
        layer = module.__dict__.get(_FUSED)
        if layer is not None:
            extra = f" ({', '.join(layer.epilogues)})" if layer.epilogues else ""
            kinds = [k for k in KINDS if k in layer.kinds]
            norms = layer.kinds.count("rms_norm")
            lines.append(f"{layer.name}: " + ", ".join(words[k] if k != "rms_norm" or norms == 1 else
                                                       f"{norms} RMSNorms in one kernel each" for k in kinds) + extra)
    return lines
