"""Shared fixtures: GPU tests are marked `gpu` and skipped where no CUDA device is visible; tests whose verdict
compares timings are marked `gpu_alone` too and skipped under pytest -n, where other test processes share the GPU."""

from __future__ import annotations

import os

import pytest


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


HAS_GPU = _has_gpu()
# other pytest processes on the same GPU (pytest -n) shift timings by more than the verdicts allow (docs/notebook.md)
SHARED_GPU = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    alone = pytest.mark.skip(reason="a timing verdict: run without pytest -n (a GPU of its own)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)
        elif "gpu_alone" in item.keywords and SHARED_GPU:
            item.add_marker(alone)


@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cubins"


@pytest.fixture(autouse=True)
def _own_tuning_db(tmp_path, monkeypatch):
    """Runs in tests learn from and add to a database of their own, never the user's."""
    monkeypatch.setenv("HGEMM_AGENT_TUNING_DB", str(tmp_path / "tuning.sqlite"))


@pytest.fixture(scope="session")
def op_build_dir(tmp_path_factory):
    """Where the exported op's C++ extension is built: once per test session (a process loads it once anyway)."""
    folder = tmp_path_factory.mktemp("hgemm_op_build")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HGEMM_OPS_BUILD_DIR", str(folder))
        yield folder
