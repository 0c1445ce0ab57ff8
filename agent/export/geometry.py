"""An exported kernel's launch at every M it serves, and which M each exported problem serves.

`launch_table` evaluates the family's trusted launch rule at each M of the problem's range and writes what varies
as segments of M: within a segment the grid and the tensor maps' boxes are the same, and each tensor-map dimension
that equals M at every M of the range is marked (`m_dims`) for the op to fill in with the call's M. Everything
else the rule returns (block, shared memory, the other dims, strides, swizzle) must be the same at every M, or the
kernel is not exported for the range; the workspace and counters are sized for the largest M. The op rebuilds the
launch at M from the segment holding M (binary search), so it is the rule's own launch at every M of the range.

`resolve` turns the M ranges the problems of one series claim into the disjoint intervals each serves: a narrower
claim wins where two overlap (a problem of one M inside a bucket), the first listed on a tie.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from typing import Any

from core.device import DeviceFacts
from core.records import LaunchSpec, Problem
from templates.family import Family


class GeometryError(ValueError):
    """The launch rule changes something with M that the op does not recompute at the call."""


def launch_table(family: Family, params: dict[str, Any], problem: Problem, device: DeviceFacts) -> dict[str, Any]:
    """The manifest's launch fields for the kernel over every M of problem.m_span; GeometryError where the rule
    varies with M beyond the grid, the boxes and the dimensions equal to M."""
    lo, hi = problem.m_span

    def at(m: int) -> LaunchSpec:
        return family.launch(params, dataclasses.replace(problem, m=m, m_range=None), device)

    specs = [(m, at(m)) for m in range(lo, hi + 1)]
    first = specs[0][1]
    for m, spec in specs:
        if (spec.block, spec.smem_bytes, spec.kernel_name, len(spec.tensor_maps), spec.overlap) != \
                (first.block, first.smem_bytes, first.kernel_name, len(first.tensor_maps), first.overlap):
            raise GeometryError(f"the launch rule changes the block, shared memory, tensor maps or overlap at M={m}")
    # M's dimensions: those equal to M at every M of the span (one M: at the next too, so that K or N = M is not M)
    m_dims = [set(range(len(t.dims))) for t in first.tensor_maps]
    for m, spec in specs + ([(lo + 1, at(lo + 1))] if lo == hi else []):
        for marked, t in zip(m_dims, spec.tensor_maps, strict=True):
            marked &= {i for i, d in enumerate(t.dims) if d == m}
    for t, marked in zip(first.tensor_maps, m_dims, strict=True):
        if not t.strides and marked - {len(t.dims) - 1}:
            raise GeometryError(f"the tensor map over {t.operand} has M as an inner dimension of a packed tensor: its "
                                "strides would change with M")
    segments: list[dict[str, Any]] = []
    for m, spec in specs:
        _same_maps(first, spec, m_dims, m)
        boxes = [list(t.box) for t in spec.tensor_maps]
        if not segments or segments[-1]["grid"] != list(spec.grid) or segments[-1]["boxes"] != boxes:
            segments.append({"m": m, "grid": list(spec.grid), "boxes": boxes})
    at = dict(specs)[problem.m]
    maps = [{**asdict(t), "m_dims": sorted(marked)} for t, marked in zip(at.tensor_maps, m_dims, strict=True)]
    return {"m_range": [lo, hi], "grid": list(at.grid), "block": list(at.block), "smem_bytes": at.smem_bytes,
            "tensor_maps": maps, "segments": segments,
            "workspace_bytes": max(s.workspace_bytes for _, s in specs), "counters": max(s.counters for _, s in specs),
            "overlap": first.overlap}


def _same_maps(first: LaunchSpec, spec: LaunchSpec, m_dims: list[set[int]], m: int) -> None:
    for t0, t, marked in zip(first.tensor_maps, spec.tensor_maps, m_dims, strict=True):
        fixed0 = [d for i, d in enumerate(t0.dims) if i not in marked]
        fixed = [d for i, d in enumerate(t.dims) if i not in marked]
        if (t0.operand, t0.swizzle, t0.strides, len(t0.dims), fixed0) != (t.operand, t.swizzle, t.strides,
                                                                           len(t.dims), fixed):
            raise GeometryError(f"the launch rule's tensor map over {t.operand} changes with M at M={m} beyond the "
                                "dimensions equal to M and its box")


def resolve(claims: list[tuple[str, tuple[int, int]]]) -> dict[str, list[tuple[int, int]]]:
    """claims: (key, (lo, hi)) of one series, in the run's order (a key may claim several) -> each key's disjoint
    intervals, sorted; a narrower claim wins where claims overlap."""
    taken: list[tuple[int, int]] = []
    out: dict[str, list[tuple[int, int]]] = {}
    order = sorted(range(len(claims)), key=lambda i: (claims[i][1][1] - claims[i][1][0], i))
    for i in order:
        key, piece = claims[i]
        pieces = [piece]
        for a, b in taken:
            pieces = [q for x, y in pieces for q in ((x, min(y, a - 1)), (max(x, b + 1), y)) if q[0] <= q[1]]
        out[key] = sorted(out.get(key, []) + pieces)
        taken += pieces
    return out
