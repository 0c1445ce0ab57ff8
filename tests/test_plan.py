"""LaunchPlan (core/plan.py) and the device limits it reads: one count of tiles, blocks, clusters and waves for the
launch rules and the cost models, and device limits written only in core/device.py."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from core.device import ARCH_LIMITS, H200
from core.plan import LaunchPlan, ceil_div
from core.records import Problem
from templates.sm80_mma.space import Sm80Mma, Sm80MmaParams
from templates.sm80_mma.space import launch_plan as sm80_plan
from templates.sm90_wgmma.params import Sm90WgmmaParams, launch_plan
from templates.sm90_wgmma.space import Sm90Wgmma

ROOT = Path(__file__).parents[1]
SM90, SM80 = Sm90Wgmma(), Sm80Mma()


def test_ceil_div():
    assert [ceil_div(a, 4) for a in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert ceil_div(0, 7) == 0


@pytest.mark.parametrize("problem", [Problem(4096, 4096, 4096), Problem(512, 1024, 8192, "nk"),
                                     Problem(16, 4096, 4096, "nk"), Problem(933, 6912, 16), Problem(657, 9984, 3144,
                                                                                                   "nk")],
                         ids=lambda p: p.key)
def test_every_setting_launches_what_its_plan_counts(problem):
    for device in (H200, replace(H200, sms=114)):
        for params in SM90.space(problem, device):
            p = Sm90WgmmaParams(**params)
            plan = launch_plan(p, problem, device)
            spec = SM90.launch(params, problem, device)
            assert spec.grid == (plan.ctas, 1, 1) and spec.smem_bytes == plan.smem_bytes
            assert plan.ctas % plan.cluster == 0 and plan.clusters * plan.cluster == plan.ctas
            if p.persistent:
                assert plan.ctas <= device.sms * p.min_blocks
            else:
                assert plan.ctas == plan.tiles * p.split_k * p.k_groups
        for params in SM80.space(problem, device):
            plan = sm80_plan(Sm80MmaParams(**params), problem, device)
            assert SM80.launch(params, problem, device).grid == (plan.ctas, 1, 1) == (plan.tiles, 1, 1)


def test_persistent_blocks_fill_the_sms_in_whole_clusters():
    pair = Sm90WgmmaParams(block_m=128, block_n=256, consumers=2, stages=3, cluster_m=2, persistent=True,
                           epilogue="tma")
    big = Problem(4096, 4096, 4096)
    assert launch_plan(pair, big, H200).ctas == 132
    assert launch_plan(pair, big, replace(H200, sms=131)).ctas == 130  # 65 pairs
    assert launch_plan(pair, Problem(300, 512, 64), H200).ctas == 8  # fewer tiles than slots: the tiles, padded
    two = pair.model_copy(update={"cluster_m": 1, "min_blocks": 2, "block_m": 64, "block_n": 64, "consumers": 1})
    assert launch_plan(two, big, H200).persistent_slots == 264


def test_waves_and_residency_count_the_device():
    p = Sm90WgmmaParams(block_m=128, block_n=128, consumers=2, stages=4)
    problem = Problem(4096, 4096, 4096)  # 1024 tiles
    assert launch_plan(p, problem, H200).waves == 8 and launch_plan(p, problem, replace(H200, sms=114)).waves == 9
    assert launch_plan(p, Problem(128, 1024, 64), H200).blocks_per_busy_sm == 1
    # 132 KB a block: one an SM by shared memory on the H200, three with twice its shared memory; without that
    # limit the threads decide (2048 an SM, 384 a block)
    assert p.smem_bytes > H200.smem_per_sm // 2
    assert launch_plan(p, problem, H200).resident == 1
    assert launch_plan(p, problem, replace(H200, smem_per_sm=2 * H200.smem_per_sm)).resident == 3
    assert launch_plan(p, problem, replace(H200, smem_per_sm=10**7)).resident == 2048 // 384


def test_clusters_at_once_as_the_h200_ran_them_and_never_more_than_the_sms_hold():
    assert [H200.clusters_at_once(n) for n in (1, 2, 4, 8)] == [132, 66, 30, 14]
    small = replace(H200, sms=114)
    assert [small.clusters_at_once(n) for n in (1, 2, 4, 8)] == [114, 57, 28, 14]
    assert H200.clusters_at_once(3) == 0  # no cluster of 3 is proposed
    split = Sm90WgmmaParams(block_m=64, block_n=128, consumers=1, stages=8, split_k=4)
    assert launch_plan(split, Problem(64, 4096, 16384), H200).clusters_at_once == 30


def test_limits_come_from_the_device_and_its_arch():
    assert H200.limits == ARCH_LIMITS["sm_90a"]
    a100 = replace(H200, arch="sm_80", smem_per_block=163 * 1024, smem_per_sm=164 * 1024)
    assert a100.limits == ARCH_LIMITS["sm_80"]
    plan = LaunchPlan(tiles=10, tile_ctas=1, cluster=1, min_blocks=1, persistent=False, smem_bytes=80 * 1024,
                      threads=256, device=a100)
    assert plan.resident == 164 * 1024 // (81 * 1024) == 2


def test_an_sm_holds_whole_blocks_by_registers_in_eights_shared_memory_and_threads():
    limits = ARCH_LIMITS["sm_90a"]
    assert limits.resident_threads(67, 128) == 7 * 128  # 72 a thread: 9216 a block
    assert limits.resident_threads(92, 128) == 5 * 128  # 96: the m_tile 2 norm variant measured slow (20 of 28 warps)
    assert limits.resident_threads(32, 128, smem=100 * 1024) == 2 * 128  # 101 KB a block with the driver's share
    assert limits.resident_threads(16, 1024) == 2 * 1024  # 2048 threads an SM


def test_device_limits_are_written_only_in_core_device():
    """Shared memory, registers and cluster placement: numbers of the GPU, not of a family."""
    pattern = re.compile(r"\b(22[78]|16[34]) \* 1024\b|\b65536\b|CLUSTERS_PER_SLOT|\{2: 66")
    found = [str(path.relative_to(ROOT)) for folder in ("agent", "core", "sandbox", "templates")
             for path in (ROOT / folder).rglob("*.py") if pattern.search(path.read_text())]
    assert found == ["core/device.py"]
