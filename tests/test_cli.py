"""The command line: every verb, and bad input as one line with exit code 2 and nothing written."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import main
from agent.store import RunStore
from tests.conftest import HAS_GPU
from tests.helpers import populated_run, sometimes_wrong

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["run", "--mnk", "64_64", "--compile-only"], "malformed shape '64_64'"),
    (["run", "--mnk", "0_64_64", "--compile-only"], "positive"),
    (["run", "--mnk", "-1_64_64", "--compile-only"], "malformed"),
    (["run", "--mnk", "a_b_c", "--compile-only"], "malformed shape 'a_b_c'"),
    (["run", "--mnk", "64_60_64", "--compile-only"], "multiples of 8"),
    (["run", "--mnk", "64_64_64", "--b-layout", "tn", "--compile-only"], "invalid choice: 'tn'"),
    (["run", "--mnk", "64_64_64", "--dtype", "fp32", "--compile-only"], "invalid choice: 'fp32'"),
    (["run", "--mnk", "64_64_64:nk:fp8", "--compile-only"], "unknown dtype 'fp8'"),
    (["run", "--compile-only"], "give the shapes"),
    (["run", "--mnk", "64_64_64", "--budget-minutes", "0", "--compile-only"], "--budget-minutes: Input should be"),
    (["run", "--mnk", "64_64_64", "--budget-minutes", "x"], "invalid float value"),
    (["run", "--mnk", "64_64_64", "--budget-minutes", "inf", "--compile-only"], "finite"),
    (["run", "--mnk", "99999999999999999999_8_8", "--compile-only"], "32-bit"),
    (["run", "--mnk", "65536_65536_8", "--compile-only"], "32-bit"),
    (["run", "--mnk", "512-1_4096_4096:nk", "--compile-only"], "the M range 512-1 is empty (reversed)"),
    (["run", "--mnk", "0-512_4096_4096:nk", "--compile-only"], "M must be positive"),
    (["run", "--mnk", "0-0_64_64", "--compile-only"], "positive"),
    (["run", "--mnk", "1-_64_64", "--compile-only"], "malformed"),
    (["run", "--mnk", "-512_64_64", "--compile-only"], "malformed"),
    (["run", "--mnk", "1-2-3_64_64", "--compile-only"], "malformed"),
    (["run", "--mnk", "1-600000_4096_4096:nk", "--compile-only"], "32-bit"),
    (["run", "--mnk", "1-99999999999999999999_8_8", "--compile-only"], "32-bit"),
    (["run", "--resume", "nope"], "no run 'nope'"),
    (["show", "nope"], "no run 'nope'"),
    (["export", "../etc"], "bad run id"),
    (["frobnicate"], "invalid choice"),
    (["run", "--mnk", "64_64_64", "--gpus", "0,x"], "distinct GPU indices like 0,1 - got '0,x'"),
    (["run", "--mnk", "64_64_64", "--gpus", "1,1"], "distinct GPU indices"),
    (["run", "--mnk", "64_64_64", "--gpus", "0", "--cluster", "tcp://127.0.0.1:1"], "give one of them"),
    (["run", "--mnk", "64_64_64", "--compile-only", "--gpus", "all"], "--compile-only uses no GPU"),
    (["run", "--mnk", "64_64_64", "--cluster", "127.0.0.1"], "missing port number"),
    (["run", "--mnk", "64_64_64", "--cluster", "tcp://127.0.0.1:1"], "cannot reach the Dask scheduler"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr("sandbox.cluster.CONNECT_TIMEOUT_S", 0.5)
    code, out, err = run_cli(capsys, *argv, "--runs-dir", tmp_path / "runs")
    assert code == 2
    assert message in err and err.count("\n") == 1 and err.startswith("error: ")
    assert not (tmp_path / "runs").exists()


def test_runs_dir_naming_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    for argv in (["run", "--mnk", "64_64_64", "--compile-only"], ["runs"], ["show", "x"]):
        code, _, err = run_cli(capsys, *argv, "--runs-dir", tmp_path / "afile")
        assert code == 2 and "is a file, not a folder" in err and err.count("\n") == 1
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("proposer", ["llm", "mixed"])
def test_llm_proposer_without_an_endpoint_stops_at_once(tmp_path, capsys, monkeypatch, proposer):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = run_cli(capsys, "run", "--mnk", "64_64_64", "--compile-only", "--proposer", proposer,
                           "--runs-dir", tmp_path / "runs")
    assert code == 2 and "OPENAI_API_KEY" in err and "OPENAI_BASE_URL" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_compile_only_runs_say_nothing_was_checked(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "run", "--mnk", "64_64_64", "--compile-only", "--max-candidates", "2",
                           "--runs-dir", tmp_path / "runs")
    assert code == 0 and "nothing was checked" in out and "export" not in out.splitlines()[-1]
    assert "no candidate passed" not in out
    run = next((tmp_path / "runs").iterdir()).name
    code, out, _ = run_cli(capsys, "runs", "--runs-dir", tmp_path / "runs")
    assert "compile only: 2 compiled" in out
    code, out, _ = run_cli(capsys, "show", run, "--runs-dir", tmp_path / "runs")
    assert "nothing was checked or timed" in out
    code, _, err = run_cli(capsys, "export", run, "--runs-dir", tmp_path / "runs")
    assert code == 2 and "compile-only" in err and not (tmp_path / "runs" / run / "export").exists()
    code, _, err = run_cli(capsys, "diff", run, "baseline", "best", "--runs-dir", tmp_path / "runs")
    assert code == 2 and "compile-only" in err


def test_piped_progress_is_whole_lines(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "run", "--mnk", "64_64_64,128_128_128", "--compile-only", "--max-candidates", "2",
                           "--runs-dir", tmp_path / "runs")
    lines = out.splitlines()
    assert code == 0 and sum("compile only" in line and ":kn:f16:" in line for line in lines) == 4
    progress = [line for line in lines if ":kn:f16: " in line]
    assert progress and all(line.rstrip().endswith("compile only") for line in progress)
    titles = [line.strip() for line in lines if "(done, arch" in line]
    assert len(titles) == 1 and titles[0].startswith("run ")  # the summary's title on a line of its own


def test_a_problem_too_big_for_the_gpu_is_refused():
    from agent.runner import too_big
    from core.device import DeviceFacts
    from core.records import Problem

    small_gpu = DeviceFacts.from_dict({"name": "Small GPU", "memory_bytes": 8 * 2**30})
    assert too_big([Problem(64, 64, 64)], small_gpu) is None
    why = too_big([Problem(64, 64, 64), Problem(16384, 16384, 16384)], small_gpu)
    assert "16384_16384_16384" in why and "Small GPU has 8 GiB" in why


def test_shapes_file_junk_line(tmp_path, capsys):
    f = tmp_path / "shapes.txt"
    f.write_text("64_64_64\nbogus line\n")
    code, _, err = run_cli(capsys, "run", "--shapes", f, "--compile-only", "--runs-dir", tmp_path / "runs")
    assert code == 2 and "shapes.txt:2:" in err and not (tmp_path / "runs").exists()


def test_dtype_and_bias_apply_to_plain_shapes_only(tmp_path, capsys):
    from agent.store import RunStore
    from core.records import Problem

    f = tmp_path / "shapes.txt"
    f.write_text("64_64_64\n64_128_64:nk:f16\n")
    runs = tmp_path / "runs"
    code, _, _ = run_cli(capsys, "run", "--shapes", f, "--dtype", "bf16", "--bias", "--compile-only",
                         "--max-candidates", "1", "--no-profile", "--runs-dir", runs)
    assert code == 0
    (folder,) = runs.iterdir()
    assert RunStore(folder).problems() == [Problem(64, 64, 64, "kn", "bf16", True), Problem(64, 128, 64, "nk")]


def test_folder_that_is_not_ours(tmp_path, capsys):
    (tmp_path / "runs" / "x").mkdir(parents=True)
    code, _, err = run_cli(capsys, "show", "x", "--runs-dir", tmp_path / "runs")
    assert code == 2 and "not a run folder" in err
    (tmp_path / "runs" / "x" / "run.sqlite").write_bytes(b"garbage that is not sqlite" * 100)
    code, _, err = run_cli(capsys, "show", "x", "--runs-dir", tmp_path / "runs")
    assert code == 2 and ("corrupt" in err or "not a run store" in err)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message")
def test_server_bench_without_gpu_says_so_and_writes_nothing(tmp_path, capsys):
    store = populated_run(tmp_path / "runs" / "r1")
    store.close()
    code, _, err = run_cli(capsys, "bench", "r1", "--mode", "server", "--runs-dir", tmp_path / "runs")
    assert code == 2 and "no usable GPU" in err and err.count("\n") == 1
    written = {p.name for p in (tmp_path / "runs" / "r1").iterdir()} - {"run.sqlite-wal", "run.sqlite-shm"}
    assert written == {"run.sqlite"}  # no export, no report


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message")
@pytest.mark.parametrize("gpus", [[], ["--gpus", "all"], ["--gpus", "0,1"]])
def test_run_without_gpu_says_so_and_writes_nothing(tmp_path, capsys, gpus):
    code, _, err = run_cli(capsys, "run", "--mnk", "64_64_64", *gpus, "--runs-dir", tmp_path / "runs")
    assert code == 2 and "no usable GPU" in err and "--compile-only" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_a_range_in_a_shapes_file_with_bad_input_writes_nothing(tmp_path, capsys):
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("1-64_4096_4096:nk\n300-200_4096_4096:nk:bf16\n")
    code, _, err = run_cli(capsys, "run", "--shapes", shapes, "--compile-only", "--runs-dir", tmp_path / "runs")
    assert code == 2 and "shapes.txt:2:" in err and "reversed" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_compile_only_run_then_runs_show_diff(tmp_path, capsys):
    runs = tmp_path / "runs"
    code, out, _ = run_cli(capsys, "run", "--mnk", "128_256_64,1000_3000_2000", "--b-layout", "nk",
                           "--compile-only", "--arch", "sm_80", "--max-candidates", "2", "--runs-dir", runs)
    assert code == 0
    (run_id,) = [p.name for p in runs.iterdir()]
    code, out, _ = run_cli(capsys, "runs", "--runs-dir", runs)
    assert code == 0 and run_id in out
    code, out, _ = run_cli(capsys, "show", run_id, "--runs-dir", runs)
    assert code == 0 and "1000_3000_2000" in out and "sm_80" in out
    code, out, _ = run_cli(capsys, "diff", run_id, "baseline", "baseline", "--shape", "128_256_64",
                           "--runs-dir", runs)
    assert code == 0 and "sources identical" in out


def test_show_diff_export_on_a_measured_run(tmp_path, capsys):
    store = populated_run(tmp_path / "runs" / "r1", evaluate=sometimes_wrong())
    runs = tmp_path / "runs"
    code, out, _ = run_cli(capsys, "show", "r1", "--runs-dir", runs)
    assert code == 0 and "wrong" in out
    first, second = [c.id for c in store.candidates(store.problems()[0])][:2]
    code, out, _ = run_cli(capsys, "diff", "r1", first, second[:6], "--runs-dir", runs)
    assert code == 0 and "@@" in out and "block" in out
    code, _, err = run_cli(capsys, "diff", "r1", "best", "baseline", "--runs-dir", runs)
    assert code == 2 and "needs one shape" in err
    code, out, _ = run_cli(capsys, "export", "r1", "--out", tmp_path / "exp", "--runs-dir", runs)
    assert code == 0
    exp = tmp_path / "exp"
    assert (exp / "hgemm_ops.py").is_file() and (exp / "manifest.json").is_file()
    assert (exp / "hgemm_1000_3000_2000_kn_f16.cu").read_text().startswith("// hgemm-agent export")
    assert "64_64_64:nk" in out and "cuBLAS" in out  # the fake timings lose to cuBLAS there


@pytest.mark.parametrize("argv, message", [
    (["bench", "--mode", "server"], "exactly one RUN"),
    (["bench"], "nothing to bench"),
    (["bench", "--target-qps", "0", "--mode", "server"], "must be positive"),
    (["bench", "nope"], "no run 'nope'"),
])
def test_bench_bad_input(tmp_path, capsys, argv, message):
    code, _, err = run_cli(capsys, *argv, "--runs-dir", tmp_path / "runs")
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message")
def test_bench_without_gpu_says_so(tmp_path, capsys):
    populated_run(tmp_path / "runs" / "r1")
    code, _, err = run_cli(capsys, "bench", "r1", "--runs-dir", tmp_path / "runs")
    assert code == 2 and "no usable GPU" in err and "--compile-only" not in err  # bench has no such option


# what a newcomer hits first: bad folders, Ctrl-C, --version, --help, resuming with other options

@pytest.mark.parametrize("runs_dir, message", [
    ("/proc/x", "cannot create folders in /proc"),
    ("/sys/x", "cannot create folders in /sys"),
    ("/dev/null/x", "/dev/null is not a folder"),
    ("AFILE", "is a file, not a folder"),
    ("AFILE/x", "is not a folder"),
])
def test_an_unusable_runs_dir_is_one_line_and_exit_2(tmp_path, capsys, runs_dir, message):
    (tmp_path / "afile").write_text("x")
    runs_dir = runs_dir.replace("AFILE", str(tmp_path / "afile"))
    for verb in (["run", "--mnk", "64_64_64", "--compile-only"], ["bench", "--shapes", tmp_path / "afile"]):
        code, out, err = run_cli(capsys, *verb, "--runs-dir", runs_dir)
        assert code == 2 and message in err and err.count("\n") == 1 and err.startswith("error: --runs-dir")
    assert (tmp_path / "afile").read_text() == "x"


def test_a_runs_dir_that_cannot_be_written_is_refused_before_anything(tmp_path, capsys, monkeypatch):
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkdtemp", read_only)
    code, _, err = run_cli(capsys, "run", "--mnk", "64_64_64", "--compile-only", "--runs-dir", tmp_path / "runs")
    assert code == 2 and f"cannot create folders in {tmp_path} (Permission denied)" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_before_the_run_folder_exists_is_exit_130_without_a_traceback(tmp_path, capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr("agent.runner.nvrtc_version", interrupted)
    code, out, err = run_cli(capsys, "run", "--mnk", "64_64_64", "--compile-only", "--runs-dir", tmp_path / "runs")
    assert code == 130 and err == "interrupted\n" and not (tmp_path / "runs").exists()


def test_ctrl_c_mid_run_says_how_to_resume_with_the_runs_dir(tmp_path, capsys, monkeypatch):
    from agent.loop import SearchLoop

    def interrupted(self, problems):
        raise KeyboardInterrupt

    monkeypatch.setattr(SearchLoop, "run", interrupted)
    runs = tmp_path / "my runs"
    code, out, _ = run_cli(capsys, "run", "--mnk", "64_64_64", "--compile-only", "--runs-dir", runs)
    (folder,) = runs.iterdir()
    assert code == 130 and f"python -m agent run --resume {folder.name} --runs-dir '{runs}' continues it" in out
    assert RunStore(folder).get_meta("state") == "interrupted"


def _as_from_a_shell() -> None:
    """In the child before it runs Python: SIGINT as a shell leaves it, not ignored (a pytest-xdist worker's children
    inherit its ignored SIGINT, and Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("after", ["rich.console", "agent.cli"])
def test_ctrl_c_while_starting_up_is_exit_130_without_a_traceback(tmp_path, after):
    """A real SIGINT to `python -m agent` once Python has imported `after` (inside the command line's imports, or
    just past them), told by -X importtime's lines."""
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "agent", "run", "--mnk", "64_64_64",
                             "--compile-only", "--runs-dir", str(tmp_path / "runs")], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_shell)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.rstrip().endswith(f"| {after}") or line.rstrip().endswith(f"|   {after}"):
            proc.send_signal(signal.SIGINT)
            break
    lines += proc.stderr.readlines()
    proc.wait(timeout=120)
    said = [line for line in lines if not line.startswith("import time:")]
    assert proc.returncode == 130 and said == ["interrupted\n"], said
    assert not any((tmp_path / "runs").glob("*/run.sqlite"))


