"""The package as `pip install .` leaves it: the prompts and kernel templates travel with the code, so the LLM
proposer and the families work outside the checkout; the `hgemm-agent` command; the dependencies pyproject and
requirements.txt name (the same, and each used)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
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
    import agent

    script = subprocess.run([str(target / "bin" / "hgemm-agent"), "--version"], cwd=tmp_path,
                            env={"PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and script.stdout == f"hgemm-agent {agent.__version__}\n", script.stderr
    assert (target / f"hgemm_agent-{agent.__version__}.dist-info").is_dir()  # the version pyproject reads from agent


def _requirement_names(lines: list[str]) -> list[str]:
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def test_requirements_are_pyproject_dependencies_and_the_test_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    blocks = (ROOT / "requirements.txt").read_text().split("\n\n")
    runtime, test = (_requirement_names(b.splitlines()) for b in blocks)
    assert runtime == project["dependencies"]
    assert test == project["optional-dependencies"]["test"]
    assert not any(r.startswith("cuda-bindings") for r in runtime + test)  # nothing imports it


# the import name of each runtime dependency; nvidia-cuda-nvrtc is the library CuPy's NVRTC bindings load
IMPORTS = {"jinja2": "jinja2", "pydantic": "pydantic", "rich": "rich", "openai": "openai", "numpy": "numpy",
           "torch": "torch", "cupy-cuda13x": "cupy", "nvidia-cuda-nvrtc": "cupy_backends.cuda.libs.nvrtc"}


def test_every_runtime_dependency_is_imported_by_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~ ]", d)[0] for d in project["dependencies"]]
    assert sorted(names) == sorted(IMPORTS)
    sources = "\n".join(p.read_text() for folder in ("agent", "core", "sandbox", "templates")
                        for p in (ROOT / folder).rglob("*.py"))
    for name, module in IMPORTS.items():
        parent, _, leaf = module.rpartition(".")
        forms = [rf"import {re.escape(module)}\b", rf"from {re.escape(module)}[. ]"]
        if parent:
            forms.append(rf"from {re.escape(parent)} import {leaf}\b")
        assert re.search(rf"^\s*({'|'.join(forms)})", sources, re.M), name


def test_the_package_names_what_it_offers_and_imports_torch_only_when_asked():
    probe = "import agent, sys; print(sorted(agent.__all__), 'main' in dir(agent), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split("] ")[1].split() == ["True", "False"], out.stderr
    assert "'__version__', 'main', 'record_gemm_shapes'" in out.stdout
    import agent
    from agent.cli import main

    assert agent.main is main and callable(agent.record_gemm_shapes)
