"""Stand-ins for the GPU worker process, for testing the pool's timeouts and replacement without a GPU."""

from __future__ import annotations

import dataclasses
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


def scripted_worker(conn, index=0):
    """Does what each job's params say: {"sleep": s} before answering, {"die": "always"}, {"die": index} (on that
    GPU) or {"die": PATH} (only if PATH does not exist yet, creating it: once across processes); reports its device
    index and when it ran. Where the folder $FAKE_GONE holds "<index>.gone", it starts once and never again (a GPU
    that fell off the bus)."""
    if (folder := os.environ.get("FAKE_GONE")) and os.path.exists(os.path.join(folder, f"{index}.gone")):
        if not _first_to_create(os.path.join(folder, f"{index}.started")):
            conn.send(("fatal", f"RuntimeError: GPU {index} is gone"))
            return
    _hello(conn, index)
    while (job := conn.recv()) is not None:
        conn.send(("deadline", 5.0))
        t0 = time.time()
        time.sleep(job.params.get("sleep", 0.0))
        die = job.params.get("die")
        if die == "always" or die == index or (isinstance(die, str) and _first_to_create(die)):
            os._exit(9)
        t = Timing(10.0, 9.5, 10.5, 100)
        conn.send(("result", EvalResult(job.candidate_id, Status.OK, warm=t, cublas_warm=Timing(12.0, 11, 13, 100),
                                        device={"index": index, "pid": os.getpid(), "t0": t0, "t1": time.time()})))


def m_dependent_worker(conn, index=0):
    """tests.helpers.m_dependent_evaluate behind the pipe: kernels beat cuBLAS only from a given M up."""
    from tests.helpers import m_dependent_evaluate

    _hello(conn, index)
    while (job := conn.recv()) is not None:
        conn.send(("deadline", 5.0))
        conn.send(("result", m_dependent_evaluate(job)))


def _first_to_create(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def mixed_models_worker(conn, index=0):
    conn.send(("hello", {"name": f"fake model {index}", "arch": "sm_90a", "pid": os.getpid(), "index": index}))
    while conn.recv() is not None:
        pass


def timed_like_fake_evaluate(conn, index=0):
    """tests.helpers.fake_evaluate behind the pipe (timings follow the parameters, as in the loop's tests), with the
    device index, process and times in the result. Each job takes $FAKE_SLEEP seconds (default 0); the first job to
    create the file $FAKE_DIE_ONCE kills its worker."""
    from tests.helpers import fake_evaluate

    _hello(conn, index)
    while (job := conn.recv()) is not None:
        conn.send(("deadline", 5.0))
        t0 = time.time()
        time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
        if (marker := os.environ.get("FAKE_DIE_ONCE")) and _first_to_create(marker):
            os._exit(9)
        r = fake_evaluate(job)
        where = {"index": index, "pid": os.getpid(), "t0": t0, "t1": time.time()}
        conn.send(("result", dataclasses.replace(r, device={**r.device, **where})))
