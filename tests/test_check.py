"""sandbox.check's error bounds on the CPU: a batch of outputs passes or fails output by output exactly as each
would alone (the timing checks verify every timed output in batches)."""

from __future__ import annotations

import pytest
import torch

from core.epilogue import split_gate_up
from core.records import Problem, Timing
from sandbox.check import Checker, CheckFailed


def checker(layout: str, bias: bool) -> Checker:
    c = object.__new__(Checker)  # the bounds need only the problem: no GPU, no launch
    c.problem, c.dtype, c.rel_err, c.cublas_rel_err = Problem(8, 24, 64, layout, "f16", bias), "f16", 0.0, 0.0
    c.epilogue = c.problem.fused
    return c


def operands(s: int, layout: str, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(s, 8, 64, generator=g).half()
    b = torch.randn(s, *((64, 24) if layout == "kn" else (24, 64)), generator=g).half()
    bb = torch.randn(s, 24, generator=g).half() if bias else None
    b_kn = b if layout == "kn" else b.transpose(1, 2)
    out = (a.float() @ b_kn.float() + (0 if bb is None else bb.float()[:, None])).half()  # fp32 sums, rounded once
    return out, a, b, bb


def verdicts_alone(c: Checker, out, a, b, bias) -> list[str | None]:
    found = []
    for i in range(out.shape[0]):
        try:
            c.verify(out[i], a[i], b[i], None if bias is None else bias[i], "alone")
            found.append(None)
        except CheckFailed as e:
            found.append(str(e).split(":")[0])
    return found


@pytest.mark.parametrize("layout, bias", [("kn", False), ("nk", True)])
def test_a_batch_fails_on_the_output_that_fails_alone(layout, bias):
    c = checker(layout, bias)
    out, a, b, bb = operands(5, layout, bias)
    c.verify_batch(out, a, b, bb, "batch", [f"output {i}" for i in range(5)])  # correct outputs pass
    assert 0 < c.rel_err < 1e-3 and 0 < c.cublas_rel_err < 1e-3
    bad = out.clone()
    bad[3, 2, 7] += 0.5  # one element of output 3, far beyond one rounding
    bad[4] = 0.0  # output 4 all wrong
    assert verdicts_alone(c, bad, a, b, bb) == [None, None, None, "wrong result", "wrong result"]
    with pytest.raises(CheckFailed, match=r"^output 3: relative error .* first bad element \[2, 7\] \(batch\)"):
        c.verify_batch(bad, a, b, bb, "batch", [f"output {i}" for i in range(5)])
    nan = out.clone()
    nan[1, 0, 0] = float("nan")
    with pytest.raises(CheckFailed, match=r"^output 1: NaN or Inf in the output \(batch\)"):
        c.verify_batch(nan, a, b, bb, "batch", [f"output {i}" for i in range(5)])


def test_a_shared_b_serves_every_output_of_a_batch():
    c = checker("kn", False)
    out, a, b, _ = operands(4, "kn", False)
    shared = b[:1]
    out = (a.float() @ shared.float()).half()
    c.verify_batch(out, a, shared, None, "batch", [f"output {i}" for i in range(4)])
    with pytest.raises(CheckFailed, match="^output 1"):  # each its own B: output 0's is the shared one
        c.verify_batch(out, a, b, None, "batch", [f"output {i}" for i in range(4)])


# ---- the checks and the timed buffers' verification end to end, on the CPU, with a CPU "kernel" ----------------

P = Problem(40, 24, 64, "kn", "f16", True)


def cpu_gemm(fault=None):
    """A launch(A, B, C, M, N, K, bias) computing on the CPU as a correct kernel does (fp32 sums, one rounding);
    fault(call, c) may then spoil the output of the call-th launch."""
    calls = []

    def launch(a, b, c, m, n, k, bias=None, residual=None):
        acc = a.float() @ (b.float() if P.b_layout == "kn" else b.float().t())
        c.copy_((acc + (0 if bias is None else bias.float())).half())
        if fault:
            fault(len(calls), c)
        calls.append(1)

    return launch


@pytest.fixture
def on_cpu(monkeypatch):
    from sandbox import check

    monkeypatch.setattr(check, "DEVICE", "cpu")


def test_the_full_checks_pass_a_correct_kernel_and_name_a_wrong_one(on_cpu):
    Checker(cpu_gemm(), P, seed=1).check_all(P)

    def drop_bias_row(call, c):  # the last row without its bias
        c[-1] -= 1.0

    with pytest.raises(CheckFailed, match="wrong result"):
        Checker(cpu_gemm(drop_bias_row), P, seed=1).check_all(P)


def replay(buffers, subject):
    buffers.before_replay()
    for i in range(subject.launches):
        if subject.overhead:
            subject.overhead(i)
        subject.launch(i)
    buffers.after_replay()


@pytest.mark.parametrize("mode", ["warm", "cold", "fresh", "honest"])
def test_every_timed_output_is_verified(on_cpu, mode):
    from sandbox.timed import TimedBuffers

    def timed(fault=None):
        checker = Checker(cpu_gemm(), P, seed=2)
        buffers = TimedBuffers(P, cpu_gemm(fault), 6, mode, checker)
        subject = buffers.subject()
        subject.overhead = None if mode == "cold" else subject.overhead  # no L2 to flush on the CPU
        for _ in range(2):
            replay(buffers, subject)

    timed()  # a correct kernel passes every replay

    def garbage(call, c):  # launch 9 (the second replay's fourth) writes finite garbage
        if call == 9:
            c.copy_(torch.full_like(c, 3.0))

    # cold and fresh: every launch's output is checked against its own inputs; warm: launch 3's output against
    # the first output of its operand set, bit for bit
    found = "differs from output 1" if mode == "warm" else "left a wrong result .*output 3"
    with pytest.raises(CheckFailed, match=found):
        timed(garbage)

    def skip(call, c):
        if call == 8:
            c.view(torch.int16).fill_(0x7E00)  # as if never written: the poison stays

    with pytest.raises(CheckFailed, match="left an output unwritten: output 2"):
        timed(skip)


def test_a_wide_timed_output_is_verified_on_sampled_columns(on_cpu):
    """Past VERIFY_BLOCKS blocks of 8 columns, each verification gathers B's columns of a random sample of blocks only
    (the cost no longer grows with N), and an output wrong in its last tile of columns is still found."""
    from sandbox.timed import VERIFY_BLOCKS, TimedBuffers

    wide = Problem(16, 1024, 64, "kn", "f16", True)

    def timed(fault=None):
        checker = Checker(cpu_gemm(), wide, seed=2)
        seen, real = [], checker.verify_batch

        def spy(out, a, b, bias, *rest):
            seen.append((out.shape[-1], b.shape[-1], bias.shape[-1]))
            real(out, a, b, bias, *rest)

        checker.verify_batch = spy
        buffers = TimedBuffers(wide, cpu_gemm(fault), 4, "cold", checker)
        subject = buffers.subject()
        subject.overhead = None  # no L2 to flush on the CPU
        for _ in range(2):
            replay(buffers, subject)
        return seen

    assert set(timed()) == {(8 * VERIFY_BLOCKS,) * 3}

    def last_tile(call, c):  # launch 5 (the second replay's second) wrong in its last 128 columns
        if call == 5:
            c[:, -128:] += 1.0

    with pytest.raises(CheckFailed, match="left a wrong result .*output 1"):
        timed(last_tile)


def test_the_honest_mode_refills_every_operand_of_every_launch(on_cpu):
    from sandbox.timed import Baseline, TimedBuffers

    buffers = TimedBuffers(P, cpu_gemm(), 6, "honest", Checker(cpu_gemm(), P, seed=2))
    assert buffers.b_sets == buffers.a_sets == buffers.outputs == 6  # a slot (and B) of its own a launch
    before = [t.bits.clone() for t in buffers.inputs]
    buffers.subject().overhead(3)  # before launch 3: the next launch's operands, slot 4's
    changed = [(t.bits != old).any(dim=1).tolist() for t, old in zip(buffers.inputs, before, strict=True)]
    assert changed == [[s == 4 for s in range(6)]] * 3  # A, B and the bias of slot 4, nothing else
    before = [t.bits.clone() for t in buffers.inputs]
    buffers.subject().overhead(5)  # the last launch: nothing after it to refill for
    assert all(torch.equal(t.bits, old) for t, old in zip(buffers.inputs, before, strict=True))
    buffers.before_replay()  # the first launch's operands: before the replay, outside the timed graph
    assert all(bool((t.bits != old).any(dim=1)[0]) for t, old in zip(buffers.inputs, before, strict=True))
    fresh = TimedBuffers(P, cpu_gemm(), 6, "fresh", Checker(cpu_gemm(), P, seed=2))
    assert fresh.b_sets == 1 and len(fresh.refilled(0)) == 2  # fresh: A and the bias only
    gated = Problem(8, 32, 64, "nk", "f16", True, "silu_mul")
    buffers = TimedBuffers(gated, Baseline(gated), 4, "honest")
    a, b, bias, _ = buffers.inputs_of(1)
    refilled = [t.data_ptr() for t, _ in buffers.refilled(1)]
    halves = buffers.launch_fn.halves
    halves = [h.data_ptr() for h in (*halves[b.data_ptr()], *halves[bias.data_ptr()])]
    assert refilled == [a.data_ptr(), *halves]  # the baseline reads the separate gate and up weights: those


def test_a_range_of_m_is_checked_at_its_ends_and_inside(on_cpu):
    """A kernel serving M 50-200 is checked at both ends, one row past each tile height, below a tile, at a ragged
    M and at a random one: a kernel wrong only where the last tile of rows holds one row is caught."""
    bucket = Problem(100, 24, 64, "kn", "f16", True, m_range=(50, 200))
    seen = []
    Checker(cpu_gemm(lambda call, c: seen.append(c.shape[0])), bucket, seed=3).check_all(bucket)
    assert {100, 50, 200, 65, 129, 193} <= set(seen) and any(m % 8 for m in seen if 50 <= m <= 200)
    assert Problem(100, 24, 64, "kn", "f16", True) != bucket  # the plain problem checks none of these
    plain = []
    Checker(cpu_gemm(lambda call, c: plain.append(c.shape[0])), P, seed=3).check_all(P)
    assert not {50, 65, 129, 193, 200} & set(plain)

    def one_row_past_a_tile(call, c):
        if c.shape[0] % 64 == 1 and c.shape[0] > 64:
            c[-1] += 1.0

    with pytest.raises(CheckFailed, match="M=65 N=24 K=64"):
        Checker(cpu_gemm(one_row_past_a_tile), bucket, seed=3).check_all(bucket)


@pytest.mark.parametrize("mode", ["fresh", "honest"])
def test_a_single_launch_a_replay_leaves_no_output_unwritten(on_cpu, mode):
    """A kernel so long (or refills so costly) that a replay holds one launch: the refilling modes keep two operand
    slots but only as many outputs as launches (the H200 rejected every candidate of a 1 x 152064 x 3584 bf16
    problem as 'output 1 unwritten' before)."""
    from sandbox.timed import TimedBuffers

    buffers = TimedBuffers(P, cpu_gemm(), 1, mode, Checker(cpu_gemm(), P, seed=2))
    assert buffers.a_sets == 2 and buffers.outputs == 1
    replay(buffers, buffers.subject())


def test_the_gated_baseline_splits_each_buffers_own_operands(on_cpu):
    """One baseline times several buffer sets in turn (the probes, then each mode's); a later operand may take a
    freed one's address, and must get its own halves, not those of the tensor that was there (a run's false
    rejections: a bias given a B's halves could not be added)."""
    from sandbox.timed import Baseline, TimedBuffers

    gated = Problem(8, 32, 64, "kn", "f16", True, "silu_mul")
    baseline = Baseline(gated)
    first = TimedBuffers(gated, baseline, 2, "warm")
    del first  # its operands' memory is free for the next set's
    second = TimedBuffers(gated, baseline, 2, "warm")
    operands = [t for s in range(second.a_sets) for t in second.inputs_of(s)[1:3]]
    assert set(second.launch_fn.halves) == {t.data_ptr() for t in operands}  # its own operands' halves, no other
    a, b, bias, _ = second.inputs_of(0)
    c = torch.empty(gated.m, gated.out_n, dtype=a.dtype)
    second.launch_fn(a, b, c, gated.m, gated.n, gated.k, bias)
    gate, up = (a.double() @ h.double() + hb.double()
                for h, hb in zip(split_gate_up(b, -1), split_gate_up(bias, -1), strict=True))
    assert torch.allclose(c.double(), torch.nn.functional.silu(gate) * up, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case, rejected", [
    # (warm, fresh) of the candidate, then of cuBLAS, in µs
    (((10.0, 30.0), (20.0, 21.0)), True),  # a result kept across launches: three times slower on new inputs
    (((10.0, 13.0), (20.0, 20.5)), True),  # 30% slower on new inputs where cuBLAS is not
    (((10.0, 12.0), (20.0, 20.5)), False),  # 20%: within FRESH_DROP
    (((10.0, 15.0), (20.0, 26.0)), False),  # both slower (the L2): the candidate by 50%, cuBLAS by 30%
    # session 41's false rejection: 8 x 4096 x 4096 + residual, the candidate's own time not rising on new inputs
    # while cuBLAS got faster (0.70x warm, 0.51x fresh)
    (((25.17, 24.34), (17.6, 12.4)), False),
    (((10.0, 13.0), (20.0, 14.0)), True),  # cuBLAS faster on new inputs, the candidate 30% slower: still rejected
])
def test_the_fresh_recheck_rejects_a_candidate_whose_own_time_rises_on_new_inputs(case, rejected):
    from sandbox.timed import not_reproducible

    def t(us):
        return Timing(us, us, us, 1)

    (warm, fresh), (cublas_warm, cublas_fresh) = case
    assert not_reproducible(t(warm), t(fresh), t(cublas_warm), t(cublas_fresh)) is rejected
