"""Evaluation on a Dask cluster: each Dask worker owns one GPU and runs the same sandboxed GPU worker process.

Kernels never run in a Dask worker itself: a worker plugin gives each Dask worker one GpuWorker child process
(started at its first job; the same per-phase deadlines, killed and replaced when it hangs or dies), and a job's
task hands it the EvalJob, cubin included, and returns its EvalResult. The store and the bandit stay with the
driver, which records each job's one result. A Dask worker lost mid-job: the scheduler runs the job again on
another worker (Dask's own re-queueing); a GPU worker process that died under a job: the job is submitted once more,
to any worker. Start one Dask worker per GPU, each with `--nthreads 1`, its own CUDA_VISIBLE_DEVICES and
DASK_DISTRIBUTED__WORKER__DAEMON=False (a daemonic worker process may not start children); see the README.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from distributed import Client, KilledWorker, get_worker
from distributed.comm import connect
from distributed.diagnostics.plugin import WorkerPlugin

from core.records import EvalJob, EvalResult, ProfileResult, Status
from sandbox.executor import Executor, Job, Profiler, WorkerUnavailable, died_twice
from sandbox.pool import STARTUP_TIMEOUT_S, GpuWorker, MixedDevices, same_model

PLUGIN = "hgemm-gpu-worker"
CONNECT_TIMEOUT_S = 10.0
DAEMONIC = ("this Dask worker is a daemonic process, which may not start the GPU worker's process: start it with "
            "DASK_DISTRIBUTED__WORKER__DAEMON=False")


class GpuWorkerPlugin(WorkerPlugin):
    """One GpuWorker (a child process on the Dask worker's first visible GPU) per Dask worker, one job at a time."""

    def __init__(self, target: Callable | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.target, self.startup_timeout_s = target, startup_timeout_s
        self.gpu: GpuWorker | None = None
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"target": self.target, "startup_timeout_s": self.startup_timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def setup(self, worker) -> None:
        self.gpu = GpuWorker(0, self.target, startup_timeout_s=self.startup_timeout_s)

    def teardown(self, worker) -> None:
        if self.gpu is None:
            return
        if self.lock.acquire(blocking=False):  # idle: let the GPU worker exit cleanly
            try:
                self.gpu.close()
            finally:
                self.lock.release()
        else:  # a job in progress: end it (its task then reports the death) rather than block the worker
            self.gpu.kill()


def _plugin() -> GpuWorkerPlugin:
    plugin = get_worker().plugins.get(PLUGIN)
    if plugin is None or plugin.gpu is None:
        raise WorkerUnavailable("this Dask worker has no GPU worker plugin")
    if mp.current_process().daemon:
        raise WorkerUnavailable(DAEMONIC)
    return plugin


def hello_task() -> dict[str, Any]:
    """Start the Dask worker's GPU worker (if it is not running) and return its facts."""
    p = _plugin()
    with p.lock:
        return p.gpu.info if p.gpu.alive() else p.gpu.start()


def evaluate_task(job: Job) -> tuple[EvalResult, bool]:
    p = _plugin()
    with p.lock:
        return p.gpu.attempt(job)


def profile_task(profiler: Profiler, job: EvalJob) -> ProfileResult:
    p = _plugin()
    with p.lock:  # no job times on this GPU while ncu runs
        return profiler(job.cubin, job.family, job.params, job.problem, device=0)


async def _probe(address: str, timeout_s: float) -> None:
    comm = await connect(address, timeout=timeout_s)
    await comm.close()


class DaskExecutor(Executor):
    """Jobs as tasks on a Dask cluster; a future per job on the driver, whatever happens to the workers."""

    def __init__(self, address: str, target: Callable | None = None, connect_timeout_s: float | None = None,
                 workers_timeout_s: float = 60.0, give_up_s: float = 300.0, poll_s: float = 2.0,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        self.address, self.target = address, target
        self.connect_timeout_s = connect_timeout_s or CONNECT_TIMEOUT_S
        self.workers_timeout_s = workers_timeout_s
        self.give_up_s, self.poll_s, self.startup_timeout_s = give_up_s, poll_s, startup_timeout_s
        self.client: Client | None = None
        self.infos: dict[str, dict[str, Any]] = {}
        self._tasks: dict[str, tuple[Any, Future]] = {}  # key -> (Dask future, driver future): keeps tasks alive
        self._lock = threading.RLock()  # held while a job's future is settled or it is sent again
        self._workers = 0
        self._registered = False
        self._closed = threading.Event()
        self.retried = self.lost_workers = 0

    def start(self) -> dict[str, Any]:
        """Connect, wait for a worker, give every worker its GPU worker, and check they are one GPU model."""
        try:  # a bare Client that cannot connect leaves a traceback behind at exit; a probe does not
            asyncio.run(_probe(self.address, self.connect_timeout_s))
        except (OSError, ValueError, TypeError) as e:
            raise WorkerUnavailable(f"cannot reach the Dask scheduler at {self.address} ({e})") from None
        self.client = Client(self.address, timeout=self.connect_timeout_s, set_as_default=False)
        try:
            self._hello()
        except (WorkerUnavailable, MixedDevices):
            self.close()
            raise
        except Exception as e:  # the scheduler went away meanwhile, a refused plugin: still one line for the user
            self.close()
            raise WorkerUnavailable(f"the Dask cluster at {self.address} failed ({type(e).__name__}: {e})") from None
        self._workers = len(self.infos)
        threading.Thread(target=self._watch, name="dask-workers", daemon=True).start()
        return self.info

    def _hello(self) -> None:
        try:
            self.client.wait_for_workers(1, timeout=self.workers_timeout_s)
        except TimeoutError:
            raise WorkerUnavailable(f"no Dask worker joined the scheduler at {self.address} within "
                                    f"{self.workers_timeout_s:.0f} s") from None
        self.client.register_plugin(GpuWorkerPlugin(self.target, self.startup_timeout_s), name=PLUGIN)
        self._registered = True
        addresses = sorted(self.client.scheduler_info()["workers"])
        hellos = {a: self.client.submit(hello_task, key=f"hello-{uuid.uuid4().hex[:8]}-{a}", workers=[a],
                                        allow_other_workers=False, pure=False) for a in addresses}
        failed = []
        for a, f in hellos.items():
            try:
                self.infos[a] = f.result(timeout=self.startup_timeout_s + 30)
            except Exception as e:  # no GPU there, a daemonic worker, a worker gone meanwhile
                failed.append(f"{a}: {e}")
        if failed:
            raise WorkerUnavailable("; ".join(failed))
        same_model(self.infos)

    @property
    def info(self) -> dict[str, Any]:
        return next(iter(self.infos.values()))

    @property
    def slots(self) -> int:
        return max(1, self._workers)

    def submit(self, job: Job) -> Future:
        out: Future = Future()
        self._send(evaluate_task, (job,), out, 0)
        return out

    def profile(self, profiler: Profiler, job: EvalJob) -> Future:
        out: Future = Future()
        self._send(profile_task, (profiler, job), out, 0)
        return out

    def _send(self, task: Callable, args: tuple, out: Future, tries: int) -> None:
        key = f"{task.__name__.removesuffix('_task')}-{args[-1].candidate_id}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            if self._closed.is_set():
                out.set_exception(WorkerUnavailable("the Dask executor is closed"))
                return
            remote = self.client.submit(task, *args, key=key, pure=False)
            self._tasks[key] = (remote, out)
        remote.add_done_callback(lambda f: self._done(f, task, args, out, tries))

    def _done(self, remote, task: Callable, args: tuple, out: Future, tries: int) -> None:
        """In Dask's callback thread: hand the result on, or send the job again once where its worker died."""
        with self._lock:
            self._tasks.pop(remote.key, None)
            if not self._closed.is_set() and not out.done():  # else: closing, or failed already for want of workers
                self._settle(remote, task, args, out, tries)

    def _settle(self, remote, task: Callable, args: tuple, out: Future, tries: int) -> None:
        job = args[-1]
        if remote.status == "finished":
            value = remote.result()
            if task is not evaluate_task:
                out.set_result(value)
                return
            result, died = value
            if died and tries == 0:
                self._again(task, args, out)
            else:
                out.set_result(died_twice(result) if died else result)
            return
        error = remote.exception() if remote.status == "error" else None
        if isinstance(error, KilledWorker):  # the job was running on every Dask worker the scheduler lost for it
            out.set_result(EvalResult(job.candidate_id, Status.FAULT, f"the Dask workers running it died ({error})"))
        elif isinstance(error, WorkerUnavailable) and tries == 0:  # that worker's GPU worker would not start
            self._again(task, args, out)
        else:
            why = f"{type(error).__name__}: {error}" if error else "the Dask scheduler dropped the job"
            out.set_exception(WorkerUnavailable(f"a job on the Dask cluster failed ({why})"))

    def _again(self, task: Callable, args: tuple, out: Future) -> None:
        with self._lock:
            self.retried += 1
        self._send(task, args, out, 1)

    def _watch(self) -> None:
        """How many workers serve now (the loop keeps that many jobs busy); with none for give_up_s, fail the jobs
        waiting for one, so that the run stops (resumable) instead of waiting for ever."""
        alone_since, known = None, set(self.infos)
        while not self._closed.wait(self.poll_s):
            try:
                now = set(self.client.scheduler_info()["workers"])
            except Exception:  # the scheduler is unreachable: as good as no worker
                now = set()
            with self._lock:
                self.lost_workers += len(known - now)
                self._workers, known = len(now), now
            alone_since = (alone_since or time.monotonic()) if not now else None
            if alone_since is not None and time.monotonic() - alone_since > self.give_up_s:
                self._fail_all(WorkerUnavailable(f"no Dask worker for {self.give_up_s:.0f} s"))

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            tasks, self._tasks = list(self._tasks.values()), {}
            for _, out in tasks:
                if not out.done():
                    out.set_exception(error)
        for remote, _ in tasks:
            remote.cancel()  # after: its callback then finds the job answered

    def describe(self) -> dict[str, Any]:
        return {"executor": "dask", "scheduler": self.address, "workers": sorted(self.infos),
                "serving": self._workers, "retried": self.retried, "lost_workers": self.lost_workers}

    def close(self) -> None:
        if self.client is None:
            return
        self._closed.set()
        with self._lock:
            remotes = [remote for remote, _ in self._tasks.values()]
            self._tasks = {}
        try:
            if remotes:
                self.client.cancel(remotes)
            if self._registered:  # each Dask worker closes its GPU worker process
                self.client.unregister_worker_plugin(PLUGIN)
        except Exception:  # a scheduler already gone: nothing left to tidy there
            pass
        self.client.close()
        self.client = None
