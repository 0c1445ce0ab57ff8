"""tools/arch_probe.py: a fused model is compared with its stock self and put back, and a wrong fusion, a model that
unfuse does not restore or an architecture that hangs is reported as such."""

from __future__ import annotations

import collections
import os
import time
import types

import pytest
import torch

from agent.export.runtime import hgemm_fuse
from tests.test_e2e_tools import load_tool
from tests.test_fuse import Model

probe = load_tool("arch_probe")


def tiny():
    torch.manual_seed(0)
    model, ids = Model().eval(), torch.randint(50, (2, 9))

    def run(m):
        with torch.no_grad():
            return m(ids)
    return model, run


def test_a_llama_like_model_fuses_matches_and_comes_back():
    model, run = tiny()
    stock = run(model)
    record = probe.check(model, run)
    assert record["status"] == "ok" and record["restored"], record
    assert {"qkv", "gate_up", "o_residual", "down_residual", "rms_norm"} <= set(record["fused"])
    assert record["error"] < 1e-6
    assert torch.equal(run(model), stock) and not hgemm_fuse.describe(model)  # put back


class ResidualTwice(probe.TorchOps):
    """A fusion that adds the residual twice."""

    @classmethod
    def fused_linear(cls, x, w, bias, epilogue, residual):
        out = super().fused_linear(x, w, bias, epilogue, residual)
        return out + residual if epilogue == "residual" else out


def test_a_wrong_fusion_is_reported():
    model, run = tiny()
    record = probe.check(model, run, ops=ResidualTwice)
    assert record["status"] == "WRONG" and "logits off" in record["why"] and record["restored"]


def test_a_model_unfuse_does_not_restore_is_reported(monkeypatch):
    model, run = tiny()
    real_unfuse = hgemm_fuse.unfuse

    def unfuse_and_nudge(m):
        n = real_unfuse(m)
        with torch.no_grad():
            m.lm_head.weight[0, 0] += 1e-3
        return n
    monkeypatch.setattr(hgemm_fuse, "unfuse", unfuse_and_nudge)
    record = probe.check(model, run)
    assert record["status"] == "WRONG" and record["why"] == "unfuse did not restore the model bit for bit"


def test_an_architecture_that_hangs_is_skipped(monkeypatch):
    monkeypatch.setattr(probe, "probe", lambda model_type, tolerance, run, **_: time.sleep(30))
    t0 = time.time()
    record = probe.isolated("llama", timeout_s=1)
    assert record["status"] == "skipped" and record["why"] == "took over 1 s" and time.time() - t0 < 10


def test_an_architecture_that_crashes_the_interpreter_is_skipped(monkeypatch):
    monkeypatch.setattr(probe, "probe", lambda model_type, tolerance, run, **_: os._exit(3))
    record = probe.isolated("llama", timeout_s=20)
    assert record["status"] == "skipped" and record["why"] == "the process died (3)"


