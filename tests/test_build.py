"""NVRTC builds: resource reports, failures as data, the content+toolchain cache."""

from __future__ import annotations

import pytest

from sandbox.build import compile_cuda

GOOD = r'''
extern "C" __global__ void hgemm(const unsigned short* A, const unsigned short* B, unsigned short* C,
                                 int M, int N, int K) {
    __shared__ float s[256];
    s[threadIdx.x] = (float)A[threadIdx.x];
    __syncthreads();
    if (threadIdx.x < M) C[threadIdx.x] = (unsigned short)s[255 - threadIdx.x];
}
'''


def test_compiles_for_both_arches_with_resource_report(cache_dir):
    for arch in ("sm_90a", "sm_80"):
        b = compile_cuda(GOOD, arch, candidate_id="g", cache_dir=cache_dir)
        assert b.ok and b.cubin and b.cubin[:4] == b"\x7fELF", b.log
        assert b.registers and b.registers > 0
        assert b.smem_static == 1024 and b.spill_bytes == 0 and b.stack_bytes == 0
        assert not b.cached


def test_cache_hit_returns_same_cubin(cache_dir):
    first = compile_cuda(GOOD, "sm_90a", cache_dir=cache_dir)
    second = compile_cuda(GOOD, "sm_90a", cache_dir=cache_dir)
    assert second.cached and second.cubin == first.cubin and second.registers == first.registers
    assert not compile_cuda(GOOD, "sm_80", cache_dir=cache_dir).cached  # the arch is part of the key
    assert not list(cache_dir.glob("*.tmp"))


def test_compile_error_is_data(cache_dir):
    b = compile_cuda(GOOD.replace("__syncthreads();", "__syncthreads() oops;"), "sm_90a", cache_dir=cache_dir)
    assert not b.ok and b.cubin is None
    assert "error" in b.error and "kernel.cu" in b.log
    assert not list(cache_dir.glob("*.cubin"))  # failures are not cached


@pytest.mark.parametrize("directive", ['#include <cuda_fp16.h>', '#include "/etc/hostname"', '# /**/ include "x"',
                                       '%:include "x"', '#inc\\\nlude "x"', '#if __has_include("x")\n#endif'])
def test_file_reading_directives_are_refused(cache_dir, directive):
    """NVRTC would read host files, and its log goes into prompts: such sources never reach the compiler."""
    b = compile_cuda(directive + "\n" + GOOD, "sm_90a", cache_dir=cache_dir)
    assert not b.ok and "not allowed" in b.error and not b.log


def test_unknown_arch(cache_dir):
    b = compile_cuda(GOOD, "sm_75", cache_dir=cache_dir)
    assert not b.ok and "unknown arch" in b.error


def test_compile_timeout_is_recorded(cache_dir):
    b = compile_cuda(GOOD, "sm_90a", cache_dir=None, timeout_s=1e-6)
    assert not b.ok and "timed out" in b.error


def test_build_pool_compiles_in_processes_and_survives_a_dead_compiler(tmp_path, monkeypatch):
    import os
    import signal

    from sandbox.build_pool import BuildPool

    monkeypatch.setenv("HGEMM_AGENT_CACHE", str(tmp_path / "cubins"))  # the pool's processes read it at start
    pool = BuildPool(2)
    try:
        built = [f.result(timeout=120) for f in [pool.submit(GOOD + f"// {i}\n", "sm_90a", f"c{i}", 60)
                                                 for i in range(3)]]
        assert [b.candidate_id for b in built] == ["c0", "c1", "c2"] and all(b.ok and b.cubin for b in built)
        assert len(list((tmp_path / "cubins").glob("*.cubin"))) == 3  # the shared cache
        doomed = pool.submit(GOOD + "// doomed\n", "sm_90a", "d", 60)
        for pid in list(pool._pool._processes):
            os.kill(pid, signal.SIGKILL)
        lost = doomed.result(timeout=60)
        assert not lost.ok and "compiler process died" in lost.error
        # builds still queued when the pool is given up are cancelled: failed builds too, never an exception
        queued = [pool.submit(GOOD + f"// queued {i}\n", "sm_90a", f"q{i}", 60) for i in range(6)]
        pool._discard(pool._pool)
        outcomes = [f.result(timeout=120) for f in queued]
        assert all(b.ok or "compiler process died" in b.error for b in outcomes)
        assert any(not b.ok for b in outcomes)
        assert pool.submit(GOOD + "// after\n", "sm_90a", "a", 60).result(timeout=120).ok  # a fresh pool
    finally:
        pool.close()
