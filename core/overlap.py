"""Overlapped launches (programmatic dependent launch, sm_90 and newer): the device code every kernel shares.

A kernel launched overlapped may start while the kernel before it in the stream is still running, once that one's
blocks have all started (or called `overlap_release`): it sets up (barriers, tensor-map fetches) meanwhile, then
waits in `overlap_wait` until the kernel before it has finished and its writes are visible, and only then touches
global memory (A, B, the bias, the residual, C, its workspace). The sandbox launches every kernel whose launch rule
says `overlap` that way right after a kernel that writes the operands late (sandbox/overlap_check.py), so a kernel
that reads or writes before its wait is rejected; timing launches are never overlapped. The export launches them so
on sm_90 and newer (HGEMM_OPS_OVERLAP=0 turns it off); docs/decisions.md `overlap` has what it measured.

Compiled for an arch below sm_90 both functions are empty (no overlapped launch exists there).
"""

from __future__ import annotations

OVERLAP_CUDA = """\
// Overlapped launch (core/overlap.py): wait for the kernel ahead, then let the next one start.
__device__ __forceinline__ void overlap_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\\n" ::: "memory");
#endif
}
__device__ __forceinline__ void overlap_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\\n" ::: "memory");
#endif
}
"""


def waits(source: str) -> bool:
    """Whether a kernel's source was built with the overlapped launch's wait (every template's since it came; a
    kernel built before it is never launched overlapped). The sandbox's check then proves that it waits in time."""
    return "griddepcontrol.wait" in source
