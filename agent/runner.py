"""Set up and drive one run, in three steps read top to bottom:

1. `prepare`: everything that can fail on bad input, a missing GPU or an unreachable cluster fails here, before the
   run folder exists: NVRTC probed, the executor started (GPU workers, a Dask cluster, or compile-only), the problems
   checked against the GPU's memory, the tuning database and the proposer opened.
2. `begin`: the run store created (or the resumed one continued) and what the run is, recorded in it.
3. `search`: the loop, its progress told to the view, and how it ended.

`execute` runs the three and releases what set-up holds. The command line picks the view and prints the summary.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from agent.config import RunConfig
from agent.cost_model import Learner
from agent.events import Notice, Observer
from agent.loop import SearchLoop
from agent.proposers import make_proposer
from agent.proposers.base import Proposer
from agent.store import RunStore
from agent.tuning_db import TuningDB, TuningDbError, TuningRecorder
from core.device import DeviceFacts
from core.records import Problem
from sandbox.build import NvrtcUnavailable, nvrtc_version
from sandbox.build_pool import BuildPool
from sandbox.executor import CompileOnly, Executor, WorkerUnavailable
from sandbox.profile import profile_candidate

EXIT_DONE, EXIT_LOST, EXIT_INTERRUPTED = 0, 1, 130
TIMING_COPIES = 8  # operand footprints a problem needs at once: check buffers, two timed sets a subject, references
AHEAD_PROCESSES = 4  # NVRTC processes compiling the proposer's likely next candidates (at most)
NO_GPU = "--compile-only renders and compiles without one"

View = Callable[[str], AbstractContextManager[Observer]]  # a title -> a context holding the observer


class SetupError(ValueError):
    pass


@dataclass
class Setup:
    """What a run holds while it runs, made before its folder exists."""

    config: RunConfig
    problems: list[Problem]
    executor: Executor
    facts: DeviceFacts  # the GPU's, or the H200 stand-in's when compiling only
    arch: str
    builder: BuildPool
    ahead: BuildPool | None
    db: TuningDB | None
    learner: Learner | None
    proposer: Proposer
    notes: list[tuple[str, str]]  # (topic, line) set-up has to say: the stand-in device, the tuning database

    @property
    def measured(self) -> bool:
        return self.executor.measures

    def title(self, run_id: str) -> str:
        slots = self.executor.slots
        where = (f"{self.facts.name}" + (f" x{slots}" if slots > 1 else "") if self.measured
                 else f"compile only (settings ordered for the {self.facts.name} stand-in)")
        return f"run {run_id}: {self.config.proposer} proposer, {self.arch}, {where}"

    def close(self) -> None:
        for part in (self.proposer, self.builder, self.ahead, self.db, self.executor):
            if part is not None:
                part.close()


@dataclass(frozen=True)
class Outcome:
    """How a run ended: its exit code, its store, and why it stopped where it did not finish."""

    code: int
    store: RunStore
    reason: str = ""


def execute(config: RunConfig, problems: list[Problem] | None, store: RunStore | None,
            make_store: Callable[[], RunStore], view: View, gpus: tuple[int, ...] | str | None = None,
            cluster: str | None = None) -> Outcome:
    """A new run of `problems` (store None: `make_store` makes its store once set-up succeeded), or the resumed run
    `store` with its own problems."""
    setup = prepare(config, store.problems() if store is not None else problems, gpus, cluster)
    try:
        store = begin(setup, store, make_store)
        with view(setup.title(store.run_id)) as observe:
            return search(setup, store, observe)
    except KeyboardInterrupt:
        if store is None:
            raise
        store.set_meta("state", "interrupted")
        return Outcome(EXIT_INTERRUPTED, store)
    finally:
        if store is not None and setup.measured:
            store.set_meta("executor", setup.executor.describe())
        setup.close()


# 1. set-up
def prepare(config: RunConfig, problems: list[Problem], gpus: tuple[int, ...] | str | None = None,
            cluster: str | None = None) -> Setup:
    try:
        nvrtc_version()
    except NvrtcUnavailable as e:
        raise SetupError(str(e)) from None
    if config.compile_only:
        executor: Executor = CompileOnly()
        facts = executor.facts
    else:
        executor, facts = start_pool(config.arch, gpus, cluster)
    try:
        if executor.measures and (why := too_big(problems, facts)):
            raise SetupError(why)
        builder, ahead = build_pools(executor.slots, config.compile_only)
        db, learner, tuning_note = open_tuning(config.tuning_db, facts, config.seed)
        notes = ([("setup", stand_in_note(facts, tuning_note))] if not executor.measures
                 else [("tuning", tuning_note)] if tuning_note else [])
        proposer = make_proposer(config, learner)
    except BaseException:  # a failed set-up (or Ctrl-C in it) leaves no GPU worker behind
        executor.close()
        raise
    return Setup(config, problems, executor, facts, config.arch or facts.arch, builder, ahead, db, learner,
                 proposer, notes)


def stand_in_note(facts: DeviceFacts, tuning_note: str) -> str:
    """What a compile-only run orders its settings by: the stand-in's facts, and what the tuning database holds of
    that GPU model, not a GPU of this machine."""
    return (f"compile only, no GPU: nothing is checked or timed; settings are ordered for the {facts.name} stand-in "
            f"(its facts" + (f"; {tuning_note}" if tuning_note else "") + ")")


def gpu_indices(gpus: tuple[int, ...] | str | None) -> tuple[int, ...]:
    """The local GPUs to use: the first by default, "all" of those visible, or the ones named (checked to exist)."""
    if gpus is None:
        return (0,)
    import torch  # counts the devices through the driver; no CUDA context is made in this process

    visible = torch.cuda.device_count()
    if visible == 0:
        raise SetupError(f"no usable GPU (no CUDA device is visible); {NO_GPU}")
    if gpus == "all":
        return tuple(range(visible))
    if missing := [g for g in gpus if g >= visible]:
        raise SetupError(f"--gpus: no GPU {missing[0]} here ({visible} visible: 0-{visible - 1})")
    return tuple(gpus)


def start_pool(arch: str | None, gpus: tuple[int, ...] | str | None = None, cluster: str | None = None,
               no_gpu: str = NO_GPU) -> tuple[Executor, DeviceFacts]:
    """Started GPU workers (one per chosen local GPU, or one per Dask worker of a cluster) and their DeviceFacts,
    or a SetupError saying why there are none (`no_gpu`: what the user can do instead)."""
    from sandbox.pool import MixedDevices, WorkerPool

    if cluster:
        try:
            from sandbox.cluster import DaskExecutor
        except ImportError as e:
            raise SetupError(f"--cluster needs Dask ({e}): pip install 'distributed==2026.8.0'") from None
        executor: Executor = DaskExecutor(cluster)
    else:
        executor = WorkerPool(gpu_indices(gpus))
    try:
        executor.start()
    except WorkerUnavailable as e:
        executor.close()
        raise SetupError(str(e) if cluster else f"no usable GPU ({e}); {no_gpu}") from None
    except MixedDevices as e:
        raise SetupError(str(e)) from None
    facts = executor.facts
    if arch and arch != facts.arch:
        executor.close()
        raise SetupError(f"--arch {arch} does not match the GPU ({facts.name}, {facts.arch})")
    return executor, facts


def too_big(problems: list[Problem], device: DeviceFacts) -> str | None:
    """Why a problem cannot be checked and timed on this GPU (its operands, the checks' copies and the timing sets
    would not fit in its memory), or None."""
    for p in problems:
        need = TIMING_COPIES * p.operand_bytes
        if need > device.memory_bytes:
            return (f"{p.mnk} needs about {need / 2**30:.0f} GiB of GPU memory for its operands, the checks' copies "
                    f"and the timing sets; {device.name} has {device.memory_bytes / 2**30:.0f} GiB")
    return None


def build_pools(slots: int, compile_only: bool) -> tuple[BuildPool, BuildPool | None]:
    """The loop's compilers for `slots` GPUs: the candidates proposed (one GPU: in this process, one at a time; more:
    in processes, ahead of the GPUs), and the proposer's likely next ones while the GPUs evaluate, on the cores the
    builder and the workers leave (none when compiling only)."""
    cpus = os.cpu_count() or 1
    builder = BuildPool(0 if slots == 1 else min(2 * slots - 1, cpus))
    return builder, None if compile_only else BuildPool(max(1, min(AHEAD_PROCESSES, cpus - slots)))


def open_tuning(path: str | None, device: DeviceFacts, seed: int) -> tuple[TuningDB | None, Learner | None, str]:
    """The tuning database and the cost model learning from its rows of this GPU model (retrained as the run adds
    problems), with a line saying what was learned; a database that cannot be opened leaves the run without one
    (said once), never stops it."""
    if path is None:
        return None, None, ""
    try:
        db = TuningDB(path)
        learner = Learner(db, device.name, seed=seed)
    except (TuningDbError, sqlite3.Error) as e:
        return None, None, f"{e}: the run goes on without a tuning database"
    return db, learner, f"tuning database {db.path}; {learner.note}"


# 2. the run store
def begin(setup: Setup, store: RunStore | None, make_store: Callable[[], RunStore]) -> RunStore:
    """The run's store, new or resumed, with the run's configuration, arch and device recorded."""
    if store is None:
        store = make_store()
        store.add_problems(setup.problems)
    store.set_meta("config", setup.config.model_dump(mode="json"))
    store.set_meta("arch", setup.arch)
    if setup.measured:
        store.set_meta("device", setup.facts.to_dict())
        store.set_meta("executor", setup.executor.describe())
    store.set_meta("state", "running")
    return store


# 3. the search
def search(setup: Setup, store: RunStore, observe: Observer) -> Outcome:
    """The loop over the run's problems, what it does told to `observe`; Ctrl-C reaches the caller."""

    def say(topic: str, message: str) -> None:
        store.event(topic, message)
        observe(Notice(topic, message))

    for topic, note in setup.notes:
        say(topic, note)
    if setup.learner is not None:
        setup.learner.notify = lambda note: store.event("tuning", note)
    if setup.db is not None and setup.measured:  # compile-only results are not measurements
        store.listeners.append(TuningRecorder(setup.db, store.run_id, setup.facts, setup.arch,
                                              lambda message: say("tuning", message)))
    loop = SearchLoop(store, setup.config, setup.proposer, setup.arch, setup.executor, observe, profile_candidate,
                      device=setup.facts, builder=setup.builder, ahead=setup.ahead)
    try:
        loop.run(setup.problems)
    except WorkerUnavailable as e:  # every GPU worker gone mid-run (a cluster that lost all its workers)
        store.set_meta("state", "interrupted")
        return Outcome(EXIT_LOST, store, str(e))
    store.set_meta("state", "done")
    return Outcome(EXIT_DONE, store)
