"""Evaluation behind one interface: jobs go in, futures of their results come back, whoever runs them.

Four kinds: `InlineExecutor` (a function called in the caller's thread: tests, replays), `CompileOnly` (no GPU:
every job comes back skipped), `WorkerPool` (one sandboxed GPU worker process per local GPU, sandbox/pool.py) and
`DaskExecutor` (one per Dask worker, each owning a GPU, sandbox/cluster.py). The search loop, the bandit and the
store see only this interface. Every GPU kind keeps GpuWorker's per-phase deadlines and replacement, runs one job at
a time per GPU (timings never overlap on a GPU), and retries once, on any worker, a job whose worker process died
under it; a second death is recorded as a fault.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from core.device import H200, DeviceFacts
from core.records import BaselineJob, EvalJob, EvalResult, ProfileResult, Status

# sandbox.profile.profile_candidate: (cubin, family, params, problem) -> ProfileResult; GPU executors also pass
# device= (the index, in this process's view, of the GPU to profile on)
Profiler = Callable[..., ProfileResult]
Job = EvalJob | BaselineJob


class WorkerUnavailable(RuntimeError):
    """No worker could be started or none is left (no GPU, no driver, every Dask worker gone)."""


def died_twice(result: EvalResult) -> EvalResult:
    """The record of a job whose worker process died under it on the first try and on the retry."""
    return dataclasses.replace(result, reason=f"{result.reason}; the retry on a fresh worker died too")


def done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class Executor(ABC):
    """Runs EvalJobs (and BaselineJobs) on GPUs; one job per GPU at a time."""

    measures = True  # its results are measurements of a GPU (False: compile-only, nothing ran)

    @property
    @abstractmethod
    def info(self) -> dict[str, Any]:
        """The facts a GPU worker reported (every GPU of a run is the same model), as a dict."""

    @property
    def facts(self) -> DeviceFacts:
        return DeviceFacts.from_dict(self.info)

    @property
    @abstractmethod
    def slots(self) -> int:
        """How many jobs run at once now (the GPUs serving); at least 1."""

    @abstractmethod
    def submit(self, job: Job) -> Future:
        """A future of the job's EvalResult. It raises WorkerUnavailable only when no worker is left to run it."""

    @abstractmethod
    def profile(self, profiler: Profiler, job: EvalJob) -> Future:
        """A future of `profiler`'s ProfileResult for the job's kernel, run where it overlaps no timing."""

    def evaluate(self, job: Job) -> EvalResult:
        return self.submit(job).result()

    def describe(self) -> dict[str, Any]:
        """What ran the run, and what happened to its workers (kept with the run)."""
        return {}

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Stop every worker; jobs not finished are abandoned."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InlineExecutor(Executor):
    """Calls an evaluate function in the caller's thread at submit time: one slot, the order of a one-GPU run."""

    def __init__(self, evaluate: Callable[[Job], EvalResult]):
        self._evaluate = evaluate

    @property
    def info(self) -> dict[str, Any]:
        return H200.to_dict()  # a function has no GPU to report: the one we measure on stands in

    @property
    def slots(self) -> int:
        return 1

    def submit(self, job: Job) -> Future:
        return done(self._evaluate(job))  # an exception (Ctrl-C in a test) reaches the caller as it is

    def profile(self, profiler: Profiler, job: EvalJob) -> Future:
        return done(profiler(job.cubin, job.family, job.params, job.problem))



COMPILE_ONLY = "compile only"


class CompileOnly(Executor):
    """No GPU: every job comes back SKIPPED ("compile only") at once and nothing is profiled; the H200 stand-in's
    facts are what the search orders settings by."""

    measures = False

    @property
    def info(self) -> dict[str, Any]:
        return H200.to_dict()

    @property
    def slots(self) -> int:
        return 1

    def submit(self, job: Job) -> Future:
        return done(EvalResult(job.candidate_id, Status.SKIPPED, COMPILE_ONLY))

    def profile(self, profiler: Profiler, job: EvalJob) -> Future:
        return done(ProfileResult(False, error=COMPILE_ONLY))