def test_cli_refuses_an_unknown_architecture_and_a_bad_limit(capsys, tmp_path):
    pytest.importorskip("transformers")
    assert probe.main(["--archs", "llama,not_a_model", "--json", str(tmp_path / "p.json")]) == 2
    assert probe.main(["--archs", "llama", "--timeout", "0", "--json", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "not_a_model" in err and "must be positive" in err and not (tmp_path / "p.json").exists()


def test_hugging_face_llama_and_gemma2_tiny():
    pytest.importorskip("transformers")
    llama, gemma2 = probe.probe("llama"), probe.probe("gemma2")
    assert llama["status"] == "ok" and llama["fused"]["o_residual"] == 2, llama  # two layers
    # Gemma2's norms after the attention and the MLP: q/k/v and gate/up only, never the residual adds
    assert gemma2["status"] == "ok" and "o_residual" not in gemma2["fused"] and gemma2["fused"]["qkv"] == 2, gemma2


def test_cached_logits_run_a_prefill_then_one_step_for_each_of_the_last_two_tokens():
    calls = []

    class Cached(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=False):
            calls.append((input_ids.tolist(), past_key_values, use_cache))
            return types.SimpleNamespace(logits=input_ids[..., None].float(), past_key_values=len(calls))

    ids = torch.arange(6)[None]
    out = probe.cached_logits(Cached(), ids)
    assert calls == [([[0, 1, 2, 3]], None, True), ([[4]], 1, True), ([[5]], 2, True)]
    assert torch.equal(out, ids[..., None].float())


def test_compiled_logits_trace_the_model_whole_and_a_graph_break_fails_the_run():
    out = collections.namedtuple("Out", "logits")

    class Plain(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            return out(input_ids[..., None].float() * 2)

    class Breaks(Plain):
        def forward(self, input_ids, use_cache=False):
            torch._dynamo.graph_break()
            return super().forward(input_ids, use_cache)

    ids = torch.arange(6)[None]
    assert torch.equal(probe.compiled_logits(Plain(), ids), ids[..., None].float() * 2)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        probe.compiled_logits(Breaks(), ids)


def test_an_export_patches_and_half_precision_is_held_to_the_stock_models_own_rounding(tmp_path, op_build_dir):
    from tests.export_fixtures import load_ops, small_export

    ops = load_ops(small_export(tmp_path / "out", ["18_64_96:nk:f16:residual"]))
    model, run = tiny()
    reference = run(model).float()
    model.half()
    record = probe.check(model, run, ops, reference=reference)
    assert record["status"] == "ok" and record["restored"], record
    assert {"qkv", "gate_up", "o_residual", "down_residual", "rms_norm"} <= set(record["fused"])
    assert 0 < record["own"] < 1e-2 and record["error"] <= 2 * record["own"] + probe.TOLERANCE
    assert not ops.explain_model(model)  # unpatched
    wrong = probe.check(model, run, ResidualTwice, reference=reference)
    assert wrong["status"] == "WRONG" and "own rounding" in wrong["why"], wrong


def test_cli_refuses_a_folder_that_is_not_an_export_and_a_missing_gpu(capsys, tmp_path):
    pytest.importorskip("transformers")
    assert probe.main(["--archs", "llama", "--export", str(tmp_path)]) == 2
    assert "not an export" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert probe.main(["--archs", "llama", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_an_export_given_by_its_folder_is_loaded_in_a_spawned_child(tmp_path, op_build_dir):
    """The path --device cuda takes (a forked child cannot use CUDA once the parent has), run on the CPU: the child
    is spawned, loads the export from its folder and patches with its op."""
    pytest.importorskip("transformers")
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.export_fixtures import small_export

    folder = small_export(tmp_path / "out", ["18_64_96:nk:bf16"])
    script = ("import json, multiprocessing as mp, sys; from pathlib import Path; sys.path.insert(0, 'tools'); "
              "import arch_probe; used = []; get = mp.get_context; "
              "mp.get_context = lambda method=None: used.append(method) or get(method); "
              f"record = arch_probe.isolated('llama', timeout_s=300, export=Path({str(folder)!r}), device='cpu', "
              "dtype='bf16'); print(json.dumps({**record, 'started': used}))")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(probe.__file__).parents[1], capture_output=True,
                          text=True, timeout=400)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["started"] == ["spawn"], record
    assert record["status"] == "ok" and record["restored"], record
    assert {"qkv", "gate_up", "rms_norm"} <= set(record["fused"]), record


def test_cached_logits_pass_the_cache_under_the_name_the_forward_takes():
    calls = []

    class Cached(torch.nn.Module):  # transformers 5's later name: `cache`, in and out
        def forward(self, input_ids, cache=None, use_cache=False):
            calls.append(cache)
            return types.SimpleNamespace(logits=input_ids[..., None].float(), cache=len(calls))

    probe.cached_logits(Cached(), torch.arange(5)[None])
    assert calls == [None, 1, 2]


def test_gemma4_and_deepseek_v3_build_tiny_and_fuse_correctly():
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type in ("gemma4_text", "deepseek_v3"):
        if model_type not in CONFIG_MAPPING:
            continue
        record = probe.probe(model_type)
        assert record["status"] == "ok" and record["restored"], record
    if "gemma4_text" not in CONFIG_MAPPING:
        return
    ids = torch.randint(200, (1, 9), generator=torch.Generator().manual_seed(1))
    variants = [{"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
                {"attention_k_eq_v": True}, {"use_double_wide_mlp": True}, {"hidden_size_per_layer_input": 0}]
    for overrides in variants:  # Gemma 4's other models: an MoE block beside the MLP, k = v, no per-layer inputs
        model = probe.tiny_model("gemma4_text", overrides=overrides)
        for run in (probe.logits, probe.cached_logits):
            record = probe.check(model, lambda m, run=run: run(m, ids))
            assert record["status"] == "ok" and record["restored"], (overrides, record)
            assert record["fused"]["gate_up"] == 2, (overrides, record)
