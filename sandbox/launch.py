"""Load a cubin with CuPy and launch it on PyTorch's current stream (GPU worker only).

The launch geometry and any TMA tensor maps come from the family's trusted `launch()` rule, never from a proposer.
Kernels are launched through the driver (`sandbox.driver`) on `torch.cuda.current_stream()`, so they land inside a
`torch.cuda.graph` capture like any torch op.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import warnings
from collections.abc import Callable

import cupy
import numpy as np
import torch

from core.device import H200, DeviceFacts
from core.records import LaunchSpec, Problem
from sandbox import driver

# CuPy 14 deprecates ExternalStream in favour of Stream.from_external; the old name still wraps torch's stream
# handle exactly, on every CuPy this runs with.
warnings.filterwarnings("ignore", "ExternalStream is deprecated", DeprecationWarning)

LaunchRule = Callable[[int, int, int], LaunchSpec]


class Kernel:
    """A loaded kernel: call it with torch tensors A, B, C, the sizes M, N, K (N the GEMM's), and the bias and the
    residual where the problem has them."""

    def __init__(self, cubin: bytes, launch_rule: LaunchRule, name: str = "hgemm"):
        fd, path = tempfile.mkstemp(suffix=".cubin")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            self.module = cupy.RawModule(path=path)
            self.function = self.module.get_function(name)
            self.function.attributes  # forces the load now, so a bad cubin fails here  # noqa: B018
        finally:
            os.unlink(path)
        self.launch_rule = launch_rule
        self._smem_raised = 0

    @classmethod
    def for_family(cls, cubin: bytes, family: str, params: dict, problem: Problem,
                   device: DeviceFacts = H200, overlap: bool = False) -> Kernel:
        """A kernel launched by its family's trusted rule, for whatever M, N, K it is called with (the problem's
        layout, dtype and bias); `overlap`: its source waits for the kernel ahead (core/overlap.waits), so it may be
        launched overlapped where the rule allows it."""
        from templates import get_family

        fam = get_family(family)

        @functools.lru_cache(maxsize=32)  # a spec per size: timed graphs capture hundreds of launches of one size
        def rule(m: int, n: int, k: int) -> LaunchSpec:
            spec = fam.launch(params, dataclasses.replace(problem, m=m, n=n, k=k, m_range=None), device)
            return dataclasses.replace(spec, overlap=spec.overlap and overlap)

        return cls(cubin, rule)

    def overlaps(self, m: int, n: int, k: int) -> bool:
        """Whether the launch rule lets the kernel start before the kernel ahead of it has finished."""
        return self.launch_rule(m, n, k).overlap

    def __call__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, m: int, n: int, k: int,
                 bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 overlap: bool = False) -> None:
        """One launch; `overlap` (where the rule allows it) lets it start before the kernel ahead has finished:
        only the overlapped-launch check asks for it, timed launches never do."""
        spec = self.launch_rule(m, n, k)
        if spec.smem_bytes > self._smem_raised:
            self.function.max_dynamic_shared_size_bytes = spec.smem_bytes
            self._smem_raised = spec.smem_bytes
        driver.launch(self.function.kernel.ptr, spec.grid, spec.block, spec.smem_bytes,
                      torch.cuda.current_stream().cuda_stream, (a.data_ptr(), b.data_ptr(), c.data_ptr()),
                      (m, n, k), [(t.operand, t.dims, t.box, t.swizzle, t.strides) for t in spec.tensor_maps],
                      spec.workspace_bytes, spec.counters, None if bias is None else bias.data_ptr(),
                      None if residual is None else residual.data_ptr(), overlap=overlap and spec.overlap)


SCRUB_SOURCE = r"""
extern "C" __global__ void scrub(int words) {
    extern __shared__ unsigned int smem[];
    for (int i = threadIdx.x; i < words; i += blockDim.x) smem[i] = 0xFFFFFFFFu;  // fp16 NaN pairs
    __syncthreads();
    if (smem[(threadIdx.x * 7) % words] == 0u) smem[0] = 0u;  // keeps the stores alive
}
"""


class SmemScrubber:
    """Fills every SM's shared memory with NaN so a kernel reading uninitialised shared memory shows it."""

    def __init__(self, smem_bytes: int, sm_count: int):
        self.kernel = cupy.RawKernel(SCRUB_SOURCE, "scrub")
        self.kernel.max_dynamic_shared_size_bytes = smem_bytes
        self.smem_bytes, self.blocks = smem_bytes, sm_count * 2

    def __call__(self) -> None:
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        self.kernel((self.blocks,), (256,), (np.int32(self.smem_bytes // 4),),
                    shared_mem=self.smem_bytes, stream=stream)
