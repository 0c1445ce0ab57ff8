"""Patching a model with an export: its decoder layers fused (hgemm_fuse.py), its other tuned nn.Linear and
transformers Conv1D layers routed through the exported op, and, where asked, its tuned F.linear / matmul calls.

Shipped in an hgemm-agent export next to hgemm_ops.py, which calls it with itself as `ops` (the launch path
`ops._eager`, the manifest's index `ops.INDEX`, `ops.problem_key`, `ops.parse_key`, `ops.DTYPES`, `ops.MANIFEST`).
"""

from __future__ import annotations

import importlib.util
import sys
import types
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


def _load_fuse() -> types.ModuleType:
    name = f"{__name__}__hgemm_fuse"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("hgemm_fuse.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


fuse = _load_fuse()
# each kind of patch: the modules it patched, and the key in a module's dict that keeps its own forward from before
_patched = (weakref.WeakSet(), "_hgemm_own_forward")  # the nn.Linear / Conv1D layers routed through the op
_wrapped = (weakref.WeakSet(), "_hgemm_own_model_forward")  # the models whose forward runs under MatmulMode
_names: list = []  # inductor's kernel naming before patch changed it (short_kernel_names), until the last unpatch
MATMULS = {torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm}
ADDMMS = {torch.addmm, torch.Tensor.addmm}


def _tuned(ops, layout: str) -> set[tuple]:
    """(N, K, dtype, bias) of the exported kernels with this B layout and no epilogue, any M."""
    return {(n, k, ops.DTYPES[dtype], bias) for key in ops.MANIFEST["kernels"]
            for _, n, k, lay, dtype, bias, epi in [ops.parse_key(key)] if lay == layout and epi == "none"}


def _conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's projections: torch.addmm(bias, x, W), W K x N)."""
    return (type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None
            and module.weight.dim() == 2 and getattr(module, "nf", None) == module.weight.shape[1])


class MatmulMode(TorchFunctionMode):
    """Routes F.linear, torch.matmul / Tensor.matmul / @ / mm, and addmm with a bias vector, whose (M, N, K, dtype,
    bias) was tuned (B K x N, or N x K: a weight, or a transposed view of one) through the exported op; every other
    call runs as it was."""

    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, ops = kwargs or {}, self.ops
        if func is F.linear and 2 <= len(args) + len(kwargs) <= 3 and set(kwargs) <= {"bias"}:
            x, w, bias = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
            if ops.INDEX.find_key(ops.problem_key(x, w, bias, "nk")):
                return ops._eager.linear(x, w, bias)
        elif not kwargs and ((func in MATMULS and len(args) == 2) or (func in ADDMMS and len(args) == 3)):
            bias, a, b = (None, *args) if func in MATMULS else args
            if bias is None or bias.dim() == 1:
                if ops.INDEX.find_key(ops.problem_key(a, b, bias, "kn")):
                    return ops._eager.mm(a, b, bias)
                if b.dim() == 2 and ops.INDEX.find_key(ops.problem_key(a, b.t(), bias, "nk")):
                    return ops._eager.linear(a, b.t(), bias)
        return func(*args, **kwargs)


def short_kernel_names() -> None:
    """Inductor names each Triton kernel after the ops it fuses, Triton's cache cuts a kernel's file names at 150
    characters, and inductor's static launcher looks for the cubin under the whole name: a kernel named longer than
    that launches through Triton's own launcher, several µs more host time a launch (docs/decisions.md
    `short-kernel-names`). A fused layer's attention inputs (q's rotary, the mask and the SDPA's inputs in one kernel)
    get such names. Where inductor names kernels its default way ("original_aten"), names become short
    (`triton.descriptive_names = False`: triton_poi_fused_0 ...) until the last patched model is unpatched."""
    try:
        from torch._inductor import config
    except ImportError:  # a build of torch without inductor
        return
    if getattr(config.triton, "descriptive_names", None) != "original_aten":
        return
    if not _names:
        _names.append(config.triton.descriptive_names)
    config.triton.descriptive_names = False


def _names_back() -> None:
    """Inductor's kernel naming as it was before patch changed it, once no patched module is left."""
    if _names and not _patched[0] and not _wrapped[0] and not fuse.patched_any():
        from torch._inductor import config
        config.triton.descriptive_names = _names.pop()


def _save_forward(kind: tuple[weakref.WeakSet, str], module: nn.Module) -> None:
    """Marks `module` as patched and keeps a forward of its own (hooks and wrappers set one) in its own dict: a
    forward bound to the module, kept in a module-level dict, would keep the module alive."""
    saved, key = kind
    saved.add(module)
    if "forward" in module.__dict__:
        module.__dict__[key] = module.__dict__["forward"]


def patch(ops, model: nn.Module, matmul: bool = False, fuse_layers: bool = True,
          norms: bool = True) -> dict[str, int]:
    """Fuse `model`'s decoder layers (hgemm_fuse: their projections call ops.linear / ops.fused_linear, which run
    an exported kernel where one serves the call and PyTorch otherwise; with `norms` its Llama-style RMSNorms call
    ops.rms_norm), then route its other nn.Linear layers (nn.Linear's forward, or a subclass's that computes the
    same: recognise.plain_linear; weight N x K with a tuned (N, K, dtype, bias)) through `linear` and its tuned
    transformers Conv1D layers (weight K x N) through `mm`; each call still checks its M and operands and falls
    back to PyTorch (the same call) where they were not tuned. matmul=True also runs the model's forward under
    MatmulMode (a TorchFunctionMode: it costs host time on every torch call inside). Where it patched anything,
    inductor's kernel names become short (short_kernel_names). Returns how many of each kind: the fusions
    (hgemm_fuse.KINDS) and the routed layers ("linear")."""
    ops._resolve()
    counts = fuse.fuse(model, ops, norms) if fuse_layers else dict.fromkeys(fuse.KINDS, 0)
    tuned = {"nk": _tuned(ops, "nk"), "kn": _tuned(ops, "kn")}
    routed = 0
    for module in model.modules():
        if module in _patched[0] or fuse.owns(module):  # patched already, or run by a fused layer
            continue
        if getattr(module, "weight", None) is None or module.weight.dim() != 2:  # a fused gate or up: no weight
            continue
        if isinstance(module, nn.Linear) and (type(module).forward is nn.Linear.forward
                                              or fuse.recognise.plain_linear(module)):
            layout, (n, k), call = "nk", module.weight.shape, "linear"
        elif _conv1d(module):
            layout, (k, n), call = "kn", module.weight.shape, "mm"
        else:
            continue
        if (n, k, module.weight.dtype, module.bias is not None) not in tuned[layout]:
            continue
        _save_forward(_patched, module)
        module.forward = types.MethodType(
            lambda self, x, call=call: getattr(ops._eager, call)(x, self.weight, self.bias), module)
        routed += 1
    if matmul and model not in _wrapped[0]:
        inner = model.forward
        _save_forward(_wrapped, model)

        def forward(*args, **kwargs):
            with MatmulMode(ops):
                return inner(*args, **kwargs)

        model.forward = forward
    if routed or any(counts.values()) or matmul:
        short_kernel_names()
    return {**counts, "linear": routed}


def unpatch(model: nn.Module) -> int:
    """Undo patch(model) (and any patch of its submodules): the MatmulMode wrapper, the routed layers, the fused
    layers; returns how many modules were restored."""
    restored = 0
    for saved, key in (_wrapped, _patched):  # the MatmulMode wrapper first: it was put on last
        for module in model.modules():
            if module in saved:
                saved.discard(module)
                del module.forward
                if key in module.__dict__:
                    module.forward = module.__dict__.pop(key)
                restored += 1
    restored += fuse.unfuse(model)
    _names_back()
    return restored