def test_version_and_help_with_defaults(capsys):
    import agent

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"hgemm-agent {agent.__version__}\n"
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in (("--budget-minutes", "default 5;"), ("--max-candidates", "default 16)"),
                            ("--kernel-timeout", "default 5)"), ("--seed", "default 0)"),
                            ("--proposer", "default builtin)"), ("--runs-dir", "default runs)"),
                            ("--llm-max-calls", "default 20)"), ("--dtype", "default fp16;")):
        assert default in text.split(option + " ", 2)[-1].split(" --")[0], option
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "server mode: mean calls per second (default 200.0)" in text


@pytest.mark.parametrize("argv, message", [
    (["--max-candidates", "0"], "--max-candidates: Input should be greater than or equal to 1"),
    (["--kernel-timeout", "-1"], "--kernel-timeout: Input should be greater than 0"),
    (["--llm-max-calls", "-1"], "--llm-max-calls: Input should be greater than or equal to 0"),
    (["--llm-base-url", "notaurl"], "--llm-base-url (or OPENAI_BASE_URL): expected an http:// or https:// URL"),
    (["--llm-base-url", "ftp://x", "--proposer", "llm"], "got 'ftp://x'"),
    (["--llm-base-url", "http://host:port/v1"], "not a usable URL"),
    (["--profile", "--no-profile"], "not allowed with argument"),
])
def test_bad_values_are_named_by_their_options(tmp_path, capsys, argv, message):
    code, _, err = run_cli(capsys, "run", "--mnk", "64_64_64", "--compile-only", *argv, "--runs-dir", tmp_path / "r")
    assert code == 2 and message in err and err.count("\n") == 1 and not (tmp_path / "r").exists()


