"""Run GPU workers as child processes the agent can kill: timeouts, crash detection, replacement, one per GPU.

The agent process never touches the GPU. One `GpuWorker` owns one device; a kernel that hangs is killed at the
deadline the worker announced for the phase, a worker that dies mid-job is replaced, and the next job gets a fresh
worker. `WorkerPool` runs one GpuWorker per local GPU, each fed by a thread of its own from one queue, so a job goes
to whichever GPU is idle and no two jobs ever share a GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from core.records import EvalJob, EvalResult, Status
from sandbox.executor import Executor, Job, Profiler, WorkerUnavailable, died_twice

STARTUP_TIMEOUT_S = 180.0
__all__ = ["GpuWorker", "MixedDevices", "WorkerPool", "WorkerUnavailable", "same_model"]


class MixedDevices(ValueError):
    """The GPUs of one run must be one model: its kernels, parameter spaces and timings assume one."""


def _default_target() -> Callable:
    from sandbox.worker import worker_main

    return worker_main


class GpuWorker:
    def __init__(self, device_index: int = 0, target: Callable | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.device_index = device_index
        self.target = target or _default_target()
        self.startup_timeout_s = startup_timeout_s
        self.proc: mp.process.BaseProcess | None = None
        self.conn = None
        self.info: dict[str, Any] = {}
        self.restarts = 0

    def start(self) -> dict[str, Any]:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=self.target, args=(child, self.device_index), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        msg = self._recv(time.monotonic() + self.startup_timeout_s)
        if msg is None or msg[0] != "hello":  # silence, death, or a "fatal" message
            why = msg[1] if msg and msg[0] == "fatal" else "the GPU worker did not start"
            self.stop()
            raise WorkerUnavailable(why)
        self.info = msg[1]
        return self.info

    def _recv(self, deadline: float):
        """The next message; None when the deadline passes; ("eof", None) when the worker died."""
        try:
            if self.conn.poll(max(0.0, deadline - time.monotonic())):
                return self.conn.recv()
        except (EOFError, OSError):
            return ("eof", None)
        return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def evaluate(self, job: Job) -> EvalResult:
        return self.attempt(job)[0]

    def attempt(self, job: Job) -> tuple[EvalResult, bool]:
        """The job's result, and whether the worker process died under it (not a fault it reported: the job may
        well pass on a fresh worker, so it is worth one retry)."""
        if not self.alive():
            if self.proc is not None:
                self.restarts += 1
            self.start()
        t0 = time.monotonic()
        try:
            self.conn.send(job)
        except (OSError, BrokenPipeError):
            self.stop()
            return EvalResult(job.candidate_id, Status.FAULT, "the GPU worker was gone before the job started"), True
        deadline = t0 + job.timeout_s + 30.0  # until the worker announces its first phase
        while True:
            msg = self._recv(deadline)
            if msg is None:
                self.stop()
                return EvalResult(job.candidate_id, Status.TIMEOUT,
                                  f"killed: no answer within {deadline - t0:.1f} s (kernel hung?)",
                                  device=self.info, wall_s=time.monotonic() - t0), False
            kind, payload = msg
            if kind == "eof":
                self.proc.join(timeout=10)
                code = self.proc.exitcode
                self.stop()
                return EvalResult(job.candidate_id, Status.FAULT, f"the GPU worker died (exit code {code})",
                                  device=self.info, wall_s=time.monotonic() - t0), True
            if kind == "deadline":
                deadline = time.monotonic() + payload
            elif kind == "result":
                if not self.alive() or payload.status is Status.FAULT:
                    self._reap()
                return payload, False

    def _reap(self) -> None:
        """After a fault the worker exits by itself; wait briefly, then make sure."""
        if self.proc is not None:
            self.proc.join(timeout=10)
        self.stop()

    def kill(self) -> None:
        """End the process at once (from another thread: a job in progress there sees the worker die)."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def close(self) -> None:
        if self.alive():
            try:
                self.conn.send(None)
                self.proc.join(timeout=5)
            except (OSError, BrokenPipeError):
                pass
        self.stop()


@dataclass
class _Task:
    future: Future
    job: Job
    profiler: Profiler | None = None  # set: run it on this GPU instead of evaluating the job
    tries: int = 0


_STOP = None


def same_model(infos: dict[str, dict[str, Any]]) -> None:
    """Raise MixedDevices unless every worker reports the same GPU model and arch (named worker -> facts dict)."""
    models = {(i.get("name"), i.get("arch")) for i in infos.values()}
    if len(models) > 1:
        seen = ", ".join(f"{where}: {i.get('name')} ({i.get('arch')})" for where, i in infos.items())
        raise MixedDevices(f"the GPUs are not all one model ({seen}); choose GPUs of one model")


