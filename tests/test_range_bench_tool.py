"""tools/range_bench.py: issue 34's shapes files (Llama-3-8B ranges to search, M values off the buckets' middles to
bench) read back through the shapes parser."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from agent import buckets
from agent.shapes import read_shapes_file

_spec = importlib.util.spec_from_file_location("range_bench", Path(__file__).parents[1] / "tools" / "range_bench.py")
tool = importlib.util.module_from_spec(_spec)
sys.modules["range_bench"] = tool
_spec.loader.exec_module(tool)


def test_ranges_and_bench_points(tmp_path):
    assert tool.main(["--out", str(tmp_path), "--seed", "3"]) == 0
    ranges, bench = read_shapes_file(tmp_path / "ranges.txt"), read_shapes_file(tmp_path / "bench.txt")
    assert len(ranges) == 8 and {p.m_range for p in ranges} == {(1, 256)} and {p.dtype for p in ranges} == {"f16",
                                                                                                        "bf16"}
    middles = {p.m for p in buckets.plan(ranges) if p.m_range[1] > p.m_range[0]}
    assert middles == tool.middles(256) and {4, 7, 13, 21, 29} <= middles
    assert len(bench) == 8 * 64 and not {p.m for p in bench} & middles
    per_series = {}
    for p in bench:
        per_series.setdefault((p.n, p.k, p.dtype), []).append(p.m)
    assert all(len(ms) == 64 == len(set(ms)) and max(ms) <= 256 for ms in per_series.values())
    assert set(range(1, 33)) - middles <= set(per_series[(4096, 4096, "f16")])
    first = (tmp_path / "bench.txt").read_text()
    tool.main(["--out", str(tmp_path), "--seed", "3"])
    assert (tmp_path / "bench.txt").read_text() == first  # the same seed, the same files
