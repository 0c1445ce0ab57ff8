"""Profiler feedback: ncu output parsed and summed up, failures as data, kept in the store, shown, and prompted.

A fake `ncu` (a script written into tmp_path, found through $HGEMM_AGENT_NCU) prints what the real one prints with
`--csv --page raw --print-units base`; the GPU test at the end profiles a real kernel under the real ncu.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
import time

import jinja2
import pytest
from rich.console import Console

from agent.config import RunConfig
from agent.loop import SearchLoop
from agent.proposers.builtin import BuiltinProposer
from agent.proposers.context import build_context
from agent.proposers.llm import PROMPTS
from agent.report import show_run
from agent.store import RunStore
from core.records import Problem, ProfileResult
from sandbox import profile as prof
from sandbox.executor import CompileOnly
from tests.helpers import fake_evaluate, populated_run

P = Problem(1000, 3000, 2000)
Q = Problem(64, 64, 64, "nk")

FAKE_NCU = r'''#!{python}
"""A stand-in for Nsight Compute: checks its command line, prints what `ncu --csv --page raw` prints."""
import json, os, re, sys, time

args = sys.argv[1:]
with open(os.environ["FAKE_NCU_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
mode = os.environ.get("FAKE_NCU_MODE", "ok")
metrics = args[args.index("--metrics") + 1].split(",")
target = args[args.index("--metrics") + 2:]
assert target[1:3] == ["-m", "sandbox.profile_target"], target
job = json.load(open(target[3]))
assert os.path.getsize(job["cubin"]) > 0 and job["family"] and job["problem"]["m"] > 0
print("==PROF== Connected to process 4242 (/usr/bin/python3.12)")
if mode == "hang":
    time.sleep(60)
if mode == "perm":
    print("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance "
          "Counters on the target device 0. For instructions on enabling permissions and to get more "
          "information see https://developer.nvidia.com/ERR_NVGPUCTRPERM")
    sys.exit(1)
if mode == "noprofiler":  # what ncu says on a runtime without access to the profiler (gVisor)
    print("==ERROR== Failed to initialize the profiler: LibraryNotLoaded")
    sys.exit(1)
unknown = [m for m in metrics if any(u and u in m for u in os.environ.get("FAKE_NCU_UNKNOWN", "").split(","))]
if unknown:  # like ncu, it names the first metric it does not know, and stops
    name = unknown[0] if mode != "anonymous" else "something"
    print("==ERROR== Failed to find metric regex:^" + re.escape(name) + "$")
    sys.exit(1)
print('==PROF== Profiling "hgemm" - 0: 0%....50%....100% - 23 passes')
print("==PROF== Disconnected from process 4242")
values = {{
    "lts__t_sector_hit_rate.pct": ("%", "62.31"),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "85.04"),
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": ("%", "85.04"),
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "40.12"),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("%", "12.47"),
    "gpu__time_duration.sum": ("nsecond", "1,234,567"),
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": ("%", "35.2"),
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": ("%", "0"),
    "smsp__average_warp_latency_per_inst_issued.ratio": ("", "20.00"),
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": ("", "8.2"),
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": ("", "2.4"),
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": ("", "1.0"),
    "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio": ("", "n/a"),
}}
values.update({{k: tuple(v) for k, v in json.loads(os.environ.get("FAKE_NCU_VALUES", "{{}}")).items()}})
cols = [m for m in metrics if m in values]
q = lambda row: ",".join('"' + x + '"' for x in row)
print(q(["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
         "Grid Size", "Device", "CC"] + cols))
print(q([""] * 11 + [values[m][0] for m in cols]))
print(q(["0", "4242", "python3.12", "127.0.0.1", "hgemm", "1", "7", "(128, 1, 1)", "(24, 8, 1)", "0", "9.0"]
        + [values[m][1] for m in cols]))
'''


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    """Installs the fake ncu through $HGEMM_AGENT_NCU; returns a reader of the command lines it was run with."""
    script, log = tmp_path / "ncu", tmp_path / "ncu.log"
    script.write_text(FAKE_NCU.format(python=sys.executable))
    script.chmod(0o755)
    log.write_text("")
    monkeypatch.setenv(prof.NCU_ENV, str(script))
    monkeypatch.setenv("FAKE_NCU_LOG", str(log))
    for var in ("FAKE_NCU_MODE", "FAKE_NCU_UNKNOWN", "FAKE_NCU_VALUES"):
        monkeypatch.delenv(var, raising=False)

    def calls() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    return calls


def metrics_of(call: list[str]) -> list[str]:
    return call[call.index("--metrics") + 1].split(",")


def run_profile(**kw) -> ProfileResult:
    return prof.profile_candidate(b"\x7fELF fake cubin", "sm80_mma", {"block_m": 128}, P, **kw)


# parsing and the summary line

def test_profile_parses_metrics_and_sums_them_up(fake_ncu):
    r = run_profile()
    assert r.ok and not r.error
    m = r.metrics
    assert (m["l2_hit_pct"], m["dram_pct"], m["sm_pct"], m["occupancy_pct"]) == (62.31, 85.04, 40.12, 12.47)
    assert m["duration_us"] == pytest.approx(1234.567)  # "1,234,567" nanoseconds
    assert m["tensor_pct"] == 35.2  # the busier of the mma and wgmma pipes
    assert m["stall_long_scoreboard_pct"] == pytest.approx(41.0) and m["stall_barrier_pct"] == pytest.approx(12.0)
    assert "stall_no_instruction_pct" not in m  # "n/a" is no number
    assert r.summary == ("L2 hit 62%, DRAM 85% busy, SM 40%, tensor pipe 35%, occupancy 12%: memory-bound; "
                         "top stalls long_scoreboard 41%, barrier 12%")
    (call,) = fake_ncu()
    for flag in ("--clock-control", "--target-processes", "--kernel-name", "--launch-skip", "--launch-count"):
        assert flag in call
    assert call[call.index("--kernel-name") + 1] == "hgemm" and call[call.index("--launch-skip") + 1] == "2"
    assert {m for _, m in prof.ALL_METRICS} == set(metrics_of(call))


@pytest.mark.parametrize("dram, sm, verdict", [
    (85.0, 40.0, "memory-bound"), (20.0, 88.0, "compute-bound"), (30.0, 35.0, "latency-bound"),
])
def test_summary_names_what_bounds_the_kernel(dram, sm, verdict):
    summary = prof.summarize({"l2_hit_pct": 50.0, "dram_pct": dram, "sm_pct": sm})
    assert summary.startswith(f"L2 hit 50%, DRAM {dram:.0f}% busy, SM {sm:.0f}%: {verdict}")
    assert "stalls" not in summary


def test_details_page_layout_parses_too():
    text = textwrap.dedent('''\
        ==PROF== Disconnected from process 1
        "ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
        "0","1","python","h","hgemm","1","7","(128, 1, 1)","(8, 8, 1)","0","9.0","Command line profiler metrics","sm__throughput.avg.pct_of_peak_sustained_elapsed","%","91.5"
        "0","1","python","h","hgemm","1","7","(128, 1, 1)","(8, 8, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","1,002.5"
        ''')  # noqa: E501
    raw = prof.parse_ncu_csv(text)
    assert raw == {"sm__throughput.avg.pct_of_peak_sustained_elapsed": 91.5, "gpu__time_duration.sum": 1002.5}
    assert prof.classify(prof.named_metrics(raw, list(prof.ALL_METRICS))) == "compute-bound"
    assert prof.parse_ncu_csv("==ERROR== something\n") == {}


# failures are data

def test_metric_ncu_names_as_unknown_is_dropped_and_the_rest_kept(fake_ncu, monkeypatch):
    monkeypatch.setenv("FAKE_NCU_UNKNOWN", "gmma")  # an ncu or chip without the wgmma pipe
    r = run_profile()
    assert r.ok and r.metrics["tensor_pct"] == 35.2 and "stall_long_scoreboard_pct" in r.metrics
    first, second = fake_ncu()
    assert any("gmma" in m for m in metrics_of(first)) and not any("gmma" in m for m in metrics_of(second))
    assert len(metrics_of(second)) == len(metrics_of(first)) - 1


def test_unknown_metrics_fall_back_to_the_core_set(fake_ncu, monkeypatch):
    monkeypatch.setenv("FAKE_NCU_UNKNOWN", "stalled,tensor,latency,gpu__dram")
    monkeypatch.setenv("FAKE_NCU_MODE", "anonymous")  # the error names nothing we asked for
    r = run_profile()
    assert r.ok and r.metrics["dram_pct"] == 85.04 and "tensor_pct" not in r.metrics
    assert r.summary.endswith(": memory-bound")
    calls = fake_ncu()
    assert len(calls) == 2 and metrics_of(calls[1]) == [m for _, m in prof.CORE_METRICS]


def test_core_metrics_rejected_too_is_a_failed_profile(fake_ncu, monkeypatch):
    monkeypatch.setenv("FAKE_NCU_UNKNOWN", "__")  # it knows nothing
    r = run_profile()
    assert not r.ok and "Failed to find metric" in r.error
    assert len(fake_ncu()) <= 3


def test_missing_ncu(monkeypatch, tmp_path):
    monkeypatch.setenv(prof.NCU_ENV, str(tmp_path / "no-such-ncu"))
    r = run_profile()
    assert not r.ok and r.error == "Nsight Compute (ncu) not found" and not r.metrics


@pytest.mark.parametrize("mode, words", [("perm", "ERR_NVGPUCTRPERM"), ("noprofiler", "LibraryNotLoaded")])
def test_no_counters(fake_ncu, monkeypatch, mode, words):
    monkeypatch.setenv("FAKE_NCU_MODE", mode)
    r = run_profile()
    assert not r.ok and r.error.startswith(prof.NO_COUNTERS) and words in r.error
    assert len(fake_ncu()) == 1  # asking for fewer metrics would not help


def test_timeout_kills_ncu(fake_ncu, monkeypatch):
    monkeypatch.setenv("FAKE_NCU_MODE", "hang")
    t0 = time.monotonic()
    r = run_profile(timeout_s=1.5)
    assert not r.ok and "timed out" in r.error
    assert time.monotonic() - t0 < 10


# the store, the loop, show and the prompt

def test_store_round_trip(tmp_path):
    store = RunStore(tmp_path / "r", create=True)
    assert store.profile("abc") is None
    good = ProfileResult(True, {"dram_pct": 85.0, "sm_pct": 40.0}, "DRAM 85% busy, SM 40%: memory-bound")
    store.add_profile("abc", good)
    store.add_profile("def", ProfileResult(False, error="ncu timed out after 120 s"))
    store.close()
    again = RunStore(tmp_path / "r")
    assert again.profile("abc") == good and again.profile("def").error == "ncu timed out after 120 s"


def test_store_from_before_profiles_winners_and_bias(tmp_path):
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([Problem(64, 64, 64)])
    for table in ("profiles", "winners"):
        store.db.execute(f"DROP TABLE {table}")
    store.db.execute("ALTER TABLE problems DROP COLUMN bias")
    store.close()
    again = RunStore(tmp_path / "r")  # an older run gains what it lacks when opened
    assert again.profile("abc") is None and again.winner(Problem(64, 64, 64)) is None
    assert again.problems() == [Problem(64, 64, 64)]
    again.add_profile("abc", ProfileResult(True, {}, "x"))
    assert again.profile("abc").summary == "x"


def _leaders(store: RunStore, problem: Problem, n: int) -> list[str]:
    return [c.id for c, _ in store.leaders(problem)[:n]]


def test_loop_profiles_the_leaders_and_prompts_see_them(tmp_path):
    calls = []

    def profiler(cubin, family, params, problem):
        calls.append((family, params, problem))
        assert cubin
        return ProfileResult(True, {"dram_pct": 85.0, "sm_pct": 40.0}, f"fake profile {len(calls)}: memory-bound")

    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    loop = SearchLoop(store, RunConfig(max_candidates=8, profile=True), BuiltinProposer(), "sm_90a", fake_evaluate,
                      profiler=profiler)
    loop.run([P])
    assert all(store.profile(cid).ok for cid in _leaders(store, P, 2))
    assert 2 <= len(calls) <= 3 and all(p == P for _, _, p in calls)  # the leader at half-time, the top 2 at the end
    profiled = [c.id for c in store.candidates(P) if store.profile(c.id)]
    assert len(profiled) == len(calls) == len({json.dumps(p, sort_keys=True) for _, p, _ in calls})

    state = loop.restore(P)  # a resumed search, and the prompts it makes, see the summaries
    assert set(state.profiles) == set(profiled)
    context = build_context(state, n=2)
    shown = [b["profile"] for b in context["best"] if b["profile"]]
    assert shown and all(s.startswith("fake profile") for s in shown)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(PROMPTS), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    prompt = env.get_template("propose.j2").render(**context)
    assert f"Nsight Compute profile: {shown[0]}" in prompt


def test_loop_with_the_fake_ncu_and_show(tmp_path, fake_ncu, capsys):
    store = RunStore(tmp_path / "runs" / "r1", create=True)
    store.add_problems([P])
    store.set_meta("config", RunConfig(max_candidates=4).model_dump(mode="json"))
    SearchLoop(store, RunConfig(max_candidates=4, profile=True), BuiltinProposer(), "sm_90a", fake_evaluate,
               profiler=prof.profile_candidate).run([P])
    best = store.winner(P).candidate
    assert store.profile(best.id).summary.startswith("L2 hit 62%, DRAM 85% busy")
    console = Console(record=True, width=200)
    console.print(show_run(store))
    assert f"profile {P.mnk} kn {best.id}: L2 hit 62%, DRAM 85% busy" in console.export_text()


def test_without_ncu_the_run_says_so_once_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(prof.NCU_ENV, str(tmp_path / "no-such-ncu"))
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P, Q])
    SearchLoop(store, RunConfig(max_candidates=4, profile=True), BuiltinProposer(), "sm_90a", fake_evaluate,
               profiler=prof.profile_candidate).run([P, Q])
    skipped = [m for _, kind, m in store.events() if "profiling skipped" in m]
    assert skipped == ["profiling skipped: ncu not found"]
    assert len(store.results(P)) == len(store.results(Q)) == 4
    assert not any(store.profile(c.id) for c in store.candidates())


@pytest.mark.parametrize("config, evaluate", [
    (RunConfig(max_candidates=4, profile=False), fake_evaluate),  # --no-profile
    (RunConfig(max_candidates=4), fake_evaluate),  # the built-in proposer reads no profiles: none by default
    (RunConfig(max_candidates=4, proposer="llm", profile=False), fake_evaluate),
    (RunConfig(max_candidates=4, profile=True), CompileOnly()),  # compile only
])
def test_no_profiling_when_switched_off_or_compiling_only(tmp_path, config, evaluate):
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    SearchLoop(store, config, BuiltinProposer(), "sm_90a", evaluate,
               profiler=lambda *a: pytest.fail("profiled")).run([P])
    assert not any("profil" in m for _, _, m in store.events())


def test_repeated_profile_failures_stop_profiling(tmp_path):
    calls = []

    def broken(*args):
        calls.append(args)
        return ProfileResult(False, error="ncu timed out after 120 s")

    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P, Q])
    SearchLoop(store, RunConfig(max_candidates=4, profile=True), BuiltinProposer(), "sm_90a", fake_evaluate,
               profiler=broken).run([P, Q])
    assert len(calls) == 2
    assert [m for _, _, m in store.events() if "skipped" in m] == ["profiling skipped: two profiles in a row failed"]


def test_show_without_profiles_has_no_profile_lines(tmp_path):
    store = populated_run(tmp_path / "r", problems=(P,), n=3)
    console = Console(record=True, width=200)
    console.print(show_run(store))
    assert "profile " not in console.export_text()


def test_profiles_are_on_where_something_reads_them_or_where_asked():
    from agent.cli import build_parser, main
    from agent.run_options import run_config

    def config(*argv):
        return run_config(build_parser().parse_args(["run", "--mnk", "64_64_64", *argv]))

    assert config().profiles is False  # the built-in proposer never reads a profile
    assert config("--proposer", "mixed", "--llm-base-url", "http://localhost:1/v1").profiles is True  # the prompts do
    assert config("--proposer", "llm", "--llm-base-url", "http://x:1", "--no-profile").profiles is False
    assert config("--profile").profiles is True and config("--no-profile").profiles is False
    assert main(["run", "--mnk", "64_64_64", "--profile", "--no-profile"]) == 2  # one or the other


def test_a_profile_is_charged_to_its_shape_and_none_starts_past_its_share(tmp_path):
    """Profiles of about a second each are kept out of the shape's share (at least one leader is still to profile
    when it stops proposing); a shape whose share is spent is not profiled at all, so the shapes after it keep their
    time."""
    def slow_profile(*args):
        time.sleep(1.0)
        return ProfileResult(True, {}, "fake profile")

    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    loop = SearchLoop(store, RunConfig(max_candidates=50, profile=True, budget_minutes=0.05), BuiltinProposer(),
                      "sm_90a", lambda j: time.sleep(0.1) or dataclasses.replace(fake_evaluate(j), wall_s=0.1),
                      profiler=slow_profile)  # 50 evaluations of 0.1 s outlast the 3 s share, however fast builds are
    loop.profiles.walls = [1.0]  # as if the run had timed a profile at a second
    loop.run([P])
    [cut] = [m for _, kind, m in store.events() if kind == "budget"]
    assert "kept for re-measurement and profiles" in cut
    assert 2 <= len(store.results(P)) < 50
    assert float(cut.split("; ")[1].split(" s kept")[0]) >= 0.9  # a leader's profile, at about a second
    spent = RunStore(tmp_path / "r2", create=True)
    spent.add_problems([P])
    short = SearchLoop(spent, RunConfig(max_candidates=4, profile=True, budget_minutes=0.01), BuiltinProposer(),
                       "sm_90a", lambda j: time.sleep(0.4) or fake_evaluate(j),  # two outlast the 0.6 s share
                       profiler=lambda *a: pytest.fail("profiled past the share"))
    short.profiles.walls = [0.1]  # a profile would fit half the share: it is the spent share that stops it
    short.run([P])
    assert len(spent.results(P)) == 2
    assert any("not profiled: the shape's time share is spent" in m for _, _, m in spent.events())


def test_profiles_take_at_most_half_a_shape_share_and_a_small_share_searches_without_them(tmp_path):
    """With profiles on, a shape whose share cannot hold a profile in half of it searches its whole share for
    candidates and is not profiled (the run says why); a shape with room profiles as before."""
    def profile(*args):
        return ProfileResult(True, {}, "fake profile")

    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    loop = SearchLoop(store, RunConfig(max_candidates=50, profile=True, budget_minutes=0.05), BuiltinProposer(),
                      "sm_90a", lambda j: time.sleep(0.1) or dataclasses.replace(fake_evaluate(j), wall_s=0.1),
                      profiler=lambda *a: pytest.fail("profiled a shape whose share is too small"))
    loop.profiles.walls = [2.0]  # as if the run had timed a profile at 2 s: more than half the 3 s share
    loop.run([P])
    [cut] = [m for _, kind, m in store.events() if kind == "budget"]
    assert float(cut.split("; ")[1].split(" s kept")[0]) < 1.0  # nothing kept for profiles
    assert any("would take more than 50% of the shape's 3 s share" in m for _, _, m in store.events())
    assert len(store.results(P)) >= 2  # the share went to candidates (as many as builds allow)
    roomy = RunStore(tmp_path / "r2", create=True)
    roomy.add_problems([P])
    calls = []
    SearchLoop(roomy, RunConfig(max_candidates=4, profile=True), BuiltinProposer(), "sm_90a", fake_evaluate,
               profiler=lambda *a: calls.append(a) or profile()).run([P])
    assert 2 <= len(calls) <= 3  # the leader at half-time and the top 2 at the end, in a 5-minute share


# on the GPU, under the real Nsight Compute

@pytest.mark.gpu
@pytest.mark.parametrize("problem", [Problem(2048, 2048, 2048), Problem(1024, 2048, 1024, "nk", "bf16", True)],
                         ids=lambda p: p.key)
def test_profile_a_real_sm80_kernel(problem):
    import torch

    from sandbox.build import compile_cuda
    from templates import get_family

    if prof.find_ncu() is None:
        pytest.skip("Nsight Compute (ncu) is not installed")
    family = get_family("sm80_mma")
    params = family.space(problem)[0]
    arch = "sm_90a" if torch.cuda.get_device_capability()[0] == 9 else "sm_80"
    build = compile_cuda(family.render(params, problem), arch, candidate_id="profile-test")
    assert build.ok, build.log
    r = prof.profile_candidate(build.cubin, "sm80_mma", params, problem)
    if not r.ok and r.error.startswith(prof.NO_COUNTERS):
        pytest.skip(r.error)
    assert r.ok, r.error
    for key in ("l2_hit_pct", "dram_pct", "sm_pct"):
        assert 0.0 <= r.metrics[key] <= 100.0, (key, r.metrics)
    assert r.metrics.get("duration_us", 0) > 0
    assert "bound" in r.summary, r.summary
    print(f"\n{os.path.basename(prof.find_ncu())}: {r.summary}\n{json.dumps(r.metrics, indent=1)}")


@pytest.mark.parametrize("visible, index, expected", [(None, 1, "1"), ("2,3", 1, "3"), ("GPU-ab, GPU-cd", 0, "GPU-ab")])
def test_the_profiled_process_sees_only_the_gpu_asked_for(monkeypatch, visible, index, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert prof.visible_device(index) == expected
