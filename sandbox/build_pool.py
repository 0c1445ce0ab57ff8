"""NVRTC compiles ahead of the GPUs: in CPU processes of their own, several at once, or in the caller's thread.

A process pool lets compiles run in parallel whatever the GIL does, and an NVRTC crash takes down only a pool
process: the build is recorded as failed and the next compile gets a fresh pool. The cubin cache (content-hashed,
atomic writes) is shared by every process.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from concurrent.futures import CancelledError, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from core.records import BuildResult
from sandbox.build import compile_cuda


class BuildPool:
    """processes=0: compile in the caller's thread when submitted (a one-GPU run compiles one candidate at a time)."""

    def __init__(self, processes: int = 0):
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, source: str, arch: str, candidate_id: str, timeout_s: float) -> Future:
        """A future of the BuildResult; it never raises (a compiler that died is a failed build)."""
        out: Future = Future()
        if self.processes == 0:
            out.set_result(compile_cuda(source, arch, candidate_id=candidate_id, timeout_s=timeout_s))
            return out
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.processes, mp_context=mp.get_context("spawn"))
            pool = self._pool
        try:
            inner = pool.submit(compile_cuda, source, arch, candidate_id=candidate_id, timeout_s=timeout_s)
        except BrokenProcessPool as e:
            self._discard(pool)
            out.set_result(_died(source, arch, candidate_id, e))
            return out

        def finish(f: Future) -> None:
            try:
                out.set_result(f.result())
            except (BrokenProcessPool, CancelledError) as e:  # cancelled: a process died and took the pool with it
                self._discard(pool)
                out.set_result(_died(source, arch, candidate_id, e))
            except Exception as e:  # a bug in this process's hand-off, never a bad source: surface it
                out.set_exception(e)

        inner.add_done_callback(finish)
        return out

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _died(source: str, arch: str, candidate_id: str, e: Exception) -> BuildResult:
    return BuildResult(candidate_id, False, arch, source, error=f"the compiler process died ({e or 'no reason given'})")