def test_resume_refuses_what_contradicts_the_run_and_keeps_its_settings(tmp_path, capsys):
    runs = tmp_path / "runs"
    code, _, _ = run_cli(capsys, "run", "--mnk", "64_64_64", "--compile-only", "--max-candidates", "2", "--seed", "3",
                         "--runs-dir", runs)
    (folder,) = runs.iterdir()
    run = folder.name
    for argv, message in ((["--proposer", "mixed"], "started with --proposer builtin: --resume keeps it"),
                          (["--arch", "sm_80"], "started with --arch sm_90a"),
                          (["--seed", "4"], "started with --seed 3"),
                          (["--dtype", "bf16"], "continues the run's own shapes: drop --dtype"),
                          (["--b-layout", "nk", "--bias"], "drop --b-layout, --bias"),
                          (["--epilogue", "relu"], "drop --epilogue"),
                          (["--mnk", "8_8_8"], "drop --mnk")):
        code, _, err = run_cli(capsys, "run", "--resume", run, *argv, "--runs-dir", runs)
        assert code == 2 and message in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "run", "--resume", run, "--runs-dir", runs)  # no GPU here: it stays compile-only
    assert code == 0, err
    code, out, _ = run_cli(capsys, "run", "--resume", run, "--compile-only", "--seed", "3", "--runs-dir", runs)
    assert code == 0 and "for another 5 minutes, its own budget" in out and "new budget" not in out
    assert len(RunStore(folder).candidates()) == 2  # its own --max-candidates 2, not the default 16
    code, out, _ = run_cli(capsys, "run", "--resume", run, "--budget-minutes", "0.5", "--max-candidates", "3",
                           "--runs-dir", runs)
    assert code == 0 and "continuing it with the new budget (0.5 minutes)" in out
    assert len(RunStore(folder).candidates()) == 3 and RunStore(folder).get_meta("config")["seed"] == 3


