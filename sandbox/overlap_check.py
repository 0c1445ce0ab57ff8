"""The overlapped launch's check (GPU worker only): a kernel whose launch rule says `overlap` is launched that way
(core/overlap.py) right after a kernel that writes its operands late, and must still compute the same result.

The writer lets the candidate start at once (it calls griddepcontrol.launch_dependents first), waits WRITE_DELAY_NS,
then copies the true A, B, bias and residual over operands that hold NaN meanwhile, and NaN over C. A candidate that
reads an operand before its overlap_wait() reads NaN; one that writes C before it has its values overwritten. Either
way its output differs from the same launch made plainly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import cupy
import numpy as np
import torch

if TYPE_CHECKING:
    from sandbox.check import Checker, GuardedStack

# longer than the host takes to issue the candidate's launch after the writer's, and than any kernel takes to
# issue its first reads
WRITE_DELAY_NS = 2_000_000
WRITER_BLOCKS_PER_SM = 2

WRITER_SOURCE = r"""
extern "C" __global__ void late_write(const unsigned long long* src, const unsigned long long* dst,
                                      const long long* chunks, int count, unsigned long long delay_ns) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < delay_ns);
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (int j = 0; j < count; ++j) {
        const uint4* s = (const uint4*)src[j];
        uint4* d = (uint4*)dst[j];
        for (long long i = first; i < chunks[j]; i += step) d[i] = s[i];
    }
}
"""


class LateWriter:
    """Copies tensors over others (16-byte chunks) after a delay, letting an overlapped launch start first."""

    def __init__(self, sm_count: int):
        self.kernel = cupy.RawKernel(WRITER_SOURCE, "late_write")
        self.blocks = sm_count * WRITER_BLOCKS_PER_SM

    def __call__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for src, dst in pairs:
            assert src.is_contiguous() and dst.is_contiguous() and src.numel() == dst.numel()
            assert src.numel() * src.element_size() % 16 == 0
        dev = pairs[0][0].device
        src = torch.tensor([s.data_ptr() for s, _ in pairs], dtype=torch.int64, device=dev)
        dst = torch.tensor([d.data_ptr() for _, d in pairs], dtype=torch.int64, device=dev)
        chunks = torch.tensor([s.numel() * s.element_size() // 16 for s, _ in pairs], dtype=torch.int64, device=dev)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        self.kernel((self.blocks,), (256,), (src.data_ptr(), dst.data_ptr(), chunks.data_ptr(), np.int32(len(pairs)),
                                             np.uint64(WRITE_DELAY_NS)), stream=stream)
        self._keep = (src, dst, chunks)  # alive until the copy has run (the caller synchronises)


_writer: LateWriter | None = None


def check_overlapped(checker: Checker, a: GuardedStack, b: GuardedStack, c: GuardedStack,
                     bias: GuardedStack | None, r: GuardedStack | None, expected: torch.Tensor) -> None:
    """The kernel launched overlapped after the late writer must give `expected` (its plain launch's output on the
    operands these buffers hold) bit for bit, or for a nondeterministic family within the usual bounds."""
    from sandbox.check import POISON, CheckFailed, synchronize

    global _writer
    if _writer is None:
        _writer = LateWriter(torch.cuda.get_device_properties(a.tensor.device).multi_processor_count)
    inputs = [t for t in (a, b, bias, r) if t is not None]
    true = [t.tensor.clone() for t in inputs]
    for t in inputs:
        t.tensor.view(torch.int16).fill_(POISON)
    c_poison = torch.full_like(c.tensor.view(torch.int16), POISON).view(c.tensor.dtype)
    c.tensor.view(torch.int16).fill_(0)  # C starts as zeros; the writer's late NaN must end under the results
    checker.scrub()
    _writer([*zip(true, (t.tensor for t in inputs), strict=True), (c_poison, c.tensor)])
    checker.launch(a.tensor, b.tensor, c.tensor, c.rows, checker.gemm_n(b), a.cols,
                   None if bias is None else bias.tensor[0], None if r is None else r.tensor, overlap=True)
    synchronize()
    shape = checker._shape(c, a)
    if not all(t.guards_intact() for t in (*inputs, c)):
        raise CheckFailed(f"out-of-bounds write: a guard region next to an operand changed (overlapped launch, "
                          f"{shape})")
    out = c.tensor.clone()
    late = "launched overlapped with a kernel still writing its operands, it used them before its wait"
    if checker.deterministic:
        if not torch.equal(out.view(torch.int16), expected.view(torch.int16)):
            raise CheckFailed(f"{late}: its output differs from the plain launch's ({shape})")
        return
    if int(c.poisoned()[0]) >= 0 or not torch.isfinite(out).all():
        raise CheckFailed(f"{late}: its output holds NaN ({shape})")
    checker.verify(out, a.tensor, b.tensor, None if bias is None else bias.tensor[0], f"overlapped, {shape}",
                   residual=None if r is None else r.tensor)
