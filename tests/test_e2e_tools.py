"""tools/e2e_llama.py and tools/host_overhead.py on the CPU: they import, refuse to time without a GPU, and the
end-to-end tool records a (small) Llama's prefill and decode GEMMs where transformers is installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from agent.shapes import read_shapes_file
from core.records import Problem
from tests.conftest import HAS_GPU

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", TOOLS / f"{name}.py")
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU refusal")
def test_tools_import_and_refuse_to_time_without_a_gpu(tmp_path, capsys):
    assert load_tool("host_overhead").main([str(tmp_path)]) == 2
    assert load_tool("e2e_llama").main(["--tiny", "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_e2e_records_prefill_and_decode_shapes(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.delenv("OUT", raising=False)
    e2e = load_tool("e2e_llama")
    assert e2e.main(["--record-only", "--tiny", "--device", "cpu", "--layers", "2", "--prefill-tokens", "32",
                     "--decode-batches", "1,4", "--context", "8", "--work", str(tmp_path)]) == 0
    decode4 = read_shapes_file(tmp_path / "shapes_decode4.txt")
    hidden, inter, kv, vocab = 256, 512, 64, 1024  # the tiny config: 8 heads of 32, 2 KV heads
    assert set(decode4) == {Problem(4, hidden, hidden, "nk"), Problem(4, kv, hidden, "nk"),
                            Problem(4, inter, hidden, "nk"), Problem(4, hidden, inter, "nk"),
                            Problem(4, vocab, hidden, "nk")}  # q/o, k/v, gate/up, down, lm_head (last position)
    assert Problem(32, inter, hidden, "nk") in read_shapes_file(tmp_path / "shapes_prefill.txt")
    union = read_shapes_file(tmp_path / "shapes_all.txt")
    assert len(union) == len(set(union)) and set(decode4) <= set(union)
