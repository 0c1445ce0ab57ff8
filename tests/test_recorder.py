"""agent.record_gemm_shapes on small modules (CPU): what is recorded, with which layout, dtype and bias, what is
skipped and why, and that the file reads back through the shapes parser."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import agent
from agent.shapes import read_shapes_file
from core.records import Problem


class Block(nn.Module):
    """A tiny transformer-ish block: projections with and without bias, a matmul on a weight, a bmm."""

    def __init__(self, dtype=torch.float16):
        super().__init__()
        self.qkv = nn.Linear(64, 192, bias=True, dtype=dtype)
        self.out = nn.Linear(64, 64, bias=False, dtype=dtype)
        self.table = nn.Parameter(torch.randn(64, 32, dtype=dtype))  # K x N

    def forward(self, x):  # x: (batch, seq, 64)
        q, k, _ = self.qkv(x).chunk(3, dim=-1)
        scores = torch.bmm(q, k.transpose(1, 2))
        h = self.out(x) + scores.mean() * 0
        return h @ self.table, torch.matmul(h, self.out.weight.t())


def test_records_each_problem_once_with_layout_dtype_bias(tmp_path):
    model = Block()
    path = tmp_path / "shapes.txt"
    with torch.no_grad(), agent.record_gemm_shapes(path) as rec:
        for _ in range(2):
            model(torch.randn(2, 8, 64, dtype=torch.float16))
    assert dict(rec.problems) == {
        Problem(16, 192, 64, "nk", "f16", True): 2,  # leading dims (2, 8) fold into M
        Problem(16, 64, 64, "nk"): 4,  # self.out(x), and h @ out.weight.t() (B stored N x K)
        Problem(16, 32, 64, "kn"): 2,
    }
    assert rec.skipped == {"bmm/baddbmm (a B per batch)": 2}
    text = path.read_text()
    assert text.startswith("# GEMM shapes recorded") and "16_192_64:nk:f16:bias  # 2 calls" in text
    assert "skipped 2 calls: 2 bmm/baddbmm" in text
    assert read_shapes_file(path) == list(rec.problems)  # the file run --shapes reads: full lines, any defaults


def test_other_entry_points_and_skips(tmp_path):
    a = torch.randn(4, 16, dtype=torch.bfloat16)
    b = torch.randn(16, 8, dtype=torch.bfloat16)
    with agent.record_gemm_shapes(tmp_path / "s.txt") as rec:
        torch.mm(a, b)
        a.matmul(b)
        b.__rmatmul__(a)
        torch.addmm(torch.zeros(8, dtype=torch.bfloat16), a, b)
        torch.addmm(torch.zeros(4, 8, dtype=torch.bfloat16), a, b)  # a full C: not a bias
        torch.matmul(torch.randn(3, 4, 16).half(), torch.randn(3, 16, 8).half())  # batched B
        torch.matmul(a, torch.randn(16, dtype=torch.bfloat16))  # matrix-vector
        torch.matmul(a.float(), b.float())
        torch.nn.functional.linear(torch.randn(16).half(), torch.randn(8, 16).half())  # 1-D input: M = 1
        torch.matmul(torch.randn(4, 12).half(), torch.randn(12, 8).half())  # K % 8
        torch.randn(4, 4) + 1  # not a GEMM at all
    assert dict(rec.problems) == {Problem(4, 8, 16, "kn", "bf16"): 3, Problem(4, 8, 16, "kn", "bf16", True): 1,
                                  Problem(1, 8, 16, "nk"): 1}
    assert rec.skipped == {
        "addmm with a full C or scaling (not a bias vector)": 1, "matmul with a batched B": 1,
        "matrix-vector product": 1, "dtype float32 (only float16 and bfloat16 are tuned)": 1,
        "not a kernel shape (N and K must be multiples of 8 (16-byte rows), got 4_8_12)": 1}


def test_a_file_with_nothing_recorded_does_not_tell_the_user_to_run_it(tmp_path, capsys):
    from agent.cli import main

    model = nn.Linear(64, 64)  # fp32: nothing the kernels take
    with agent.record_gemm_shapes(tmp_path / "s.txt"):
        model(torch.randn(4, 64))
    text = (tmp_path / "s.txt").read_text()
    assert "0 distinct problems" in text and "skipped 1 calls: 1 dtype float32" in text
    assert "nothing to search" in text and "run --shapes" not in text
    assert main(["run", "--shapes", str(tmp_path / "s.txt"), "--compile-only", "--runs-dir", str(tmp_path / "r")]) == 2
    assert "holds no shape" in capsys.readouterr().err


def test_calls_run_unchanged_and_nothing_written_on_error(tmp_path):
    lin = nn.Linear(16, 8).half()
    x = torch.randn(3, 16).half()
    with agent.record_gemm_shapes(tmp_path / "s.txt"):
        y = lin(x)
    assert torch.equal(y, lin(x))
    try:
        with agent.record_gemm_shapes(tmp_path / "t.txt"):
            raise RuntimeError("model failed")
    except RuntimeError:
        pass
    assert not (tmp_path / "t.txt").exists()


def test_without_a_path_the_recorder_holds_the_problems_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with agent.record_gemm_shapes(None) as rec:
        torch.mm(torch.randn(4, 16).half(), torch.randn(16, 8).half())
    assert dict(rec.problems) == {Problem(4, 8, 16, "kn"): 1} and list(tmp_path.iterdir()) == []


def test_importing_the_package_does_not_import_torch():
    code = "import sys, agent, agent.cli; assert 'torch' not in sys.modules; agent.record_gemm_shapes"
    out = subprocess.run([sys.executable, "-c", code + "; print('torch' in sys.modules)"], capture_output=True,
                         text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_a_problem_seen_at_several_m_is_written_as_a_range(tmp_path):
    lin, out = nn.Linear(64, 128).half(), nn.Linear(64, 64, bias=False).half()
    path = tmp_path / "s.txt"
    with torch.no_grad(), agent.record_gemm_shapes(path) as rec:
        for m in (1, 3, 17, 100, 3):  # decode steps and a prefill of one layer
            lin(torch.randn(m, 64).half())
        out(torch.randn(5, 64).half())
    assert len(rec.problems) == 5  # one Problem per M seen; the file folds them
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]
    assert lines == ["1-100_128_64:nk:f16:bias  # 5 calls at M = 1, 3, 17, 100", "5_64_64:nk:f16  # 1 call"]
    assert read_shapes_file(path) == [Problem(51, 128, 64, "nk", "f16", True, m_range=(1, 100)),
                                      Problem(5, 64, 64, "nk")]


def test_serve_m_widens_every_recorded_range(tmp_path):
    lin, out = nn.Linear(64, 128).half(), nn.Linear(64, 64, bias=False).half()
    path = tmp_path / "s.txt"
    with torch.no_grad(), agent.record_gemm_shapes(path, serve_m=(1, 256)):
        lin(torch.randn(1000, 64).half())
        lin(torch.randn(2, 64).half())
        out(torch.randn(5, 64).half())
    text = path.read_text()
    assert "every M widened to hold 1-256" in text.splitlines()[0]
    assert [p.key for p in read_shapes_file(path)] == ["1-1000_128_64:nk:f16:bias", "1-256_64_64:nk:f16"]
    with pytest.raises(ValueError, match="1 <= lo <= hi"):
        agent.record_gemm_shapes(path, serve_m=(0, 8)).__enter__()
