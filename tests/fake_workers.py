"""Stand-ins for the GPU worker process, for testing the pool's timeouts and replacement without a GPU."""

from __future__ import annotations

import os
import time

from core.records import EvalResult, Status, Timing


def _hello(conn, index):
    conn.send(("hello", {"name": "fake", "arch": "sm_90a", "pid": os.getpid(), "index": index}))


def ok_worker(conn, index=0):
    _hello(conn, index)
    while (job := conn.recv()) is not None:
        conn.send(("deadline", 2.0))
        t = Timing(10.0, 9.5, 10.5, 100)
        conn.send(("result", EvalResult(job.candidate_id, Status.OK, warm=t, cublas_warm=Timing(12.0, 11, 13, 100),
                                        device={"pid": os.getpid()})))


def hang_worker(conn, index=0):
    """Announces a short phase, then never answers (a kernel that never returns)."""
    _hello(conn, index)
    conn.recv()
    conn.send(("deadline", 0.5))
    time.sleep(3600)


def crash_worker(conn, index=0):
    """Dies in the middle of a job (a segfault in the driver, an OOM kill)."""
    _hello(conn, index)
    conn.recv()
    os._exit(7)


def fault_then_ok_worker(conn, index=0):
    """Reports a CUDA fault for job ids starting with 'bad' and exits, as the real worker does."""
    _hello(conn, index)
    while (job := conn.recv()) is not None:
        if job.candidate_id.startswith("bad"):
            conn.send(("result", EvalResult(job.candidate_id, Status.FAULT, "CUDARuntimeError: illegal address")))
            return
        conn.send(("result", EvalResult(job.candidate_id, Status.OK, warm=Timing(1, 1, 1, 1),
                                        cublas_warm=Timing(1, 1, 1, 1), device={"pid": os.getpid()})))


def no_gpu_worker(conn, index=0):
    conn.send(("fatal", "RuntimeError: no CUDA device is visible"))


def silent_worker(conn, index=0):
    time.sleep(3600)
