"""Run GPU workers as child processes the agent can kill: timeouts, crash detection, replacement.

The agent process never touches the GPU. One `GpuWorker` owns one device; a kernel that hangs is killed at the
deadline the worker announced for the phase, a worker that dies mid-job is recorded as a fault, and either way the
next job gets a fresh worker. `WorkerPool` hands jobs to one worker per device.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

from core.device import DeviceFacts
from core.records import EvalJob, EvalResult, Status

STARTUP_TIMEOUT_S = 180.0


class WorkerUnavailable(RuntimeError):
    """No worker could be started (no GPU, no driver): the run cannot evaluate anything."""


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

    def evaluate(self, job: EvalJob) -> EvalResult:
        if not self.alive():
            if self.proc is not None:
                self.restarts += 1
            self.start()
        t0 = time.monotonic()
        try:
            self.conn.send(job)
        except (OSError, BrokenPipeError):
            self.stop()
            return EvalResult(job.candidate_id, Status.FAULT, "the GPU worker was gone before the job started")
        deadline = t0 + job.timeout_s + 30.0  # until the worker announces its first phase
        while True:
            msg = self._recv(deadline)
            if msg is None:
                self.stop()
                return EvalResult(job.candidate_id, Status.TIMEOUT,
                                  f"killed: no answer within {deadline - t0:.1f} s (kernel hung?)",
                                  device=self.info, wall_s=time.monotonic() - t0)
            kind, payload = msg
            if kind == "eof":
                self.proc.join(timeout=10)
                code = self.proc.exitcode
                self.stop()
                return EvalResult(job.candidate_id, Status.FAULT, f"the GPU worker died (exit code {code})",
                                  device=self.info, wall_s=time.monotonic() - t0)
            if kind == "deadline":
                deadline = time.monotonic() + payload
            elif kind == "result":
                if not self.alive() or payload.status is Status.FAULT:
                    self._reap()
                return payload

    def _reap(self) -> None:
        """After a fault the worker exits by itself; wait briefly, then make sure."""
        if self.proc is not None:
            self.proc.join(timeout=10)
        self.stop()

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


class WorkerPool:
    """One worker per device; jobs go to the first worker (one device today, several later)."""

    def __init__(self, devices: tuple[int, ...] = (0,), target: Callable | None = None, **kw):
        self.workers = [GpuWorker(d, target, **kw) for d in devices]

    def start(self) -> dict[str, Any]:
        return self.workers[0].start()

    @property
    def info(self) -> dict[str, Any]:
        return self.workers[0].info

    @property
    def facts(self) -> DeviceFacts:
        return DeviceFacts.from_dict(self.info)

    def evaluate(self, job: EvalJob) -> EvalResult:
        return self.workers[0].evaluate(job)

    def close(self) -> None:
        for w in self.workers:
            w.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
