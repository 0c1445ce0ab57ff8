"""Device-time measurement: CUDA graphs of back-to-back launches replayed between CUDA events (GPU worker only).

A subject (the candidate, or cuBLAS) is timed as a graph of R launches (R chosen so a replay lasts >= TARGET_MS);
launch i of a replay may use its own buffers (sandbox/timed.py decides which). Work captured before each launch that
is not the subject's (an L2 flush for cold timings, a refresh of the inputs) is timed alone in a graph of its own and
subtracted. Between replays, outside the timed region, a subject may prepare its buffers (poison outputs, new
inputs) and check what the replay left. Subjects' replays are interleaved, so drift (clocks, temperature) hits all.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.records import Timing

TARGET_MS = 1.0
MAX_LAUNCHES = 4096
REPLAYS = 9
CUPTI_ROUNDS = 6  # CUPTI replays of each subject, the order reversed every other round (docs/decisions.md `cupti-abba`)

Fn = Callable[[], None]


def _nothing() -> None:
    pass


@dataclass
class Subject:
    """What one timed graph replays: `launch(i)`, the i-th launch of a replay, each preceded by `overhead(i)` where
    given (its own time subtracted); `before_replay` and `after_replay` run outside the timed region."""

    launch: Callable[[int], None]
    launches: int
    overhead: Callable[[int], None] | None = None
    before_replay: Fn = _nothing
    after_replay: Fn = _nothing


def graph_estimate_us(fn: Fn, launches: int = 20) -> float:
    """Per-launch time from a short graph (its second replay: the first uploads it); eager launches would
    measure the host, not the GPU. The graph's own start is spread over its launches: with 10 a 10 us kernel was
    estimated 30% long on the H200 (replays then lasted 0.84 ms, not 1), so 20."""
    graph = capture(lambda i: fn(), launches)
    replay_us(graph, launches)
    return replay_us(graph, launches)


def capture(launch: Callable[[int], None], launches: int,
            overhead: Callable[[int], None] | None = None) -> torch.cuda.CUDAGraph:
    """A graph of `launches` calls launch(i), each after overhead(i) where given."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if overhead:  # warm-up outside the capture: lazy module loads and workspace allocations happen here
            overhead(0)
        launch(0)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for i in range(launches):
            if overhead:
                overhead(i)
            launch(i)
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

    def __call__(self, i: int = 0) -> None:
        self.buf.fill_(1)


def measure(subjects: dict[str, Subject], replays: int = REPLAYS, cupti: bool = False) -> dict[str, Timing]:
    """Time each subject, interleaving their graph replays, overheads subtracted; with `cupti`, each timing also
    carries CUPTI's kernel durations, the median of `cupti_rounds`' (prepared and checked) replays."""
    graphs = {name: capture(s.launch, s.launches, s.overhead) for name, s in subjects.items()}
    overheads = {name: capture(s.overhead, s.launches) for name, s in subjects.items() if s.overhead}
    samples: dict[str, list[float]] = {name: [] for name in subjects}
    for _ in range(replays):
        for name, s in subjects.items():
            s.before_replay()
            t = replay_us(graphs[name], s.launches)
            s.after_replay()
            if name in overheads:
                t -= replay_us(overheads[name], s.launches)
            samples[name].append(max(t, 0.0))
    kernel_us = dict.fromkeys(subjects)
    if cupti:
        for name, xs in cupti_rounds(subjects, graphs).items():
            kernel_us[name] = cupti_median(xs)
    return {name: summarise(samples[name], s.launches, kernel_us[name]) for name, s in subjects.items()}


def cupti_median(xs: list[float | None]) -> float | None:
    """The subject's CUPTI figure from its rounds: their median, or None where any replay went unrecorded."""
    return statistics.median(xs) if xs and None not in xs else None


def cupti_rounds(subjects: dict[str, Subject], graphs: dict[str, torch.cuda.CUDAGraph],
                 rounds: int = CUPTI_ROUNDS) -> dict[str, list[float | None]]:
    """Each subject's CUPTI kernel time per launch, one replay a round, the subjects' order reversed every other
    round (A B, B A, ...): a drift of the clocks between replays falls on both alike."""
    out: dict[str, list[float | None]] = {name: [] for name in subjects}
    for r in range(rounds):
        for name in (list(subjects) if r % 2 == 0 else list(reversed(subjects))):
            s = subjects[name]
            s.before_replay()
            out[name].append(cupti_us(graphs[name], s.launches))
            s.after_replay()
    return out
