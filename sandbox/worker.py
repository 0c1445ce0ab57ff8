"""The GPU worker process: owns one device's CUDA context, checks and times candidates, reports records.

It talks to the agent over a pipe: it sends ("hello", its DeviceFacts as a dict) once, then for each EvalJob it
receives any number of ("deadline", seconds) messages (how long the phase about to start may take before the agent
kills it) and one ("result", EvalResult). After a CUDA error it sends the result and exits: a faulted context is
poisoned, so the agent starts a fresh worker.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from core.device import TENSOR_FLOPS_PER_CLOCK, DeviceFacts
from core.records import BaselineJob, EvalJob, EvalResult, Status
from core.roofline import compute_us, floor_us

TIMING_DEADLINE_S = 30.0  # the timing phase's own work (captures, replays, checks), beyond the kernels' time


class GpuContext:
    def __init__(self, device_index: int = 0):
        import torch

        from sandbox.launch import SmemScrubber
        from sandbox.timing import L2Flush

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible (torch.cuda.is_available() is False)")
        torch.cuda.set_device(device_index)
        torch.manual_seed(secrets.randbits(48))  # timing inputs differ from process to process
        self.device_index = device_index
        self.props = torch.cuda.get_device_properties(device_index)
        self.facts = device_facts(device_index)
        self.info = self.facts.to_dict()
        self.scrub = SmemScrubber(self.props.shared_memory_per_block_optin, self.props.multi_processor_count)
        self.flush = L2Flush(self.props.L2_cache_size)
        self._warm_up()

    def _warm_up(self) -> None:
        """First-use costs (NVRTC of the scrubber, cuBLAS handles, fp64 paths, CUPTI's start-up, seconds the first
        time a process profiles) stay out of every deadline."""
        import torch

        from sandbox.timing import capture, cupti_us

        self.scrub()
        x = torch.randn(64, 64, device="cuda")
        torch.linalg.norm(x.half() @ x.half().t() - (x.double() @ x.double().t()))
        torch.addmm(x[0].bfloat16(), x.bfloat16(), x.bfloat16().t())  # the bias path's cuBLAS, in bf16 too
        cupti_us(capture(lambda i: x.add_(1.0), 1), 1)
        torch.cuda.synchronize()

    def evaluate(self, job: EvalJob | BaselineJob, say) -> tuple[EvalResult, bool]:
        """Returns the result and whether the worker must be replaced (a CUDA error poisoned the context)."""
        from sandbox.check import CheckFailed

        t0 = time.perf_counter()
        result = dict(candidate_id=job.candidate_id, device=self.info)
        try:
            extra = self._baseline(job, say) if isinstance(job, BaselineJob) else self._evaluate(job, say)
            return EvalResult(status=Status.OK, wall_s=time.perf_counter() - t0, **result, **extra), False
        except CheckFailed as e:
            return EvalResult(status=Status.WRONG, reason=str(e), wall_s=time.perf_counter() - t0, **result), False
        except Exception as e:  # a CUDA error, a load failure: the context may be unusable
            reason = f"{type(e).__name__}: {e}".strip()[:500]
            return EvalResult(status=Status.FAULT, reason=reason, wall_s=time.perf_counter() - t0, **result), True

    def _baseline(self, job: BaselineJob, say) -> dict[str, Any]:
        from sandbox.timed import cublas_launch, time_subjects

        say(job.timeout_s + TIMING_DEADLINE_S)
        modes = ("warm", "cold", "honest") if job.honest else ("warm", "cold")
        t = time_subjects(job.problem, {"cublas": cublas_launch(job.problem)}, None, self.flush, modes)
        return dict(cublas_warm=t["warm"]["cublas"], cublas_cold=t["cold"]["cublas"],
                    cublas_honest=t["honest"]["cublas"] if job.honest else None)

    def _evaluate(self, job: EvalJob, say) -> dict[str, Any]:
        from sandbox.check import Checker, CheckFailed
        from sandbox.launch import Kernel
        from sandbox.timed import time_candidate
        from templates import get_family

        family, p = get_family(job.family), job.problem
        kernel = Kernel.for_family(job.cubin, job.family, job.params, p, self.facts, overlap=job.overlap)
        expected_us = floor_us(p, self.facts)
        say(job.timeout_s + 2.0 + 400 * expected_us * 1e-6)
        seed = job.seed if job.seed is not None else secrets.randbits(48)  # inputs a kernel cannot predict
        checker = Checker(kernel, p, deterministic=family.deterministic, scrub=self.scrub, seed=seed)
        checker.check_all(p)
        extra = dict(max_rel_err=checker.rel_err, cublas_rel_err=checker.cublas_rel_err)
        if not job.time_it:
            return extra
        # warm, cold (and maybe fresh) graphs of >= 1 ms replays for the candidate and cuBLAS, every replay's outputs
        # verified, inputs re-randomised between cold replays: seconds at most
        say(job.timeout_s + TIMING_DEADLINE_S + 2000 * expected_us * 1e-6)
        timings = time_candidate(p, kernel, checker, self.flush, honest=job.honest, honest_only=job.honest_only)
        fastest = min(t.median_us for t in (timings.get("warm"), timings.get("honest")) if t is not None)
        if fastest < compute_us(p, self.facts):
            raise CheckFailed(f"timed faster than the GPU's peak arithmetic rate ({fastest:.2f} "
                              f"us for {p.flops:.3g} flop): the timed launches cannot be doing the work")
        return dict(extra, **timings)


def device_facts(index: int = 0) -> DeviceFacts:
    """The device's facts from torch's properties and NVML (clocks, memory bus); software versions recorded too."""
    import cupy
    import torch

    props = torch.cuda.get_device_properties(index)
    software = {"torch": torch.__version__, "cuda": torch.version.cuda, "cupy": cupy.__version__}
    sm_clock_mhz, hbm_tbps = 1980.0, 4.9  # the H200's, where NVML cannot say
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        software["driver"] = pynvml.nvmlSystemGetDriverVersion()
        software["sm_clock_mhz"] = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
        sm_clock_mhz = software["sm_clock_max_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)
        mem_mhz = software["mem_clock_mhz"] = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
        hbm_tbps = mem_mhz * 1e6 * 2 * pynvml.nvmlDeviceGetMemoryBusWidth(h) / 8 / 1e12
    except Exception as e:  # NVML is optional: the record says why it is missing
        software["nvml"] = f"unavailable: {e}"
    per_clock = TENSOR_FLOPS_PER_CLOCK.get(props.major, 2048)
    return DeviceFacts(
        name=props.name, arch="sm_90a" if props.major == 9 else "sm_80", cc=f"{props.major}.{props.minor}",
        sms=props.multi_processor_count, l2_bytes=props.L2_cache_size,
        smem_per_block=props.shared_memory_per_block_optin,
        smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", props.shared_memory_per_block_optin + 1024),
        memory_bytes=props.total_memory,
        tensor_tflops=props.multi_processor_count * sm_clock_mhz * 1e6 * per_clock / 1e12, hbm_tbps=hbm_tbps,
        software=software)


def worker_main(conn, device_index: int = 0) -> None:
    """Entry point of the worker process."""
    try:
        ctx = GpuContext(device_index)
    except Exception as e:
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("hello", ctx.info))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        result, replace = ctx.evaluate(job, lambda s: conn.send(("deadline", float(s))))
        conn.send(("result", result))
        if replace:
            return
