"""Overlapped launches (core/overlap.py): every template waits before it touches an operand, the launch rules allow
it only where the GPU can, the loop asks the sandbox to check it where the source waits, and the export marks only
kernels built with the wait (CPU; the check itself and the launches run in the GPU tests: tests/adversarial's
reads_before_wait, tests/test_sandbox_gpu.py, the export's op tests)."""

from __future__ import annotations

import ctypes
import dataclasses
import json

import pytest

from agent.store import RunStore
from core.device import H200
from core.overlap import OVERLAP_CUDA, waits
from core.records import EvalJob, Problem
from sandbox.driver import LaunchAttribute, LaunchConfig
from templates import get_family
from tests.helpers import fake_evaluate, populated_run

A100_LIKE = dataclasses.replace(H200, name="an sm_80 GPU", arch="sm_80", cc="8.0")
PROBLEMS = [Problem(1, 6144, 4096, "nk"), Problem(2048, 4096, 4096, "nk", epilogue="residual"),
            Problem(300, 1000, 520, "kn", bias=True), Problem(64, 28672, 4096, "nk", epilogue="silu_mul")]


def settings(family: str, problem: Problem, count: int = 6) -> list[dict]:
    fam = get_family(family)
    return fam.space(problem)[:count] if fam.searched else [{"block_x": 16, "block_y": 16}]


@pytest.mark.parametrize("family", ["sm90_wgmma", "sm80_mma", "naive"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.key)
def test_every_template_waits_before_it_touches_an_operand(family, problem):
    fam = get_family(family)
    for params in settings(family, problem):
        src = fam.render(params, problem)
        assert waits(src) and OVERLAP_CUDA in src
        body = src[src.index("hgemm(const unsigned short*"):]
        wait = body.index("overlap_wait();")
        assert "overlap_release();" in body[wait:]
        assert not any(x in body[:wait] for x in ("cp_async16(", "tma_load(", "A[", "B[", "C["))  # set-up only
        if family == "sm90_wgmma":  # after the barriers exist, before the producer's and consumers' roles split
            assert body.index("mbar_init(full") < wait < body.index("if (wg == 0)")


@pytest.mark.parametrize("family", ["sm90_wgmma", "sm80_mma", "naive"])
def test_launch_rules_overlap_only_where_the_gpu_can(family):
    problem = PROBLEMS[0]
    params = settings(family, problem, 1)[0]
    assert get_family(family).launch(params, problem, H200).overlap
    if family != "sm90_wgmma":  # sm90 kernels do not run on sm_80 at all
        assert not get_family(family).launch(params, problem, A100_LIKE).overlap


def test_waits_is_the_wait_in_the_source():
    assert waits('asm volatile("griddepcontrol.wait;" ::: "memory");')
    assert not waits("extern \"C\" __global__ void hgemm() {}")


def test_driver_launch_structs_have_the_drivers_layout():
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.stream.offset, LaunchConfig.attrs.offset, LaunchConfig.num_attrs.offset) == (32, 40, 48)


def test_the_loop_asks_the_sandbox_to_check_overlap_where_the_source_waits(tmp_path):
    jobs: list[EvalJob] = []

    def record(job: EvalJob):
        jobs.append(job)
        return fake_evaluate(job)

    populated_run(tmp_path / "r", [Problem(1000, 3000, 2000)], n=3, evaluate=record)
    assert jobs and all(j.overlap for j in jobs)


def test_export_marks_only_kernels_built_with_the_wait(tmp_path, monkeypatch):
    from agent.export import export_run

    store = populated_run(tmp_path / "r")
    export_run(store, tmp_path / "new")
    manifest = json.loads((tmp_path / "new" / "manifest.json").read_text())
    assert all(e["overlap"] for e in manifest["kernels"].values())
    assert all(e["overlap"] for part in ("gated", "norm") for e in manifest[part].values())
    header = "it waits for the kernel ahead of it (griddepcontrol.wait)"
    assert all(header in (tmp_path / "new" / e["file"]).read_text() for e in manifest["kernels"].values())
    # a kernel built before the wait existed (its source without it) is never launched overlapped
    real = RunStore.build

    def old_build(self, cid):
        b = real(self, cid)
        return dataclasses.replace(b, source=b.source.replace("griddepcontrol.wait", "/* none */"))

    monkeypatch.setattr(RunStore, "build", old_build)
    export_run(store, tmp_path / "old")
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    assert manifest["kernels"] and not any(e["overlap"] for e in manifest["kernels"].values())
    assert not any(header in (tmp_path / "old" / e["file"]).read_text() for e in manifest["kernels"].values())
