"""Export folders for the tests of the exported op: loading hgemm_ops from one, and a hand-made export whose
manifest names small problems (so CPU tensors can have tuned shapes; its cubins are never loaded on the CPU)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path

from agent.export.writer import copy_runtime

_names = itertools.count()


def load_ops(folder: Path):
    """A fresh hgemm_ops module from an export folder (its own manifest and launch-path state), registered as an
    import would (torch.compile looks functions' modules up by name)."""
    name = f"hgemm_ops_test_{next(_names)}"
    spec = importlib.util.spec_from_file_location(name, folder / "hgemm_ops.py")
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def small_export(folder: Path, keys: list[str]) -> Path:
    """An export folder with the runtime files and a kernel entry (no tensor maps) for each problem key, written as
    manifests were before M ranges (no serves, segments or m_dims: the runtime derives them)."""
    entry = {"file": "fake.cu", "cubin": "fake.cubin", "arch": "sm_90a", "grid": [1, 1, 1], "block": [128, 1, 1],
             "smem_bytes": 0, "tensor_maps": [], "workspace_bytes": 0, "counters": 0}
    return export_folder(folder, {k: entry for k in keys})


def export_folder(folder: Path, kernels: dict[str, dict], cublas: tuple[str, ...] = ()) -> Path:
    """An export folder with the runtime files and a manifest of these kernel entries (each with the cubin
    fake.cubin, never loaded on the CPU) and cuBLAS problems."""
    folder.mkdir(parents=True)
    copy_runtime(folder)
    (folder / "fake.cubin").write_bytes(b"\x7fELF never loaded on the CPU")
    kernels = {k: {"file": "fake.cu", "cubin": "fake.cubin", "arch": "sm_90a", **e} for k, e in kernels.items()}
    (folder / "manifest.json").write_text(json.dumps({"run": "test", "kernels": kernels, "cublas": list(cublas)}))
    return folder


def with_helper_kernels(folder: Path, section: str, arch: str = "sm_90a") -> Path:
    """The export in `folder` with its helper kernels of one manifest section ("gated": the gated fallback's, "norm":
    the RMSNorm's) built for `arch` and listed in its manifest."""
    from agent.export.writer import gated_fallbacks, norm_kernels

    manifest = json.loads((folder / "manifest.json").read_text())
    manifest[section] = {"gated": gated_fallbacks, "norm": norm_kernels}[section](folder, arch)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def helper_ops_on_this_gpu(folder: Path, section: str, compiled: bool, monkeypatch):
    """A small export in `folder` with one section of helper kernels built for this GPU's arch, loaded through the
    compiled op (compiled=True) or the Python launch path."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    monkeypatch.setenv("HGEMM_OPS_COMPILED", "1" if compiled else "0")
    ops = load_ops(with_helper_kernels(small_export(folder, ["16_24_8:nk:f16"]), section,
                                       "sm_90a" if major == 9 else f"sm_{major}{minor}"))
    assert ops.path() == ("compiled" if compiled else "python")
    return ops
