"""Device-time measurement: CUDA graphs of back-to-back launches replayed between CUDA events (GPU worker only).

Warm L2: R launches back to back in one graph (R chosen so a replay lasts >= TARGET_MS). Cold L2: each launch
preceded by a write of a buffer twice the L2's size; a graph of the writes alone is timed too and its time
subtracted. Candidate and reference graphs are replayed interleaved, so drift (clocks, temperature) hits both.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

from core.records import Timing

TARGET_MS = 1.0
MAX_LAUNCHES = 4096
REPLAYS = 9

Fn = Callable[[], None]


def estimate_us(fn: Fn, iters: int = 5) -> float:
    """A rough per-launch time from a few eager launches (after a warm-up), to size the graphs."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def graph_estimate_us(fn: Fn, launches: int = 20) -> float:
    """Per-launch time from a short graph (its second replay: the first uploads it); eager launches would
    measure the host, not the GPU. The graph's own start is spread over its launches: with 10 a 10 us kernel was
    estimated 30% long on the H200 (replays then lasted 0.84 ms, not 1), so 20."""
    graph = capture(fn, launches)
    replay_us(graph, launches)
    return replay_us(graph, launches)


def capture(fn: Fn, launches: int, before_each: Fn | None = None) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture: lazy module loads and workspace allocations happen here
        if before_each:
            before_each()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            if before_each:
                before_each()
            fn()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, launches: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / launches


def launches_for(us_each: float) -> int:
    return max(1, min(MAX_LAUNCHES, math.ceil(1.1 * TARGET_MS * 1000.0 / max(us_each, 0.5))))  # 10% margin


def summarise(samples: list[float], launches: int, cupti: float | None = None) -> Timing:
    return Timing(statistics.median(samples), min(samples), max(samples), launches, cupti)


def cupti_us(graph: torch.cuda.CUDAGraph, launches: int) -> float | None:
    """Summed kernel durations of one replay as CUPTI (torch.profiler) records them, per launch; None if the
    profiler is unavailable. Graph time per launch is this plus the gap between back-to-back kernels."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        total = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # a profiler that cannot start must not fail the measurement
        return None
    return total / launches if total > 0 else None


class L2Flush:
    """Writes a buffer twice the L2's size: everything a kernel read before is evicted."""

    def __init__(self, l2_bytes: int):
        self.buf = torch.empty(max(2 * l2_bytes, 64 << 20) // 4, dtype=torch.int32, device="cuda")

    def __call__(self) -> None:
        self.buf.fill_(1)


def measure(fns: dict[str, Fn], flush: L2Flush | None, replays: int = REPLAYS) -> dict[str, Timing]:
    """Time each function, interleaving their graph replays. With `flush`, cold-L2 times (flush subtracted)."""
    est = {name: graph_estimate_us(fn) for name, fn in fns.items()}
    flush_us = graph_estimate_us(flush) if flush else 0.0
    launches = {name: launches_for(us + flush_us) for name, us in est.items()}
    graphs = {name: capture(fn, launches[name], flush) for name, fn in fns.items()}
    flush_graphs = {}
    if flush:
        flush_graphs = {name: capture(flush, launches[name]) for name in fns}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(replays):
        for name, graph in graphs.items():
            t = replay_us(graph, launches[name])
            if flush:
                t -= replay_us(flush_graphs[name], launches[name])
            samples[name].append(max(t, 0.0))
    cupti = {name: None if flush else cupti_us(graphs[name], launches[name]) for name in fns}
    return {name: summarise(s, launches[name], cupti[name]) for name, s in samples.items()}
