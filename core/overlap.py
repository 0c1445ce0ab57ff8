"""Overlapped launches (programmatic dependent launch, sm_90 and newer): the device code every kernel shares.

A kernel launched overlapped may start while the kernel before it in the stream is still running, once that one's
blocks have all started (or called `overlap_release`): it sets up (barriers, tensor maps) and warms the L2 with the
first k-tiles of its weights meanwhile, then waits in `overlap_wait` until the kernel before it has finished and
its writes are visible, and only then reads A, the residual or the bias, or writes anything. The L2 prefetch cannot
feed a stale value: it only asks the L2, which every SM's writes reach, to hold lines early, so it is safe even
where B is what the kernel before just wrote. The sandbox launches every kernel whose launch rule says `overlap`
that way right after a kernel that writes the operands late (sandbox/overlap_check.py), so a kernel that
reads or writes before its wait is rejected; timing launches are never overlapped.

Compiled for an arch below sm_90 the three functions are empty (no overlapped launch exists there).
"""

from __future__ import annotations

# Bytes of B a CTA asks the L2 for before its wait: 132 CTAs x 64 KiB is about what the HBM delivers in the 2-3 us
# of a short kernel ahead (a norm), and well inside the L2.
PREFETCH_BYTES = 64 * 1024

OVERLAP_CUDA = """\
// Overlapped launch (core/overlap.py): wait for the kernel ahead, let the next one start, warm the L2 early.
constexpr int OVERLAP_PREFETCH_BYTES = PREFETCH_BYTES;  // of B a CTA asks the L2 for before its wait
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
// Thread t of `threads` asks the L2 for its share of B's tile at column n0 (`cols` wide) over k in [k0, k1), one
// 128-byte line a prefetch (through the load unit: the TMA unit stays free for the kernel's own copies): kn, B is
// K x N (rows k hold the tile's columns); nk, N x K (rows n hold the k range). Nothing past B's edges.
__device__ __forceinline__ void overlap_prefetch_b(const unsigned short* B, bool kn, int N, int K, int n0, int cols,
                                                   int k0, int k1, int t, int threads) {
#if __CUDA_ARCH__ >= 900
    const int n1 = min(n0 + cols, N), kk1 = min(k1, K);
    if (n1 <= n0 || kk1 <= k0) return;
    const int rows = kn ? kk1 - k0 : n1 - n0, lines = ((kn ? n1 - n0 : kk1 - k0) + 63) / 64;
    for (int i = t; i < rows * lines; i += threads) {
        const int r = i / lines, c = i % lines * 64;
        const unsigned short* p = kn ? B + (long long)(k0 + r) * N + n0 + c : B + (long long)(n0 + r) * K + k0 + c;
        asm volatile("prefetch.global.L2 [%0];\\n" ::"l"(p));
    }
#endif
}
""".replace("= PREFETCH_BYTES;", f"= {PREFETCH_BYTES};")


def waits(source: str) -> bool:
    """Whether a kernel's source was built with the overlapped launch's wait (every template's since it came; a
    kernel built before it is never launched overlapped). The sandbox's check then proves that it waits in time."""
    return "griddepcontrol.wait" in source
