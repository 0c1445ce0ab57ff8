"""Kernel template families: each folder holds a Jinja CUDA source and its typed parameter space."""

from __future__ import annotations

from templates.family import Family
from templates.gemv.space import Gemv
from templates.naive.space import Naive
from templates.sm80_mma.space import Sm80Mma
from templates.sm90_wgmma.space import Sm90Wgmma

FAMILIES: dict[str, Family] = {f.name: f for f in (Sm90Wgmma(), Sm80Mma(), Naive(), Gemv())}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown template family {name!r}: known are {', '.join(FAMILIES)}") from None


def families_for_arch(arch: str) -> list[Family]:
    """The families the built-in search walks for this arch."""
    return [f for f in FAMILIES.values() if arch in f.arches and f.searched]
