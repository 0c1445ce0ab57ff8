"""The typed records passed between stages."""

from __future__ import annotations

import dataclasses
import math

import pytest

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


def test_a_problem_over_a_range_of_m():
    bucket = Problem(21, 4096, 4096, "nk", m_range=[17, 24])  # a list, as JSON gives it back
    assert bucket.m_range == (17, 24) and bucket.m_span == (17, 24) and hash(bucket)
    assert bucket.key == "17-24_4096_4096:nk:f16" and bucket.mnk == "17-24_4096_4096"
    assert Problem(21, 4096, 4096, "nk").key == "21_4096_4096:nk:f16"  # one M: the key it always had
    assert Problem(**dataclasses.asdict(bucket)) == bucket
    assert Candidate(bucket, "naive", {}).id != Candidate(Problem(21, 4096, 4096, "nk"), "naive", {}).id
    for kw, match in [({"m": 30}, "outside the range 17-24"), ({"m_range": (0, 24), "m": 1}, "positive"),
                      ({"m_range": (24, 17)}, "reversed"), ({"m_range": (1, 2**19)}, "32-bit")]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(bucket, **kw)
