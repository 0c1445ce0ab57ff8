"""tools/sweep.py on the CPU: its arguments, the settings it expands to, its table from given results, and a whole
sweep whose compile step is a real sm_90a build through compile_cuda (its cache) with the GPU worker stood in for."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from core.records import BuildResult, EvalJob, EvalResult, Problem, Status, Timing
from sandbox.build import compile_cuda
from templates import get_family
from templates.sm90_wgmma.params import Sm90WgmmaParams, with_update

_spec = importlib.util.spec_from_file_location("sweep", Path(__file__).parents[1] / "tools" / "sweep.py")
sweep = sys.modules["sweep"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(sweep)

SM90 = get_family("sm90_wgmma")
SMALL = {"block_m": 64, "block_n": 128, "consumers": 1}
SERIALIZED = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
              "to the presence of Extern calls in the function 'hgemm'.")


def test_arguments(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("# dev shapes\n512_512_128:nk  # one\n1024_1024_1024\n")
    args = sweep.parse_args(["--shapes", "1024_1024_1024,16_4096_4096:both", "--shapes-file", str(shapes),
                             "--b-layout", "kn", "--top", "2", "--params", json.dumps(SMALL),
                             "--update", '{"epilogue": "tma"}', "--update", '{"loader": "cp_async"}'])
    assert [p.key for p in args.problems] == ["1024_1024_1024:kn:f16", "16_4096_4096:kn:f16", "16_4096_4096:nk:f16",
                                              "512_512_128:nk:f16"]  # the file's repeat of a shape is dropped
    assert args.family is SM90 and args.top == 2 and args.params == [SMALL]
    assert args.update == [{"epilogue": "tma"}, {"loader": "cp_async"}]
    assert args.json is None and args.template_text is None
    monkeypatch.setenv("OUT", str(tmp_path))
    args = sweep.parse_args(["--shapes", "64_64_64", "--b-layout", "nk", "--family", "sm80_mma"])
    assert args.json == tmp_path / "sweep.json" and args.problems == [Problem(64, 64, 64, "nk")]


def test_a_settings_file_adds_each_shapes_own_settings(tmp_path):
    own = tmp_path / "orders.json"
    own.write_text(json.dumps({"657_9984_3144:nk": [SMALL], "64_64_64:kn": [SMALL, {"block_n": 100}]}))
    args = sweep.parse_args(["--shapes", "64_64_64", "--top", "1", "--settings", str(own)])
    assert args.problems == [Problem(64, 64, 64), Problem(657, 9984, 3144, "nk")]  # the file's shapes swept too
    rows = sweep.expand(SM90, Problem(64, 64, 64), 1, [], [], sweep.H200, None, args.own[Problem(64, 64, 64)])
    assert [r.label for r in rows] == ["#0", "s1", "s2"] and rows[2].params is None  # block_n 100: invalid
    assert sweep.parse_args(["--settings", str(own)]).problems == list(args.own)  # no --shapes needed


@pytest.mark.parametrize("text", ["[1]", '{"64_64_64": {"block_m": 64}}', '{"64_64_64": [1]}', '{"64_64_6x": []}',
                                  "{"])
def test_a_bad_settings_file_exits_2(tmp_path, text, capsys):
    own = tmp_path / "orders.json"
    own.write_text(text)
    with pytest.raises(SystemExit) as e:
        sweep.parse_args(["--settings", str(own)])
    assert e.value.code == 2 and "error" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--shapes", "64_64_64:xy"], ["--shapes", "64_64_60"],
                                  ["--shapes", "64_64_64", "--update", "{epilogue: tma}"],
                                  ["--shapes", "64_64_64", "--params", "[1]"],
                                  ["--shapes", "64_64_64", "--family", "nope"],
                                  ["--shapes", "64_64_64", "--template", "/nonexistent.cu.j2"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.parse_args(argv)
    assert e.value.code == 2 and "error" in capsys.readouterr().err


def test_settings_expansion():
    problem = Problem(1024, 1024, 1024)
    space = SM90.space(problem)
    rows = sweep.expand(SM90, problem, 2, [SMALL, {"block_n": 100}], [{"epilogue": "tma"}, {"loader": "tma"}],
                        sweep.H200, None)
    # loader=tma is what these settings have already: those rows would repeat their setting and are dropped
    assert [r.label for r in rows] == ["#0", "#0+u1", "#1", "#1+u1", "p1", "p1+u1", "p2"]
    assert rows[0].params == space[0] and rows[2].params == space[1]
    assert rows[1].params == {**space[0], "epilogue": "tma"}
    assert rows[4].params == SM90.parse(SMALL, problem).model_dump() and rows[4].params["stages"] == 4
    assert rows[6].params is None and rows[6].result.status is Status.INVALID and "block_n" in rows[6].result.reason
    assert len({r.candidate_id for r in rows[:6]}) == 6
    other = sweep.expand(SM90, problem, 1, [], [], sweep.H200, "// another template")
    assert other[0].params == rows[0].params and other[0].candidate_id != rows[0].candidate_id


def test_update_refits_the_ring_like_the_family():
    """A persistent TMA-store epilogue stages C beside the ring: a 4-stage 128x256 ring no longer fits, 3 do."""
    problem = Problem(4096, 4096, 4096)
    base = SM90.parse({"block_m": 128, "block_n": 256, "consumers": 2, "stages": 4}, problem).model_dump()
    update = {"persistent": True, "epilogue": "tma"}
    params, why = sweep.fit(SM90, problem, base, update)
    assert params == with_update(Sm90WgmmaParams(**base), update).model_dump() and params["stages"] == 3 and not why
    params, why = sweep.fit(SM90, problem, base, {**update, "stages": 4})  # an explicit depth is kept, or refused
    assert params is None and "shared memory" in why
    params, why = sweep.fit(SM90, problem, base, {"split_k": 3})
    assert params is None and "split_k" in why


def _timing(us: float, cupti: float | None = None) -> Timing:
    return Timing(us, us * 0.99, us * 1.01, 100, cupti)


def _row(problem: Problem, label: str, params: dict, result: EvalResult, regs: int = 168, log: str = "") -> sweep.Row:
    build = BuildResult("c", True, "sm_90a", "src", b"\x7fELF", log, registers=regs, spill_bytes=0)
    return sweep.Row(problem, label, params, "c", "src", build, result)


def test_table_and_report_from_results():
    problem = Problem(1024, 1024, 1024, "nk")
    space = SM90.space(problem)
    fast = EvalResult("a", Status.OK, warm=_timing(8.0, 7.5), cold=_timing(12.0), cublas_warm=_timing(10.0, 9.0),
                      cublas_cold=_timing(15.0))
    slow = EvalResult("b", Status.OK, warm=_timing(20.0), cold=_timing(30.0), cublas_warm=_timing(10.0),
                      cublas_cold=_timing(15.0))
    wrong = EvalResult("w", Status.WRONG, "rel err 3.1e-02 > 2 x cuBLAS's 4.0e-04 on 17_24_40")
    log = f"ptxas info    : Used 168 registers\n{SERIALIZED}\n"
    rows = [_row(problem, "#0", space[0], slow, log=log), _row(problem, "#0+u1", {**space[0], "epilogue": "tma"}, fast),
            _row(problem, "#1", space[1], wrong, regs=90),
            sweep.Row(problem, "#1+u1", None, result=EvalResult("", Status.INVALID, "no such setting"))]
    lines = [sweep.line(SM90, r) for r in rows]
    assert lines[1].split() == ["1024_1024_1024", "nk", "#0+u1", "128x64", "s8", "e=tma", "ok", "8.0", "10.0",
                                "1.250", "1.250", "1.200", "168/0"]  # CUPTI's ratio: 9.0 / 7.5
    assert lines[0].split()[-4:] == ["10.0", "0.500", "0.500", "168/0"]  # no CUPTI figure: the column left blank
    assert lines[2].split()[-2:] == ["wrong", "90/0"] and lines[3].split()[-1] == "invalid"
    assert all(len(row) == len(sweep.HEADER) for row in lines)
    report = sweep.report(rows, SM90, [{"epilogue": "tma"}])
    assert "  1024_1024_1024:nk #1: wrong: rel err 3.1e-02 > 2 x cuBLAS's 4.0e-04 on 17_24_40" in report
    assert "  u1 does not apply to 1 settings, e.g. 1024_1024_1024:nk #1+u1: no such setting" in report
    assert f"  1024_1024_1024:nk #0: ptxas: {SERIALIZED.strip()}" in report
    assert "best 1024_1024_1024:nk: #0+u1 128x64 s8 e=tma, 1.250x cuBLAS" in report
    assert report[-1] == "4 settings: 2 ok, 1 wrong, 1 invalid"


def test_sweep_compiles_with_compile_cuda_and_evaluates_each_setting(tmp_path, capsys):
    """Two layouts of one small shape: one real sm_90a build each, into compile_cuda's cache; the stand-in worker
    gets the cubins; the second sweep finds them in the cache; another template is another build."""
    jobs: list[EvalJob] = []

    def evaluate(job: EvalJob) -> EvalResult:
        jobs.append(job)
        return EvalResult(job.candidate_id, Status.OK if len(jobs) == 1 else Status.WRONG, "" if len(jobs) == 1
                          else "a wrong element", warm=_timing(5.0), cold=_timing(6.0), cublas_warm=_timing(6.0),
                          cublas_cold=_timing(6.0))

    # this process's own compile thread pool now exists: the sweep's compile processes must not inherit a dead copy
    assert compile_cuda('extern "C" __global__ void k() {}', "sm_90a", cache_dir=None).ok
    cache, out = tmp_path / "cubins", tmp_path / "out" / "sweep.json"
    argv = ["--shapes", "64_64_64:both", "--top", "1", "--cache", str(cache), "--jobs", "2", "--json", str(out)]
    assert sweep.main(argv, evaluate) == 1  # the second setting came back wrong
    printed = capsys.readouterr().out
    assert "2 settings over 2 shapes, 2 built (0 from the cache)" in printed and sweep.HEADER in printed
    assert [j.problem.b_layout for j in jobs] == ["kn", "nk"] and all(j.cubin[:4] == b"\x7fELF" for j in jobs)
    assert [j.params for j in jobs] == [SM90.space(Problem(64, 64, 64, lay))[0] for lay in ("kn", "nk")]
    assert len(list(cache.glob("*.cubin"))) == 2
    saved = json.loads(out.read_text())
    assert [r["result"]["status"] for r in saved["rows"]] == ["ok", "wrong"] and saved["device"]["arch"] == "sm_90a"
    assert saved["rows"][0]["build"]["registers"] > 0 and saved["rows"][0]["params"] == jobs[0].params

    jobs.clear()
    assert sweep.main(argv[:-2] + ["--shapes", "64_64_64:kn"], evaluate) == 0  # one shape: "64_64_64:kn" overrides
    assert "1 settings over 1 shapes, 1 built (1 from the cache)" in capsys.readouterr().out
    jobs.clear()
    assert sweep.main(argv[:-2] + ["--shapes", "64_64_64:kn", "--budget-s", "0"], evaluate) == 0 and not jobs
    assert "1 settings: 1 skipped" in capsys.readouterr().out
    template = tmp_path / "broken.cu.j2"
    template.write_text("{{ nope")
    assert sweep.main(argv[:-2] + ["--shapes", "64_64_64:kn", "--template", str(template), "--compile-only"]) == 1
    assert "the template does not render" in capsys.readouterr().out
    template = tmp_path / "edited.cu.j2"
    template.write_text(SM90.template_source() + "\n// an edit that changes the source, not the kernel\n")
    jobs.clear()
    assert sweep.main(argv[:-2] + ["--shapes", "64_64_64:kn", "--template", str(template), "--compile-only"]) == 0
    assert not jobs and len(list(cache.glob("*.cubin"))) == 3
