"""The LLM proposer against a scripted chat-completions server, through the real `openai` client.

Good proposals become candidates; bad replies are sent back once, then dropped and counted; 429, 5xx and timeouts
are retried, then the run goes on with the built-in proposer; budgets stop the calls; the API key goes nowhere.
"""

from __future__ import annotations

import json
import math
import re
import socket

import pytest

from agent.bandit import ThompsonBandit
from agent.cli import main
from agent.config import LlmSettings, RunConfig
from agent.loop import SearchLoop
from agent.proposers import make_proposer
from agent.proposers.base import SearchState, arm_of
from agent.proposers.budget import estimate_tokens
from agent.proposers.builtin import BuiltinProposer
from agent.proposers.llm import LlmProposer
from agent.proposers.mixed import MixedProposer
from agent.store import RunStore
from core.device import DeviceFacts
from core.records import BuildResult, Candidate, EvalResult, Patch, Problem, Status, TextEdit, Timing
from sandbox.executor import CompileOnly
from templates import get_family
from tests.chat_server import ChatServer, Error, Reply, proposals

P = Problem(256, 256, 256)
KEY = "sk-test-SECRET-0123456789abcdef"
GOOD = {"kind": "params", "family": "sm80_mma", "rationale": "small tiles fill more SMs at 256^3",
        "params": {"block_m": 64, "block_n": 64, "warps_m": 2, "warps_n": 2, "block_k": 32, "stages": 3}}
EDITED = get_family("naive").template_source().replace("float acc = 0.0f;", "float acc = 0.0f;  // edited")
EDIT = {"kind": "edit", "family": "naive", "params": {"block_x": 32, "block_y": 8}, "template": EDITED,
        "rationale": "wider rows coalesce the loads of B"}

# patches against the sm90 template as it is now, whoever changed it last: anchors are read from the file
SM90 = get_family("sm90_wgmma")
SM90_SOURCE = SM90.template_source()
ANCHOR = next(line for line in SM90_SOURCE.splitlines() if 'extern "C"' in line)  # the entry point: always rendered
MARKER = "// patched: a marker the compiled source must carry"
PATCH = {"kind": "patch", "family": "sm90_wgmma", "rationale": "a comment before the entry point",
         "edits": [{"search": ANCHOR, "replace": MARKER + "\n" + ANCHOR}]}
TWICE = next(line for line in SM90_SOURCE.splitlines() if len(line.strip()) > 8 and SM90_SOURCE.count(line) == 2)


