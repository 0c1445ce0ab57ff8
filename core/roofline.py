"""The roofline floor of a problem on a device: the one definition the worker, the search order, the prompts, `show`
and `bench` use, from the device's own peak rates (DeviceFacts)."""

from __future__ import annotations

from core.device import DeviceFacts
from core.records import Problem


def compute_us(problem: Problem, device: DeviceFacts, tensor_share: float = 1.0) -> float:
    """Microseconds the problem's arithmetic takes at `tensor_share` of the device's dense tensor-core rate."""
    return problem.flops / (tensor_share * device.tensor_tflops * 1e6)


def memory_us(problem: Problem, device: DeviceFacts) -> float:
    """Microseconds moving the problem's operands once takes at the device's memory bandwidth."""
    return problem.operand_bytes / (device.hbm_tbps * 1e6)


def floor_us(problem: Problem, device: DeviceFacts, tensor_share: float = 1.0) -> float:
    """The larger of the arithmetic and memory times, launch latency excluded: no kernel runs faster."""
    return max(compute_us(problem, device, tensor_share), memory_us(problem, device))


def floor_pct(problem: Problem, device: DeviceFacts, time_us: float) -> float:
    """How close a kernel that takes `time_us` comes to the floor, in percent (100: at the floor)."""
    return 100 * floor_us(problem, device) / time_us if time_us > 0 else float("nan")
