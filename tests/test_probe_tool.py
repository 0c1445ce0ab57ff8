"""tools/probe_sm90.py on the CPU: every probe anchor and variant still applies to the sm90_wgmma template and the
probed kernels compile (so a template change cannot silently break the tool), and the phase arithmetic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sandbox.build import compile_cuda

_spec = importlib.util.spec_from_file_location("probe_sm90", Path(__file__).parents[1] / "tools" / "probe_sm90.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

PLAIN = {"block_m": 64, "block_n": 128, "consumers": 1, "stages": 4}
CASES = [
    (PLAIN, "nk", "setup+prefetch+nofence"),
    (PLAIN, "nk", "nk2box"),
    (PLAIN, "kn", "kdesc"),
    ({**PLAIN, "loader": "cp_async"}, "kn", ""),
    ({**PLAIN, "block_n": 64, "stages": 8, "split_k": 8}, "nk", ""),
    ({**PLAIN, "block_n": 64, "stages": 8, "k_groups": 2}, "kn", ""),
    ({**PLAIN, "cluster_m": 2}, "kn", ""),
    ({"block_m": 16, "block_n": 64, "consumers": 1, "stages": 12, "split_k": 2, "swap_ab": True, "epilogue": "smem"},
     "kn", ""),
    ({"block_m": 128, "block_n": 256, "consumers": 2, "stages": 3, "persistent": True, "epilogue": "tma"}, "kn", ""),
]


@pytest.mark.parametrize("params,layout,variant", CASES, ids=lambda x: str(x))
def test_probes_apply_and_compile(params, layout, variant):
    src = probe.source(params, layout, variant)
    assert src.count("probe_buf[blockIdx.x") >= 6
    b = compile_cuda(src, "sm_90a", cache_dir=None)
    assert b.ok, (b.error or "") + (b.log or "")[-1500:]


def test_a_missing_anchor_is_named(monkeypatch):
    monkeypatch.setattr(probe, "PROBES", probe.PROBES + [("no such text", "")])
    with pytest.raises(AssertionError, match="no such text"):
        probe.source(PLAIN, "nk")


def _row(start, first_copy, first, main_end, end, sm, a=0, b=0):
    # slots: start, first full, mainloop end, end, SM, first copy issued, two marks (ns)
    return [start, first, main_end, end, sm, first_copy, a, b]


def test_phases_are_per_cta_differences_in_microseconds():
    rows = [_row(1000, 1500, 2000, 5000, 6000, 3), _row(3000, 3600, 4000, 9000, 9500, 7), [0] * 8]  # third: no run
    p, counts = probe.summarize(rows)
    assert p["start"] == (0.0, 1.0, 2.0) and p["end"] == (5.0, 6.75, 8.5)
    assert p["first stage"] == (1.0, 1.0, 1.0) and p["mainloop"] == (3.0, 4.0, 5.0)
    assert p["epilogue"] == (0.5, 0.75, 1.0) and p["first copy"] == (0.5, 0.55, 0.6)
    assert counts == {"ctas": 2, "sms": 2, "per sm": 1}
    assert "sum" not in p


def test_split_k_and_setup_marks():
    rows = [_row(0, 400, 1000, 5000, 7000, 1, a=5500, b=6500), _row(0, 400, 1000, 5000, 7000, 1, a=5600, b=6600)]
    p, counts = probe.summarize(rows)
    assert p["partials"] == (0.5, 0.55, 0.6) and p["sum"] == (1.0, 1.0, 1.0) and p["close"] == (0.4, 0.45, 0.5)
    assert counts["per sm"] == 2
    s, _ = probe.summarize(rows, setup=True)
    assert s["barrier"] == (5.5, 5.55, 5.6) and "sum" not in s
    text = probe.line("x", 8.0, 9.0, p, counts)
    assert "graph 8.00 µs" in text and "ctas 2 on 1 SMs (<= 2 each)" in text and "sum 1.00/1.00/1.00" in text