def params_proposal(**params) -> dict:
    return {**GOOD, "params": {**GOOD["params"], **params}}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    for name in ("OPENAI_BASE_URL", "OPENAI_MODEL", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy",
                 "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server():
    with ChatServer() as s:
        yield s


def make(server, per_call=4, **settings) -> LlmProposer:
    values = {"base_url": server.base_url, "model": "scripted", "timeout_s": 5.0, "retries": 2, **settings}
    return LlmProposer(LlmSettings(**values), backoff_s=0.01, per_call=per_call)


def fresh_state(arch: str = "sm_90a") -> SearchState:
    return SearchState(P, arch, ThompsonBandit())


def record(state: SearchState, c: Candidate, result: EvalResult, build: BuildResult | None = None) -> None:
    state.tried.append((c, build, result))
    state.bandit.update(arm_of(c), math.log(result.speedup) if result.speedup else None)


def test_params_proposal_becomes_a_candidate(server):
    server.push(Reply(proposals(GOOD)))
    [c] = make(server).propose(fresh_state())
    assert (c.family, c.origin, c.template_override) == ("sm80_mma", "llm", None)
    assert c.params == get_family("sm80_mma").parse(GOOD["params"], P).model_dump()
    assert c.rationale == GOOD["rationale"]
    [request] = server.requests
    assert request.body["response_format"] == {"type": "json_object"} and request.body["model"] == "scripted"
    assert request.headers["authorization"] == f"Bearer {KEY}"  # the key does go to the endpoint, and only there


def test_edit_proposal_sets_the_template_override(server):
    server.push(Reply(proposals(EDIT)))
    [c] = make(server).propose(fresh_state())
    assert c.origin == "llm-edit" and c.template_override == EDITED and c.params == {"block_x": 32, "block_y": 8}


def test_patch_to_the_sm90_template_becomes_a_candidate_with_its_provenance(server):
    assert SM90_SOURCE.count(ANCHOR) == 1
    server.push(Reply(proposals(PATCH)))
    llm = make(server)
    [c] = llm.propose(fresh_state())
    assert (c.family, c.origin, c.kind, c.arm) == ("sm90_wgmma", "llm-patch", "patch", "llm-patch:sm90_wgmma")
    assert c.template_override == SM90_SOURCE.replace(ANCHOR, MARKER + "\n" + ANCHOR)
    assert c.patch == Patch("sm90_wgmma", (TextEdit(ANCHOR, MARKER + "\n" + ANCHOR),))
    assert c.params == SM90.parse(SM90.space(P)[0], P).model_dump()  # no params: the family's first setting
    [call] = llm.take_calls()
    assert (call.purpose, call.prompt_tokens, call.completion_tokens, call.left_out) == ("propose", 100, 50, ())
    [fate] = call.proposals
    assert (fate.kind, fate.family, fate.outcome, fate.base, fate.candidate_id) == (
        "patch", "sm90_wgmma", "accepted", "sm90_wgmma", c.id)


def test_a_patch_on_an_edited_candidate_patches_its_template_with_its_setting(server):
    state = fresh_state()
    settings = SM90.space(P)
    first = Candidate(P, "sm90_wgmma", settings[1], "llm-patch", template_override=MARKER + "\n" + SM90_SOURCE,
                      patch=Patch("sm90_wgmma", (TextEdit("x", "y"),)))
    record(state, first, EvalResult(first.id, Status.SKIPPED))
    again = {**PATCH, "base": first.id[:7], "edits": [{"search": MARKER, "replace": MARKER + " (twice)"}]}
    server.push(Reply(proposals(again, {**again, "params": settings[2]})))
    a, b = make(server).propose(state, n=2)
    assert a.template_override == MARKER + " (twice)\n" + SM90_SOURCE == b.template_override
    assert a.patch.base == first.id and a.params == first.params and b.params == settings[2]
    assert "llm-patch:sm90_wgmma" in server.requests[0].text and MARKER in server.requests[0].text  # its diff


@pytest.mark.parametrize("search, reason", [
    (TWICE, f"edit 1: search text occurs {SM90_SOURCE.count(TWICE)} times: add context to make it unique"),
    ("__global__ void hgemm_that_is_not_there(", "edit 1: search text not found"),
])
def test_a_patch_matching_twice_or_not_at_all_is_refused_with_the_reason(server, search, reason):
    bad = {**PATCH, "edits": [{"search": search, "replace": "x"}]}
    server.push(Reply(proposals(bad)), Reply(proposals(bad)), Reply(proposals(bad, GOOD)), Reply(proposals(GOOD)))
    llm = make(server)
    assert llm.propose(fresh_state()) == []  # alone, the bad patch sends the reply back with the reason, then drops it
    assert reason in server.requests[1].messages[-1]["content"]
    [c] = llm.propose(fresh_state())  # the next prompt says why the reply was dropped
    assert "a whole reply was dropped" in server.requests[2].text and reason in server.requests[2].text
    state = fresh_state()
    record(state, c, EvalResult(c.id, Status.SKIPPED))
    assert llm.propose(state) == []  # beside a good proposal, the bad patch is named in the next prompt
    rejected = server.requests[3].text.split("rejected before compiling")[1]
    assert f"proposal 1 (patch, family 'sm90_wgmma'): {reason}" in rejected
    refused = [f for call in llm.take_calls() for f in call.proposals if f.outcome == "refused"]
    assert len(refused) == 3 and all(f.reason.startswith(reason) and f.kind == "patch" for f in refused)


def test_the_prompt_shows_every_template_within_the_budget_and_says_what_it_cut(server):
    state = fresh_state()
    t, cublas = Timing(8.0, 7.9, 8.1, 100), Timing(12.0, 11.9, 12.1, 100)
    fast = Candidate(P, "sm80_mma", get_family("sm80_mma").space(P)[0], "builtin")  # sm80 ranks first
    record(state, fast, EvalResult(fast.id, Status.OK, warm=t, cold=t, cublas_warm=cublas, cublas_cold=cublas))
    server.push(Reply(proposals(GOOD)), Reply(proposals(GOOD)))
    make(server).propose(state)
    default = server.requests[0].text
    for name in ("naive", "sm80_mma", "sm90_wgmma"):  # the default budget holds every template, sm90's included
        assert get_family(name).template_source() in default
    assert "Left out" not in default and len(default) // 4 <= LlmSettings().max_prompt_tokens
    tight = make(server, max_prompt_tokens=9_000)
    tight.propose(state)
    prompt = server.requests[1].text
    assert len(prompt) // 4 <= 9_000 and get_family("sm80_mma").template_source() in prompt
    cut = prompt.split("# Left out to fit the prompt budget")[1].split("# Task")[0]
    assert cut.index("template of naive") < cut.index("template of sm90_wgmma")  # base family, then lower rank
    assert SM90_SOURCE not in prompt and "template left out to fit the prompt budget" in prompt
    [call] = tight.take_calls()
    assert [text.split(" (")[0] for text in call.left_out] == ["the Jinja template of naive",
                                                              "the Jinja template of sm90_wgmma"]


def test_extra_proposals_are_kept_for_the_next_call(server):
    server.push(Reply("```json\n" + proposals(GOOD, params_proposal(stages=4)) + "\n```"))  # fences tolerated
    llm = make(server)
    state = fresh_state()
    first = llm.propose(state)
    record(state, first[0], EvalResult(first[0].id, Status.SKIPPED))
    second = llm.propose(state)
    assert len(server.requests) == 1 and second[0].params["stages"] == 4


def test_bad_json_then_good_on_the_resend_is_accepted(server):
    server.push(Reply('{"proposals": [ this is not json'), Reply(proposals(GOOD)))
    llm = make(server)
    [c] = llm.propose(fresh_state())
    assert c.origin == "llm"
    resend = server.requests[1].messages
    assert resend[-2] == {"role": "assistant", "content": '{"proposals": [ this is not json'}
    assert resend[-1]["role"] == "user" and "not valid JSON" in resend[-1]["content"]
    assert llm.stats()["resent"] == 1 and llm.stats()["dropped"] == 0


@pytest.mark.parametrize("bad, error", [
    ("Sure! Here are some kernels.", "not valid JSON"),
    (json.dumps({"proposals": [{"kind": "params", "params": {}}]}), "proposals.0.params.family: Field required"),
    (json.dumps({"proposals": [{"kind": "rewrite", "family": "sm80_mma"}]}), "does not match the schema"),
    (json.dumps({"proposals": []}), "at least 1 item"),
    (proposals({**GOOD, "family": "cutlass_magic"}), "unknown template family 'cutlass_magic'"),
    (proposals(params_proposal(warps_m=3)), "warps_m"),
    (proposals(params_proposal(bogus=1)), "bogus"),
    (proposals({**EDIT, "params": {"block_x": 7}}), "block_x"),
])
def test_a_bad_reply_is_sent_back_once_then_dropped_and_counted(server, bad, error):
    server.push(Reply(bad), Reply(bad))
    llm = make(server)
    assert llm.propose(fresh_state()) == []
    assert len(server.requests) == 2 and error in server.requests[1].messages[-1]["content"]
    assert llm.stats()["dropped"] == 1 and llm.stats()["resent"] == 1 and llm.stopped is None
    server.push(Reply(proposals(GOOD)))  # the proposer is still usable afterwards
    assert len(llm.propose(fresh_state())) == 1
    assert "dropped" in server.requests[2].text  # and the next prompt says what went wrong


def test_valid_proposals_survive_invalid_neighbours(server):
    server.push(Reply(proposals(params_proposal(warps_m=3), GOOD)))
    llm = make(server)
    assert [c.origin for c in llm.propose(fresh_state())] == ["llm"]
    assert len(server.requests) == 1 and llm.stats()["rejected"] == 1


def test_already_tried_proposals_are_skipped(server):
    state = fresh_state()
    tried = Candidate(P, "sm80_mma", get_family("sm80_mma").parse(GOOD["params"], P).model_dump(), "builtin")
    record(state, tried, EvalResult(tried.id, Status.SKIPPED))
    server.push(Reply(proposals(GOOD)))
    llm = make(server)
    assert llm.propose(state) == [] and llm.stats()["duplicates"] == 1 and len(server.requests) == 1


def test_429_then_success_is_retried(server):
    server.push(Error(429, "slow down"), Reply(proposals(GOOD)))
    llm = make(server)
    assert len(llm.propose(fresh_state())) == 1
    assert llm.stats()["retries"] == 1 and llm.stats()["calls"] == 1 and llm.stopped is None  # one call, two attempts


def test_timeout_is_retried(server):
    server.push(Reply(proposals(EDIT), delay_s=2.0), Reply(proposals(GOOD)))
    llm = make(server, timeout_s=0.5)
    [c] = llm.propose(fresh_state())
    assert c.origin == "llm" and llm.stats()["retries"] == 1


def test_endpoint_refusing_json_mode_is_asked_without_it(server):
    server.push(Error(400, "response_format is not supported"), Reply(proposals(GOOD)))
    llm = make(server)
    assert len(llm.propose(fresh_state())) == 1
    assert "response_format" not in server.requests[1].body and llm.stats()["json_mode"] is False


def test_500_repeatedly_gives_up_and_mixed_goes_on_with_builtin(server):
    server.default = Error(500, "upstream exploded")
    llm = make(server, retries=2)
    mixed = MixedProposer(llm, BuiltinProposer(), llm_every=1, name="llm")
    state = fresh_state()
    for _ in range(5):
        [c] = mixed.propose(state)
        assert c.origin == "builtin"
        record(state, c, EvalResult(c.id, Status.SKIPPED))
    assert len(server.requests) == 3  # one call and two retries, then never again
    stats = mixed.stats()
    assert "HTTP 500" in stats["llm"]["gave_up"] and "built-in" in stats["fallback"]
    assert stats["candidates_from"] == {"builtin": 5}  # by origin: the LLM handed none
    [call] = mixed.take_calls()  # the failed request is reported once
    assert call.error.startswith("endpoint failed: HTTP 500") and call.proposals == ()
    assert mixed.take_calls() == []


def test_llm_down_the_mixed_proposer_keeps_proposing():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = LlmProposer(LlmSettings(base_url=f"http://127.0.0.1:{port}/v1", retries=1, timeout_s=2), backoff_s=0.01)
    mixed = MixedProposer(llm, BuiltinProposer())
    state = fresh_state()
    for _ in range(4):
        [c] = mixed.propose(state)
        record(state, c, EvalResult(c.id, Status.SKIPPED))
    stats = llm.stats()  # one call, two attempts
    assert "connection error" in llm.gave_up
    assert (stats["calls"], stats["failed_requests"], stats["retries"]) == (1, 2, 1)


def test_budgets_stop_the_calls(server):
    def run(llm, replies):
        server.requests.clear()
        server.push(*[Reply(proposals(params_proposal(stages=s))) for s in replies])
        state, got = fresh_state(), []
        for _ in range(len(replies)):
            got += llm.propose(state)
            for c in got[-1:]:
                record(state, c, EvalResult(c.id, Status.SKIPPED))
        return got

    by_calls = make(server, max_calls=2, per_call=1)
    assert len(run(by_calls, [2, 3, 4])) == 2 and len(server.requests) == 2
    assert "max_calls" in by_calls.stats()["budget_spent"]
    by_tokens = make(server, max_tokens=200, per_call=1)  # each scripted reply uses 150 tokens
    assert len(run(by_tokens, [2, 3, 4])) == 2 and len(server.requests) == 2
    stats = by_tokens.stats()
    assert "max_tokens" in stats["budget_spent"] and stats["tokens"]["total"] == 300
    assert stats["tokens"]["prompt"] == 200 and stats["tokens"]["completion"] == 100


def test_tokens_are_estimated_where_the_server_reports_no_usage(server):
    server.push(Reply(proposals(GOOD), usage=False))
    llm = make(server, max_tokens=100)
    assert len(llm.propose(fresh_state())) == 1
    tokens = llm.stats()["tokens"]
    assert tokens["estimated"] and tokens["total"] > 100  # a big prompt: the budget is spent after one call
    assert llm.propose(fresh_state()) == [] and len(server.requests) == 1 and "max_tokens" in llm.stopped


def test_prompt_holds_hardware_problem_best_candidates_failures_and_ranking(server):
    device = DeviceFacts.from_dict({"name": "Test GPU X", "sms": 77, "l2_bytes": 50 * 2**20,
                                    "smem_per_block": 100 * 1024, "arch": "sm_90a"})
    state = SearchState(P, "sm_90a", ThompsonBandit(), device=device)
    fast = Candidate(P, "sm80_mma", get_family("sm80_mma").space(P)[0], "builtin")
    t, cublas = Timing(8.0, 7.9, 8.1, 100), Timing(12.0, 11.9, 12.1, 100)
    record(state, fast, EvalResult(fast.id, Status.OK, warm=t, cold=t, cublas_warm=cublas, cublas_cold=cublas),
           BuildResult(fast.id, True, "sm_90a", "src", registers=168, spill_bytes=0))
    broken = Candidate(P, "naive", {"block_x": 16, "block_y": 16}, "llm-edit", template_override="x")
    log = 'kernel.cu(12): error: identifier "warp_sum" is undefined\n1 error detected in the compilation'
    record(state, broken, EvalResult(broken.id, Status.COMPILE_ERROR, "kernel.cu(12): error"),
           BuildResult(broken.id, False, "sm_90a", "x", log=log, error="kernel.cu(12): error"))
    wrong = Candidate(P, "sm80_mma", get_family("sm80_mma").space(P)[1], "builtin")
    record(state, wrong, EvalResult(wrong.id, Status.WRONG, "relative error 3e-1 vs cuBLAS 2e-4"))
    server.push(Reply(proposals(GOOD)))
    make(server).propose(state)
    prompt = server.requests[0].text
    for fact in ("Test GPU X", "sms: 77", "l2_mib: 50.0", "smem_per_block_optin_kib: 100.0", "sm_90a",
                 "M=256, N=256, K=256", "cuBLAS takes 12.0 us"):
        assert fact in prompt
    assert fast.id in prompt and "1.5x cuBLAS" in prompt and "registers 168" in prompt
    assert 'identifier "warp_sum" is undefined' in prompt and "relative error 3e-1" in prompt
    assert arm_of(fast) in prompt and "What the bandit has learned" in prompt
    assert get_family("sm80_mma").template_source()[:200] in prompt  # what an edit starts from
    assert "Parameter JSON schema" in prompt and "warps_m" in prompt


def test_prompt_context_stays_bounded(server):
    state = fresh_state()
    space = get_family("sm80_mma").space(P)
    for i, params in enumerate(space * 3):
        c = Candidate(P, "sm80_mma", {**params, "raster_group": 1 + i % 60}, "builtin")
        log = f"kernel.cu({i}): error: " + "x" * 5000
        record(state, c, EvalResult(c.id, Status.COMPILE_ERROR, "error"),
               BuildResult(c.id, False, "sm_90a", "s", log=log))
    server.push(Reply(proposals(GOOD)), Reply(proposals(GOOD)))
    make(server).propose(state)
    make(server).propose(fresh_state())
    long_run, fresh = (r.text for r in server.requests)
    assert len(long_run) - len(fresh) < 8_000  # the history adds a bounded amount, however long the run
    assert "Left out" not in long_run  # and everything fits the default budget


def test_api_key_appears_in_no_stats(server):
    server.push(Error(401, f"Incorrect API key provided: {KEY}. You can find your API key at ..."))
    llm = make(server)
    mixed = MixedProposer(llm, BuiltinProposer())
    for _ in range(2):
        mixed.propose(fresh_state())
    text = json.dumps(mixed.stats())
    assert "HTTP 401" in text and KEY not in text and "SECRET" not in text


def test_loop_with_llm_and_mixed_proposers_records_llm_candidates(server, tmp_path):
    server.default = Reply(proposals(EDIT, GOOD, params_proposal(stages=2)))
    settings = LlmSettings(base_url=server.base_url, model="scripted", timeout_s=10)
    # llm: the LLM's three, then built-in where the scripted reply only repeats them; mixed: in turns
    for kind, want in (("llm", ["llm-edit", "llm", "llm", "builtin"]), ("mixed", ["builtin", "llm-edit", "builtin",
                                                                                   "llm"])):
        config = RunConfig(proposer=kind, max_candidates=4, compile_only=True, llm=settings)
        store = RunStore(tmp_path / kind, create=True)
        store.add_problems([P])
        proposer = make_proposer(config)
        SearchLoop(store, config, proposer, "sm_90a", CompileOnly()).run([P])
        proposer.close()
        results = store.results(P)
        assert [c.origin for c, _ in results] == want
        assert {r.status for _, r in results} == {Status.SKIPPED}  # rendered and compiled, not run
        edit = next(c for c, _ in results if c.origin == "llm-edit")
        assert edit.template_override == EDITED and store.build(edit.id).ok
        stats = store.get_meta("proposer_stats")
        assert stats["proposer"] == kind and stats["llm"]["calls"] >= 1
        store.close()
        for f in (tmp_path / kind).iterdir():  # database, WAL and anything else in the run folder
            assert KEY.encode() not in f.read_bytes()


def test_cli_run_with_llm_proposer(server, tmp_path, monkeypatch, capsys):
    server.default = Reply(proposals(GOOD, EDIT))
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    monkeypatch.setenv("OPENAI_MODEL", "scripted")
    runs = tmp_path / "runs"
    code = main(["run", "--mnk", "256_256_256", "--compile-only", "--proposer", "llm", "--max-candidates", "3",
                 "--runs-dir", str(runs)])
    out, _ = capsys.readouterr()
    assert code == 0 and KEY not in out
    [folder] = list(runs.iterdir())
    store = RunStore(folder)
    origins = [c.origin for c in store.candidates(P)]
    assert len(origins) == 3 and {"llm", "llm-edit"} <= set(origins)
    assert server.requests and all(r.body["model"] == "scripted" for r in server.requests)
    store.close()
    for f in folder.iterdir():
        assert KEY.encode() not in f.read_bytes()


def test_a_failing_endpoint_is_said_when_it_fails_and_counted_once(server, tmp_path, monkeypatch, capsys):
    """Three attempts of one call: the run's lines say so as it happens, and the summary and `show --llm` both count
    one call."""
    server.default = Error(500, "upstream exploded")
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    runs = tmp_path / "runs"
    code = main(["run", "--mnk", "256_256_256", "--compile-only", "--proposer", "llm", "--max-candidates", "2",
                 "--runs-dir", str(runs)])
    out = capsys.readouterr().out
    assert code == 0 and len(server.requests) == 3
    said = out.index("256_256_256:kn:f16: LLM call (propose): endpoint failed: HTTP 500")
    first = re.search(r"256_256_256:kn:f16: [0-9a-f]{12} ", out).start()
    assert said < first < out.index("(done, arch")  # said before the first candidate's line, not only at the end
    assert "LLM: 1 call (1 failed)" in out and '"calls": 1,' in out and '"retries": 2' in out
    [folder] = list(runs.iterdir())
    assert main(["show", folder.name, "--llm", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "1 call, 0 prompt" in out and "LLM: 1 call (1 failed)" in out


def test_loop_compiles_and_records_a_patched_sm90_candidate_and_the_calls(server, tmp_path):
    include = {**PATCH, "edits": [{"search": ANCHOR, "replace": "#include <cuda_fp16.h>\n" + ANCHOR}]}
    server.default = Reply(proposals(PATCH, GOOD, include))
    config = RunConfig(proposer="llm", max_candidates=4, compile_only=True,
                       llm=LlmSettings(base_url=server.base_url, model="scripted", timeout_s=10))
    store = RunStore(tmp_path / "r", create=True)
    store.add_problems([P])
    proposer = make_proposer(config)
    SearchLoop(store, config, proposer, "sm_90a", CompileOnly()).run([P])
    proposer.close()
    patched, params, reads_files, builtin = store.candidates(P)
    assert (patched.origin, params.origin, builtin.origin) == ("llm-patch", "llm", "builtin")
    refused = store.result(reads_files.id)  # rendered by the loop, refused there: the next prompt shows why
    assert refused.status is Status.INVALID and "#include" in refused.reason and store.build(reads_files.id) is None
    assert reads_files.id in server.requests[-1].text.split("Recent failures")[1]
    assert patched.patch == Patch("sm90_wgmma", (TextEdit(ANCHOR, MARKER + "\n" + ANCHOR),))  # read back
    assert patched.template_override == SM90_SOURCE.replace(ANCHOR, MARKER + "\n" + ANCHOR)
    build = store.build(patched.id)
    assert build.ok and build.arch == "sm_90a" and MARKER in build.source  # rendered and compiled by NVRTC
    assert store.result(patched.id).status is Status.SKIPPED
    first, *later = store.model_calls()
    assert [(f.outcome, f.candidate_id) for f in first.proposals] == [("accepted", patched.id),
                                                                      ("accepted", params.id),
                                                                      ("accepted", reads_files.id)]
    assert later and all(f.outcome == "duplicate" for call in later for f in call.proposals)
    assert store.get_meta("proposer_stats")["candidates_from"] == {"llm-patch": 2, "llm": 1, "builtin": 1}


def test_cli_compile_only_run_records_a_patched_sm90_candidate(server, tmp_path, monkeypatch, capsys):
    server.default = Reply(proposals(PATCH))
    monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
    runs = tmp_path / "runs"
    budget = estimate_tokens(SM90_SOURCE) + 4_500  # room for the sm90 template and the rest, not for sm80's too
    code = main(["run", "--mnk", "256_256_256", "--compile-only", "--proposer", "llm", "--max-candidates", "2",
                 "--llm-max-prompt-tokens", str(budget), "--runs-dir", str(runs)])
    assert code == 0
    prompt = server.requests[0].text
    assert "# Left out" in prompt and len(prompt) // 4 <= budget and SM90_SOURCE in prompt  # sm80's went
    [folder] = list(runs.iterdir())
    store = RunStore(folder)
    patched, builtin = store.candidates(P)
    assert patched.origin == "llm-patch" and patched.patch.base == "sm90_wgmma" and store.build(patched.id).ok
    capsys.readouterr()
    assert main(["show", folder.name, "--llm", "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "patch sm90_wgmma on sm90_wgmma" in out and f"accepted as {patched.id}" in out and "skipped" in out
    assert f"duplicate of {patched.id}" in out and "left out: the Jinja template of naive" in out
    assert main(["diff", folder.name, builtin.id, patched.id, "--runs-dir", str(runs)]) == 0
    out = capsys.readouterr().out
    assert f"patch of B {patched.id}" in out and "+" + MARKER in out and "@@ edit 1 of 1 @@" in out
    store.close()


def test_prompt_names_the_dtype_and_the_bias_epilogue(server):
    problem = Problem(256, 256, 256, "nk", "bf16", True)
    server.push(Reply(proposals(GOOD)))
    make(server).propose(SearchState(problem, "sm_90a", ThompsonBandit()))
    prompt = server.requests[0].text
    assert "bf16 inputs and output" in prompt and "C += bias[N]" in prompt and "fp16 output" not in prompt