class WorkerPool(Executor):
    """One GpuWorker per device, fed from one queue by a thread each; a job whose worker died is queued again once."""

    def __init__(self, devices: tuple[int, ...] = (0,), target: Callable | None = None, **kw):
        if not devices or len(set(devices)) != len(devices):
            raise ValueError(f"devices must be distinct GPU indices, got {devices}")
        self.workers = [GpuWorker(d, target, **kw) for d in devices]
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._serving = 0
        self._broken: WorkerUnavailable | None = None
        self.retried = 0

    def start(self) -> dict[str, Any]:
        """Start every worker at once (each loads torch and warms its GPU up); the first one's facts."""
        with ThreadPoolExecutor(len(self.workers)) as starting:
            errors = list(starting.map(_start_or_error, self.workers))
        failed = [f"GPU {w.device_index}: {e}" for w, e in zip(self.workers, errors, strict=True) if e]
        try:
            if failed:
                raise WorkerUnavailable("; ".join(failed))
            same_model({f"GPU {w.device_index}": w.info for w in self.workers})
        except (WorkerUnavailable, MixedDevices):
            self.close()
            raise
        self._serving = len(self.workers)
        self._threads = [threading.Thread(target=self._serve, args=(w,), name=f"gpu-{w.device_index}", daemon=True)
                         for w in self.workers]
        for t in self._threads:
            t.start()
        return self.info

    @property
    def info(self) -> dict[str, Any]:
        return self.workers[0].info

    @property
    def slots(self) -> int:
        return max(1, self._serving)

    def submit(self, job: Job) -> Future:
        return self._put(_Task(Future(), job))

    def profile(self, profiler: Profiler, job: EvalJob) -> Future:
        return self._put(_Task(Future(), job, profiler))

    def _put(self, task: _Task) -> Future:
        with self._lock:
            if not self._threads:
                raise RuntimeError("the pool is not started")
            if self._broken is not None:
                task.future.set_exception(self._broken)
            else:
                self._queue.put(task)
        return task.future

    def _serve(self, worker: GpuWorker) -> None:
        while (task := self._queue.get()) is not _STOP:
            try:
                if task.profiler is not None:  # the worker's process idles meanwhile: ncu has the GPU to itself
                    j = task.job
                    task.future.set_result(task.profiler(j.cubin, j.family, j.params, j.problem,
                                                         device=worker.device_index))
                    continue
                result, died = worker.attempt(task.job)
            except WorkerUnavailable as e:  # its replacement did not start: the other GPUs go on without it
                self._retire(task, f"GPU {worker.device_index}: {e}")
                return
            except Exception as e:  # a bug, not a kernel's doing: the waiting loop sees it instead of waiting forever
                task.future.set_exception(e)
                continue
            if died and task.tries == 0:
                with self._lock:
                    self.retried += 1
                self._queue.put(_Task(task.future, task.job, tries=1))
                continue
            task.future.set_result(died_twice(result) if died else result)

    def _retire(self, task: _Task, why: str) -> None:
        with self._lock:
            self._serving -= 1
            if self._serving > 0:
                self._queue.put(task)
                return
            self._broken = WorkerUnavailable(f"no GPU worker is left ({why})")
            task.future.set_exception(self._broken)
            while not self._queue.empty():
                if (waiting := self._queue.get()) is not _STOP:
                    waiting.future.set_exception(self._broken)

    def describe(self) -> dict[str, Any]:
        return {"executor": "local", "gpus": [w.device_index for w in self.workers], "serving": self._serving,
                "retried": self.retried, "restarts": sum(w.restarts for w in self.workers)}

    def close(self) -> None:
        with self._lock:
            self._broken = self._broken or WorkerUnavailable("the pool is closed")
            while not self._queue.empty():  # jobs nobody will wait for
                if (waiting := self._queue.get()) is not _STOP:
                    waiting.future.cancel()
            for _ in self._threads:
                self._queue.put(_STOP)
        for t, w in zip(self._threads, self.workers, strict=False):
            t.join(timeout=0.5)
            if t.is_alive():  # a job in progress (Ctrl-C): its result is not wanted
                w.kill()
                t.join(timeout=15)
        for w in self.workers:
            w.close()


def _start_or_error(w: GpuWorker) -> str:
    try:
        w.start()
    except WorkerUnavailable as e:
        return str(e)
    return ""
