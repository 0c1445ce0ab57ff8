"""Shared fixtures: GPU tests are marked `gpu` and skipped where no CUDA device is visible."""

from __future__ import annotations

import pytest


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


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
