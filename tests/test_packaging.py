"""The package as `pip install .` leaves it: the prompts and kernel templates travel with the code, so the LLM
proposer and the families work outside the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import agent.proposers.llm as llm
from agent.config import LlmSettings
from templates import FAMILIES
assert "target" in str(llm.PROMPTS), llm.PROMPTS
p = llm.LlmProposer(LlmSettings(base_url="http://127.0.0.1:9/v1"))
print(*(len(p.prompts.loader.get_source(p.prompts, name)[0]) > 100 for name in ("propose.j2", "system.j2")))
print(all(len(f.template_source()) > 100 for f in FAMILIES.values()))
"""


def test_installed_package_finds_its_prompts_and_templates(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"  # a copy: the build must not write into the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "tests", ".cache", "*.pyc",
                                                                "build", "*.egg-info", ".whl", ".site"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True, timeout=600)
    assert (target / "prompts" / "propose.j2").is_file()
    out = subprocess.run([sys.executable, "-c", PROBE],
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True"]
    assert str(target) in subprocess.run(
        [sys.executable, "-c", "import prompts; print(prompts.__file__)"], cwd=tmp_path,
        env={"PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=60).stdout
