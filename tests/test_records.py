"""The typed records passed between stages."""

from __future__ import annotations

import math

from core.records import Candidate, EvalResult, Problem, Status, Timing


def test_problem_floor_and_key():
    p = Problem(8192, 8192, 8192)
    assert p.key == "8192_8192_8192:kn:f16"
    assert Problem(205, 1000, 64).tiles(128, 256) == 2 * 4 and Problem(256, 1024, 64).tiles(128, 256) == 2 * 4


def test_candidate_id_is_content_addressed():
    p = Problem(64, 64, 64)
    a = Candidate(p, "sm80_mma", {"block_m": 64, "block_n": 64}, origin="builtin")
    b = Candidate(p, "sm80_mma", {"block_n": 64, "block_m": 64}, origin="llm")
    c = Candidate(Problem(64, 64, 64, "nk"), "sm80_mma", {"block_m": 64, "block_n": 64})
    assert a.id == b.id != c.id
    assert a.arm == "builtin:sm80_mma"


def test_eval_result_round_trip_and_score():
    r = EvalResult("x", Status.OK, warm=Timing(10, 9, 11, 100), cublas_warm=Timing(12, 11, 13, 100),
                   device={"name": "H200"})
    back = EvalResult.from_json(r.to_json())
    assert back == r and back.speedup == 1.2 and back.time_us == 10
    bad = EvalResult("y", Status.WRONG, "wrong result")
    assert bad.time_us == math.inf and bad.speedup is None
    assert EvalResult.from_json(bad.to_json()) == bad
