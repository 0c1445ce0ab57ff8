"""Shared test helpers: a fake evaluator whose timings follow the parameters, a populated run, and a family's kernel
compiled without spills."""

from __future__ import annotations

from agent.config import RunConfig
from agent.loop import SearchLoop
from agent.proposers.builtin import BuiltinProposer
from agent.store import RunStore
from core.records import BuildResult, EvalJob, EvalResult, Problem, Status, Timing
from sandbox.build import compile_cuda
from templates import get_family


def clean_build(family: str, params: dict, problem: Problem, arch: str = "sm_90a") -> BuildResult:
    """The family's kernel for the problem, compiled: asserts it built and spills nothing."""
    build = compile_cuda(get_family(family).render(params, problem), arch)
    assert build.ok, build.log[-2000:]
    assert build.spill_bytes == 0, (problem.key, build.spill_bytes)
    return build


def tile(params: dict) -> tuple[int, int, int]:
    """block_m, block_n and stages of a setting; a family without tiles (gemv) as a small one-stage tile."""
    return params.get("block_m", 16), params.get("block_n", 64), params.get("stages", 1)


def fake_evaluate(job: EvalJob) -> EvalResult:
    """Bigger tiles are faster here, and nothing beats cuBLAS (30 us) below M = 128."""
    block_m, block_n, stages = tile(job.params)
    t = 100.0 / (block_m * block_n / 4096) + stages
    if job.problem.m < 128:
        t += 60.0
    if job.honest_only:  # a re-measurement: the honest timings alone, as the worker returns them
        return EvalResult(job.candidate_id, Status.OK, honest=Timing(t * 1.02, t, t * 1.04, 100),
                          cublas_honest=Timing(31.0, 30.7, 31.3, 100), max_rel_err=3e-4, cublas_rel_err=3e-4,
                          device={"name": "fake GPU"})
    return EvalResult(job.candidate_id, Status.OK, warm=Timing(t, t * 0.99, t * 1.01, 100),
                      cold=Timing(t * 1.1, t, t * 1.2, 100), cublas_warm=Timing(30.0, 29.7, 30.3, 100),
                      cublas_cold=Timing(33.0, 32, 34, 100), max_rel_err=3e-4, cublas_rel_err=3e-4,
                      device={"name": "fake GPU"})


FAST_FROM_M = 20


def m_dependent_evaluate(job: EvalJob) -> EvalResult:
    """Every kernel 1.5x of cuBLAS (30 us) or better from M = FAST_FROM_M up, 0.75x or worse below; within that,
    bigger tiles and fewer stages are faster (so leaders differ)."""
    block_m, block_n, stages = tile(job.params)
    t = 20.0 - block_m * block_n / 2**14 + stages / 10
    if job.problem.m < FAST_FROM_M:
        t += 20.0
    return EvalResult(job.candidate_id, Status.OK, warm=Timing(t, t * 0.99, t * 1.01, 100),
                      cold=Timing(t * 1.1, t, t * 1.2, 100), cublas_warm=Timing(30.0, 29.7, 30.3, 100),
                      cublas_cold=Timing(33.0, 32, 34, 100), device={"name": "fake GPU"})


DEFAULT_PROBLEMS = (Problem(1000, 3000, 2000), Problem(64, 64, 64, "nk"))


def populated_run(folder, problems=DEFAULT_PROBLEMS, n=6, evaluate=fake_evaluate) -> RunStore:
    store = RunStore(folder, create=True)
    store.add_problems(list(problems))
    config = RunConfig(max_candidates=n)
    store.set_meta("config", config.model_dump(mode="json"))
    store.set_meta("arch", "sm_90a")
    SearchLoop(store, config, BuiltinProposer(), "sm_90a", evaluate).run(list(problems))
    store.set_meta("state", "done")
    return store


def sometimes_wrong(every: int = 3):
    """fake_evaluate, but every `every`-th call reports a wrong result, so failures show up too."""
    calls = []

    def evaluate(job: EvalJob) -> EvalResult:
        calls.append(job.candidate_id)
        if len(calls) % every == 0:
            return EvalResult(job.candidate_id, Status.WRONG, "wrong result: relative error 1e-1 vs cuBLAS 3e-4")
        return fake_evaluate(job)

    return evaluate


def builds_in_both_layouts(family: str, params: dict, mnk: tuple[int, int, int]) -> None:
    """The setting launches and compiles without spills for the problem in kn and nk, bf16 with a bias."""
    for layout in ("kn", "nk"):
        problem = Problem(*mnk, layout, "bf16", True)
        get_family(family).launch(params, problem)
        clean_build(family, params, problem)
