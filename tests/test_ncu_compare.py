"""tools/ncu_compare.py on the CPU: bad input is refused before any ncu run, and ncu's CSV becomes one row per
kernel (its last launch)."""

from __future__ import annotations

from tests.test_e2e_tools import load_tool

# ncu --csv --page raw --print-units base: a units row without an ID, then one row per profiled launch
NCU_CSV = '''==PROF== Connected to process 1
"ID","Kernel Name","gpu__time_duration.sum","sm__cycles_elapsed.avg.per_second","launch__grid_size"
"","","nsecond","hertz",""
"0","hgemm","50,000","1,700,000,000","120"
"1","hgemm","41,700","1,690,000,000","120"
"2","nvjet_sm90_hsh_64x144_64x8_4x1_v_bz_TNT","39,200","1,663,000,000","120"
'''


def test_each_kernel_keeps_its_last_launch_in_the_table():
    tool = load_tool("ncu_compare")
    last = tool.last_launches(NCU_CSV)
    assert list(last) == ["hgemm", "nvjet_sm90_hsh_64x144_64x8_4x1_v_bz_TNT"]
    row = tool.table_row("414_2472_11744:nk", "hgemm", last["hgemm"])
    assert row.split()[2:5] == ["41.7", "1690.0", "-"]  # µs, MHz, then a metric ncu did not report
    assert row.split()[-2] == "120.0"


def test_bad_input_is_one_line_and_exit_2(capsys):
    tool = load_tool("ncu_compare")
    assert tool.main(["--shape", "414_2472_11744:nk"]) == 2  # no --params for it
    assert tool.main(["--shape", "12_8", "--params", "{}"]) == 2
    assert tool.main(["--shape", "128_128_128", "--params", '{"block_m": 100}']) == 2
    assert tool.main(["--shape", "128_128_128", "--params", "{}", "--family", "nope"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)


def test_ncu_profiles_the_sandbox_target_with_cublas_beside_ours(tmp_path, monkeypatch):
    import json
    import subprocess
    from types import SimpleNamespace

    from core.records import Problem

    tool = load_tool("ncu_compare")
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"], seen["job"] = cmd, json.loads(open(cmd[-1]).read())
        return SimpleNamespace(stdout=NCU_CSV, stderr="max |ours - cuBLAS| = 0.0156")

    monkeypatch.setattr(subprocess, "run", fake_run)
    problem = Problem(256, 512, 256, "nk", "bf16", True)
    rows = tool.profile(problem, {"block_m": 128, "block_n": 128, "consumers": 2, "stages": 4}, "sm90_wgmma",
                        tmp_path)
    assert seen["cmd"][-3:-1] == ["-m", "sandbox.profile_target"]  # one target for the search's profiles and this
    assert seen["job"]["cublas"] is True
    assert Problem(**seen["job"]["problem"]) == problem  # dtype and bias reach the target
    assert list(rows) == ["hgemm", "nvjet_sm90_hsh_64x144_64x8_4x1_v_bz_TNT"]


def test_inductor_profiles_the_compiled_model_form_between_profiler_start_and_stop(monkeypatch):
    import subprocess
    from types import SimpleNamespace

    tool = load_tool("ncu_compare")
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return SimpleNamespace(stdout=NCU_CSV.replace("hgemm", "triton_red_fused_mm_silu_0"), stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    rows = tool.profile_inductor("1_28672_4096:nk:f16:silu_mul")
    cmd = seen["cmd"]
    assert cmd[-3:] == ["--shapes", "1_28672_4096:nk:f16:silu_mul", "--ncu"] and cmd[-4].endswith("inductor_ref.py")
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:triton"
    assert cmd[cmd.index("--profile-from-start") + 1] == "off"  # the compilation's autotuning launches are not profiled
    assert "triton_red_fused_mm_silu_0" in rows
