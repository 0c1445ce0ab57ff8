"""Set up and drive one run: pick the arch, start the GPU workers, open the store, show progress, stop cleanly.

Everything that can fail on bad input, a missing GPU or an unreachable cluster fails here, before the run folder
is created.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable

from agent.config import RunConfig
from agent.cost_model import Learner
from agent.loop import SearchLoop
from agent.proposers import make_proposer
from agent.report import LineView, LiveView, next_steps, show_run
from agent.store import RunStore
from agent.tuning_db import TuningDB, TuningDbError, TuningRecorder
from core.device import H200, DeviceFacts
from core.records import Problem
from sandbox.build import NvrtcUnavailable, nvrtc_version
from sandbox.build_pool import BuildPool
from sandbox.executor import Executor, WorkerUnavailable
from sandbox.profile import profile_candidate

EXIT_INTERRUPTED = 130
TIMING_COPIES = 8  # operand footprints a problem needs at once: check buffers, two timed sets a subject, references
EXIT_LOST = 1
AHEAD_PROCESSES = 4  # NVRTC processes compiling the proposer's likely next candidates (at most)
NO_GPU = "--compile-only renders and compiles without one"


class SetupError(ValueError):
    pass


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


def start_pool(arch: str | None, gpus: tuple[int, ...] | str | None = None,
               cluster: str | None = None) -> tuple[Executor, DeviceFacts]:
    """Started GPU workers (one per chosen local GPU, or one per Dask worker of a cluster) and their DeviceFacts,
    or a SetupError saying why there are none."""
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
        raise SetupError(str(e) if cluster else f"no usable GPU ({e}); {NO_GPU}") from None
    except MixedDevices as e:
        raise SetupError(str(e)) from None
    facts = executor.facts
    if arch and arch != facts.arch:
        executor.close()
        raise SetupError(f"--arch {arch} does not match the GPU ({facts.name}, {facts.arch})")
    return executor, facts


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


def execute(config: RunConfig, problems: list[Problem] | None, store: RunStore | None,
            make_store: Callable[[], RunStore], console, live_cls, gpus: tuple[int, ...] | str | None = None,
            cluster: str | None = None) -> int:
    if store is not None:  # resume: the run's own shapes, its proposer, its arch
        problems = store.problems()
        saved = RunConfig(**store.get_meta("config"))
        config = config.model_copy(update={"proposer": saved.proposer, "arch": store.get_meta("arch"),
                                           "compile_only": saved.compile_only, "seed": saved.seed})
    try:
        nvrtc_version()
    except NvrtcUnavailable as e:
        raise SetupError(str(e)) from None
    pool, device = (None, None) if config.compile_only else start_pool(config.arch, gpus, cluster)
    if device is not None and (why := too_big(problems, device)):
        pool.close()
        raise SetupError(why)
    arch = config.arch or (device.arch if device else "sm_90a")
    facts = device or H200  # compile only: the search orders settings for the GPU we measure on
    slots = pool.slots if pool else 1
    builder, ahead = build_pools(slots, config.compile_only)
    db, model, tuning_note = open_tuning(config.tuning_db, facts, config.seed)
    proposer = make_proposer(config, model)
    try:
        if store is None:
            store = make_store()
            store.add_problems(problems)
            store.set_meta("config", config.model_dump(mode="json"))
        store.set_meta("arch", arch)
        if device:
            store.set_meta("device", device.to_dict())
            store.set_meta("executor", pool.describe())
        store.set_meta("state", "running")
        if tuning_note:
            store.event("tuning", tuning_note)
            console.print(tuning_note)
        if model is not None:
            model.notify = lambda note: store.event("tuning", note)
        if db is not None and device is not None:  # compile-only results are not measurements

            def tuning_failed(message: str) -> None:
                store.event("tuning", message)
                console.print(message)

            store.listeners.append(TuningRecorder(db, store.run_id, device, arch, tuning_failed))
        where = "compile only" if config.compile_only else f"{facts.name}" + (f" x{slots}" if slots > 1 else "")
        title = f"run {store.run_id}: {config.proposer} proposer, {arch}, {where}"
        view = LiveView(title) if live_cls else LineView(title, console)
        loop = SearchLoop(store, config, proposer, arch, pool, view, profile_candidate, device=facts,
                          builder=builder, ahead=ahead)
        if live_cls:
            with live_cls(view, console=console, refresh_per_second=4, transient=False):
                loop.run(problems)
        else:  # pipes and files: whole lines as the run goes, no redrawn table
            loop.run(problems)
        store.set_meta("state", "done")
    except KeyboardInterrupt:
        if store is not None:
            store.set_meta("state", "interrupted")
            console.print(f"interrupted: python -m agent run --resume {store.run_id} continues it")
        return EXIT_INTERRUPTED
    except WorkerUnavailable as e:  # every GPU worker gone mid-run (a cluster that lost all its workers)
        if store is None:
            raise
        store.set_meta("state", "interrupted")
        console.print(f"stopped: {e}; python -m agent run --resume {store.run_id} continues it")
        return EXIT_LOST
    finally:
        proposer.close()
        builder.close()
        if ahead is not None:
            ahead.close()
        if db is not None:
            db.close()
        if pool is not None:
            if store is not None:
                store.set_meta("executor", pool.describe())
            pool.close()
    console.print(show_run(store))
    console.print(next_steps(store), soft_wrap=True)
    return 0


def too_big(problems: list[Problem], device: DeviceFacts) -> str | None:
    """Why a problem cannot be checked and timed on this GPU (its operands, the checks' copies and the timing sets
    would not fit in its memory), or None."""
    for p in problems:
        need = TIMING_COPIES * p.operand_bytes
        if need > device.memory_bytes:
            return (f"{p.mnk} needs about {need / 2**30:.0f} GiB of GPU memory for its operands, the checks' copies "
                    f"and the timing sets; {device.name} has {device.memory_bytes / 2**30:.0f} GiB")
    return None
