"""The roofline floor: one definition from the device's facts, the same figure in `show`, `bench` and the search."""

from __future__ import annotations

import io
import re

from rich.console import Console

from agent.bench import bench_offline
from agent.report import show_run
from core.device import H200, DeviceFacts
from core.records import BaselineJob, EvalResult, Problem, Status, Timing
from core.roofline import compute_us, floor_pct, floor_us, memory_us
from tests.helpers import fake_evaluate, populated_run

SLOW_GPU = DeviceFacts.from_dict({"name": "Slow GPU", "tensor_tflops": 100.0, "hbm_tbps": 1.0})


def test_the_floor_comes_from_the_device_facts():
    big, tiny = Problem(8192, 8192, 8192), Problem(16, 4096, 4096)
    assert floor_us(big, H200) == compute_us(big, H200) == big.flops / (H200.tensor_tflops * 1e6)  # compute-bound
    assert floor_us(tiny, H200) == memory_us(tiny, H200) == tiny.operand_bytes / (H200.hbm_tbps * 1e6)
    assert floor_us(big, SLOW_GPU) == big.flops / 100e6
    assert floor_us(big, H200, tensor_share=0.5) == 2 * floor_us(big, H200)
    assert floor_pct(big, H200, 2 * floor_us(big, H200)) == 50
    assert not hasattr(Problem, "floor_us")  # no second definition with rates of its own


def _show_floor(store) -> dict[str, str]:
    console = Console(width=250, record=True, file=io.StringIO())
    console.print(show_run(store))
    return {m[1]: m[2] for m in re.finditer(r"(\d+_\d+_\d+) .* (\d+)% ", console.export_text())}


def test_show_and_bench_give_the_same_percent_of_the_floor_of_the_recorded_device(tmp_path):
    p = Problem(1000, 3000, 2000)
    store = populated_run(tmp_path / "r", problems=(p,), n=4)
    win = store.winner(p)
    assert _show_floor(store)[p.mnk] == f"{floor_pct(p, H200, win.result.time_us):.0f}"  # no device: H200 stand-in
    store.set_meta("device", SLOW_GPU.to_dict())
    assert _show_floor(store)[p.mnk] == f"{floor_pct(p, SLOW_GPU, win.result.time_us):.0f}"

    def evaluate(job):
        if isinstance(job, BaselineJob):
            return EvalResult("cublas", Status.OK, cublas_warm=Timing(30, 29, 31, 10),
                              cublas_cold=Timing(33, 32, 34, 10))
        return fake_evaluate(job)

    [row] = bench_offline(evaluate, [store], [p], progress=lambda s: None, device=SLOW_GPU)
    assert row.floor_pct == floor_pct(p, SLOW_GPU, row.ours_warm_us)
