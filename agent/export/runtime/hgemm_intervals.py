"""Which exported kernel serves a call's M, and its launch at that M (the Python launch path's side; hgemm_op.cpp
does the same in C++).

Shipped in an hgemm-agent export next to hgemm_ops.py. Each series (a problem key after its M:
`N_K:layout:dtype[:bias][:epilogue]`) holds its kernels' M intervals (a manifest entry's `serves`), disjoint and
sorted by their starts; `find` is a binary search over the starts. A kernel's launch at M comes from its segment
holding M (`segments`, sorted by their first M; another binary search), with M written into the tensor-map
dimensions that follow it (`m_dims`). Entries from before M ranges (no `serves`, `segments` or `m_dims`) serve
their key's M with their `grid` and boxes.
"""

from __future__ import annotations

import bisect


def key_m(key: str) -> tuple[int, int]:
    """The M a problem key names: 'LO-HI_N_K:...' -> (LO, HI), 'M_N_K:...' -> (M, M)."""
    text = key.split("_", 1)[0]
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def series_of(key: str) -> str:
    """What a problem key names besides M: 'M_N_K:layout:...' -> 'N_K:layout:...'."""
    return key.split("_", 1)[1]


def serves(key: str, entry: dict) -> list[tuple[int, int]]:
    return [tuple(piece) for piece in entry.get("serves", [key_m(key)])]


def segments(key: str, entry: dict) -> list[dict]:
    return entry.get("segments") or [{"m": key_m(key)[0], "grid": entry["grid"],
                                      "boxes": [t["box"] for t in entry.get("tensor_maps", [])]}]


class Index:
    """The manifest's kernels (and the problems cuBLAS serves, for explanations) by series and M."""

    def __init__(self, manifest: dict):
        claims: dict[str, list[tuple[int, int, str]]] = {}
        for key, entry in manifest["kernels"].items():
            claims.setdefault(series_of(key), []).extend((lo, hi, key) for lo, hi in serves(key, entry))
        self.tables = {s: _table(c) for s, c in claims.items()}
        self.cublas: dict[str, list[tuple[int, int, str]]] = {}
        for key in manifest.get("cublas", []):
            self.cublas.setdefault(series_of(key), []).append((*key_m(key), key))
        for key, entry in manifest["kernels"].items():  # a bucket its kernel serves a part of: cuBLAS the rest
            lo, hi = key_m(key)
            if serves(key, entry) != [(lo, hi)]:
                self.cublas.setdefault(series_of(key), []).append((lo, hi, key))
        self._starts: dict[str, list[int]] = {}

    def find(self, m: int, series: str) -> str | None:
        """The key of the kernel serving M of the series, or None."""
        hit = self.interval(m, series)
        return hit[2] if hit else None

    def interval(self, m: int, series: str) -> tuple[int, int, str] | None:
        """(lo, hi, key): the interval of the series holding M and its kernel, or None."""
        table = self.tables.get(series)
        if table is None:
            return None
        starts, intervals = table
        i = bisect.bisect_right(starts, m) - 1
        return intervals[i] if i >= 0 and m <= intervals[i][1] else None

    def find_key(self, key: str | None) -> str | None:
        """find() for a call's own problem key ('M_N_K:...'), or None."""
        return None if key is None else self.find(key_m(key)[0], series_of(key))

    def describe(self, m: int, series: str) -> str:
        """Which interval of the series holds M and what serves it, or what the series' intervals are."""
        if (hit := self.interval(m, series)) is not None:
            lo, hi, key = hit
            return f"kernel {key} (M={m} in {lo}" + (f"-{hi})" if hi != lo else ")")
        hit = next((key for lo, hi, key in self.cublas.get(series, []) if lo <= m <= hi), None)
        if hit is not None:
            return f"M={m} is in {hit}, which cuBLAS serves"
        if series not in self.tables:
            return "shape not tuned"
        tuned = ", ".join(f"{lo}" + (f"-{hi}" if hi != lo else "") for lo, hi, _ in self.tables[series][1])
        return f"M={m} not tuned (tuned M: {tuned})"

    def launch_at(self, key: str, entry: dict, m: int) -> tuple[tuple[int, int, int], list[tuple]]:
        """The grid and the tensor maps (operand, dims, box, swizzle, strides) of the kernel at M."""
        segs = segments(key, entry)
        if key not in self._starts:
            self._starts[key] = [s["m"] for s in segs]
        seg = segs[max(0, bisect.bisect_right(self._starts[key], m) - 1)]
        maps = []
        for t, box in zip(entry.get("tensor_maps", []), seg["boxes"], strict=True):
            dims = tuple(m if i in t.get("m_dims", ()) else d for i, d in enumerate(t["dims"]))
            maps.append((t["operand"], dims, tuple(box), t["swizzle"], tuple(t.get("strides") or ())))
        return tuple(seg["grid"]), maps


def _table(claims: list[tuple[int, int, str]]) -> tuple[list[int], list[tuple[int, int, str]]]:
    intervals = sorted(claims)
    for (_, hi, a), (lo, _, b) in zip(intervals, intervals[1:], strict=False):
        if lo <= hi:
            raise ValueError(f"manifest: {a} and {b} both serve M={lo}")
    return [lo for lo, _, _ in intervals], intervals