def test_a_compile_only_run_names_the_h200_only_as_a_stand_in(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "run", "--mnk", "64_64_64", "--compile-only", "--max-candidates", "1",
                           "--runs-dir", tmp_path / "runs")
    lines = [line for line in out.splitlines() if "H200" in line]
    assert code == 0 and lines and all("stand-in" in line for line in lines)


def test_show_lists_the_candidate_ids_diff_takes(tmp_path, capsys):
    store = populated_run(tmp_path / "runs" / "r1", n=6)
    code, out, _ = run_cli(capsys, "show", "r1", "--runs-dir", tmp_path / "runs")
    for p in store.problems():
        leaders = [c.id for c, _ in store.leaders(p)]
        assert all(cid in out for cid in leaders[:3]) and not any(cid in out for cid in leaders[4:])
    first, second = [c.id for c, _ in store.leaders(store.problems()[0])][:2]
    code, out, _ = run_cli(capsys, "diff", "r1", first, second, "--runs-dir", tmp_path / "runs")
    assert code == 0 and "rendered sources" in out


def test_the_runner_does_not_import_the_report():
    out = subprocess.run([sys.executable, "-c", "import sys, agent.runner; print('agent.report' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_db_on_an_empty_database_says_it_is_empty(tmp_path, capsys):
    from agent.tuning_db import TuningDB

    TuningDB(tmp_path / "t.sqlite").close()
    code, out, _ = run_cli(capsys, "db", "--db", tmp_path / "t.sqlite")
    assert code == 0 and f"tuning database {tmp_path / 't.sqlite'} is empty" in " ".join(out.split())


def test_bench_refuses_a_range_and_names_what_to_give(tmp_path, capsys):
    shapes = tmp_path / "bench.txt"
    shapes.write_text("5_4096_4096:nk\n1-256_4096_4096:nk\n")
    code, _, err = run_cli(capsys, "bench", "--shapes", shapes, "--runs-dir", tmp_path / "runs")
    assert code == 2 and "not the range 1-256_4096_4096" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()
