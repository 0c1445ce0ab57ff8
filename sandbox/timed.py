"""What is timed is what is checked: the buffers of timed graph replays, poisoned before each replay and verified
after it (GPU worker only).

A kernel whose work depends on when or how often it ran (a clock, a launch count, a memo in device memory) computes
honestly in the correctness checks; these buffers make that show in the timing itself:
- warm: launch i of a replay reads operand set i % 2 (two sets of different random values) and writes an output of its
  own (distinct outputs, up to a memory budget); values stay from replay to replay;
- cold: an L2 flush before each launch; each launch reads a set of its own (up to the budget), and every set gets new
  values before every replay, so nothing a kernel kept from an earlier launch matches: honest by construction;
- fresh (the re-check of a suspect): each launch's A is refilled with new random values inside the graph just before
  the launch (so it is in L2), B is shared; its time says what the warm time would be without any reuse;
- honest (the figure that ranks, past the first screen): every operand of each launch (A, B, the bias, R; for the
  baseline of a gated epilogue, its separate gate and up weights) refilled with new random values inside the graph,
  so no launch can reuse an earlier one's work; the refills' own time is subtracted. Each slot is refilled before
  the launch ahead of its own (the first before the replay), so that another launch's operands pass through the L2
  in between, as the warm rotation's do (docs/decisions.md, `honest-ranking`).
Before each replay every output is poisoned; after it: no guard region touched, no input changed, no poison left, the
first output of each set verified on sampled rows and columns against an fp64 reference and cuBLAS's error, the other
outputs of the set equal to it bit for bit (deterministic kernels) or verified likewise. cuBLAS is timed the same way on
sets of its own with other values: no buffer holds the product the candidate is timed on. Where the problem fuses an
epilogue, "cuBLAS" is what the model runs instead (`Baseline`): the GEMM (two, for gate and up) and PyTorch's
elementwise ops, all in the one graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from core.epilogue import GATE_BLOCK, activate, split_gate_up
from core.records import Problem, Timing
from sandbox import check
from sandbox.check import TORCH_DTYPE, Checker, CheckFailed, GuardedStack, same_bits
from sandbox.timing import L2Flush, Subject, graph_estimate_us, launches_for, measure

MEMORY_BUDGET = 6 << 30  # bytes of timing buffers per subject; beyond it launches share sets and outputs
FRESH_SLOTS = 64
NONDETERMINISTIC_SAMPLE = 16
VERIFY_BYTES = 1 << 30  # a verification batch's B columns, gathered and in fp64 (10 bytes an element), below this
VERIFY_BLOCKS = 64  # C's blocks of GATE_BLOCK (8) columns a timed output is verified on (drawn after each replay)
Launch = Callable[..., None]  # launch(A, B, C, M, N, K, bias, residual)


class Baseline:
    """What the user's model runs for the problem, into C: cuBLAS as the code calls it (torch.matmul, or F.linear
    with the bias fused, as addmm), then the epilogue's PyTorch ops in the dtype: the activation (in place), the
    residual add, or for a gated epilogue two GEMMs on the separate gate and up weights and act(gate) * up.
    `prepare(t)` splits a gated B or bias into its gate and up halves once, outside the timed graphs, kept by the
    operand's address: each set of timing buffers times a copy of its own (`for_buffers`), since a later set's
    operand may take a freed one's address."""

    def __init__(self, problem: Problem):
        self.p, self.epi = problem, problem.fused
        self.halves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def for_buffers(self) -> Baseline:
        return Baseline(self.p)

    def prepare(self, t: torch.Tensor | None) -> None:
        if self.epi.gated and t is not None and t.data_ptr() not in self.halves:
            dim = 0 if self.p.b_layout == "nk" and t.dim() == 2 else -1  # an N x K weight's rows
            self.halves[t.data_ptr()] = tuple(h.contiguous() for h in split_gate_up(t, dim))

    def _gemm(self, a, b, bias, out=None):
        b_kn = b if self.p.b_layout == "kn" else b.t()
        if bias is None:
            return torch.matmul(a, b_kn, out=out)
        return torch.addmm(bias, a, b_kn, out=out)

    def __call__(self, a, b, c, m, n, k, bias=None, residual=None):
        if self.epi.gated:
            self.prepare(b)
            self.prepare(bias)
            bg, bu = self.halves[b.data_ptr()]
            cg, cu = self.halves[bias.data_ptr()] if bias is not None else (None, None)
            gate, up = self._gemm(a, bg, cg), self._gemm(a, bu, cu)
            torch.mul(activate(gate, self.epi.activation, inplace=True), up, out=c)
        elif self.epi.residual:
            torch.add(self._gemm(a, b, bias), residual, out=c)
        else:
            self._gemm(a, b, bias, out=c)
            if self.epi.activation != "none":
                activate(c, self.epi.activation, inplace=True)


def cublas_launch(problem: Problem) -> Baseline:
    """The baseline a candidate is timed against: cuBLAS, and the epilogue's PyTorch ops where one is fused."""
    return Baseline(problem)


class TimedBuffers:
    """Operand sets and outputs for the timed launches of one subject, and what happens around each replay."""

    def __init__(self, problem: Problem, launch: Launch, launches: int, mode: str,
                 checker: Checker | None = None, flush: L2Flush | None = None):
        if isinstance(launch, Baseline):  # halves of these buffers' operands only
            launch = launch.for_buffers()
        self.p, self.launch_fn, self.launches, self.mode, self.checker = problem, launch, launches, mode, checker
        self.std = check.input_std(problem)
        self.flush = flush
        p, dtype = problem, TORCH_DTYPE[problem.dtype]
        residual = p.fused.residual
        set_bytes = 2 * (p.m * p.k + p.k * p.n + p.n + (p.m * p.n if residual else 0))
        out_bytes = 2 * p.m * p.out_n
        budget_sets = max(1, MEMORY_BUDGET // 2 // set_bytes)
        # warm: two sets, the least the rotation needs (more would push larger operands out of the L2); fresh and
        # honest: a slot per launch up to FRESH_SLOTS (every launch refills its slot, so slots may repeat); cold: a
        # set per launch
        refills = mode in ("fresh", "honest")
        sets = 2 if mode == "warm" else min(launches, budget_sets, FRESH_SLOTS) if refills else min(launches,
                                                                                                    budget_sets)
        sets = max(2, sets)
        # fresh, honest: an output per set, so each output's last write follows its set's last refill (and no more
        # outputs than launches: a long kernel may get a single launch a replay, and an output no launch writes
        # would stay poisoned)
        self.outputs = min(sets, launches) if refills else max(min(sets, launches),
                                                               min(launches, MEMORY_BUDGET // 2 // out_bytes))
        self.a_sets = sets
        self.b_sets = 1 if mode == "fresh" else sets
        # the operand set behind each output: that of the last launch writing it
        self.set_of = [(o + self.outputs * ((launches - 1 - o) // self.outputs)) % sets for o in range(self.outputs)]
        b_shape = (p.k, p.n) if p.b_layout == "kn" else (p.n, p.k)
        self.a = GuardedStack(p.m, p.k, dtype, self.a_sets)
        self.b = GuardedStack(*b_shape, dtype, self.b_sets)
        self.bias = GuardedStack(1, p.n, dtype, self.a_sets) if p.bias else None
        self.r = GuardedStack(p.m, p.n, dtype, self.a_sets) if residual else None  # R rotates with A
        self.c = GuardedStack(p.m, p.out_n, dtype, self.outputs)
        self.inputs = [t for t in (self.a, self.b, self.bias, self.r) if t is not None]
        self.snapshot: list[torch.Tensor] = []
        self.replays = 0
        self.randomise()
        if isinstance(launch, Baseline):  # gated: the gate and up halves, split before any graph
            for s in range(self.a_sets):
                for t in self.inputs_of(s)[1:3]:
                    launch.prepare(t)

    def randomise(self) -> None:
        for t in self.inputs:
            t.all.normal_(0.0, self.std if t is self.a or t is self.b else 1.0)
        if self.checker is not None:  # what the inputs were: a kernel must not change them
            self.snapshot = [t.bits.clone() for t in self.inputs]

    def inputs_of(self, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A, B, the bias and R (None without them) of operand set s (B is shared where it does not rotate)."""
        return (self.a[s], self.b[s % self.b_sets], None if self.bias is None else self.bias[s][0],
                None if self.r is None else self.r[s])

    def args(self, i: int) -> tuple:
        a, b, bias, r = self.inputs_of(i % self.a_sets)
        return a, b, self.c[i % self.outputs], self.p.m, self.p.n, self.p.k, bias, r

    def subject(self) -> Subject:
        overhead = None
        if self.mode == "cold":
            overhead = self.flush
        elif self.mode == "fresh":
            def overhead(i: int) -> None:  # new values for this launch's operands, written just before it
                self.refill(i % self.a_sets)
        elif self.mode == "honest":
            def overhead(i: int) -> None:  # new values for the next launch's operands (the first's: before_replay)
                if i + 1 < self.launches:
                    self.refill((i + 1) % self.a_sets)
        return Subject(lambda i: self.launch_fn(*self.args(i)), self.launches, overhead, self.before_replay,
                       self.after_replay)

    def refill(self, s: int) -> None:
        for t, std in self.refilled(s):
            t.normal_(0.0, std)

    def refilled(self, s: int) -> list[tuple[torch.Tensor, float]]:
        """What the fresh and honest modes refill before a launch on slot s, with each one's standard deviation:
        fresh A, the bias and R; honest every operand the launch reads (the gate and up halves the baseline of a
        gated epilogue reads in place of B and the bias)."""
        a, b, bias, r = self.inputs_of(s)
        if self.mode == "fresh":
            b = None
        elif isinstance(self.launch_fn, Baseline) and self.p.fused.gated:
            halves = [*self.launch_fn.halves[b.data_ptr()], *(self.launch_fn.halves[bias.data_ptr()]
                                                              if bias is not None else ())]
            return [(a, self.std)] + [(h, self.std if h.dim() == 2 else 1.0) for h in halves] + \
                ([(r, 1.0)] if r is not None else [])
        return [(t, std) for t, std in ((a, self.std), (b, self.std), (bias, 1.0), (r, 1.0)) if t is not None]

    def before_replay(self) -> None:
        if self.mode == "cold" and self.replays:
            self.randomise()
        if self.mode == "honest":
            self.refill(0)
        if self.checker is not None:
            self.c.poison()

    def after_replay(self) -> None:
        self.replays += 1
        if self.checker is not None:
            check.synchronize()
            self.verify()

    def verify(self) -> None:
        """Raises CheckFailed naming the first finding of this replay."""
        where = f"{self.mode} timing, replay {self.replays}"
        if not all(t.guards_intact() for t in (*self.inputs, self.c)):
            raise CheckFailed(f"out-of-bounds write during timing ({where})")
        if self.mode not in ("fresh", "honest") and not all(same_bits(t.bits, s) for t, s in zip(self.inputs,
                                                                                                  self.snapshot,
                                                                                                  strict=True)):
            raise CheckFailed(f"the kernel modified its inputs during timing ({where})")
        unwritten = (self.c.poisoned() >= 0).nonzero()
        if len(unwritten):
            o = int(unwritten[0])
            first = int(self.c.poisoned()[o])
            raise CheckFailed(f"the timed launches left an output unwritten: output {o}, C[{first // self.p.out_n},"
                              f"{first % self.p.out_n}] still holds the poison ({where})")
        first_of: dict[int, int] = {}
        for o, s in enumerate(self.set_of):
            first_of.setdefault(s, o)
        checked = list(first_of.values())
        if not self.checker.deterministic:  # no bits to compare with: verify a sample of the other outputs too
            checked += [int(o) for o in torch.randperm(self.outputs, generator=self.checker.gen,
                                                        device=check.DEVICE)[:NONDETERMINISTIC_SAMPLE]]
        self._verify_outputs(checked, where)
        if not self.checker.deterministic:
            return
        twin = torch.tensor([first_of[s] for s in self.set_of], device=check.DEVICE)
        differs = (self.c.bits != self.c.bits[twin]).any(dim=1).nonzero()
        if len(differs):
            o = int(differs[0])
            raise CheckFailed(f"the timed launches left a wrong result: output {o} differs from output "
                              f"{int(twin[o])} on the same inputs ({where})")

    def _verify_outputs(self, outputs: list[int], where: str) -> None:
        """Each of these outputs against its own operands (fp64 reference and cuBLAS's error) on a random sample of its
        rows and of C's 8-column blocks (a batch's outputs share the blocks, drawn after the replay), in batches whose
        B columns, gathered and in fp64, stay within VERIFY_BYTES."""
        p = self.p
        out_cols, gemm_cols = self._sample_columns()
        per_batch = max(1, VERIFY_BYTES // (10 * p.k * len(gemm_cols)))
        for start in range(0, len(outputs), per_batch):
            part = outputs[start:start + per_batch]
            if start:
                out_cols, gemm_cols = self._sample_columns()
            out = torch.tensor(part, device=check.DEVICE)
            sets = torch.tensor([self.set_of[o] for o in part], device=check.DEVICE)
            b_sets = sets[:1] if self.b_sets == 1 else sets
            b = self.b.all[b_sets % self.b_sets]
            b = b[:, :, gemm_cols] if p.b_layout == "kn" else b[:, gemm_cols, :]
            bias = None if self.bias is None else self.bias.all[sets, 0][:, gemm_cols]
            rows = self.checker.sample_rows(p.m, len(part))
            at = (rows[:, :, None], out_cols[None, None, :])  # only the sampled elements are gathered
            self.checker.verify_batch(
                self.c.all[(out[:, None, None], *at)], self.a.all[sets[:, None], rows], b, bias,
                f"M={p.m} N={p.n} K={p.k}, {rows.shape[1]} sampled rows and {len(out_cols)} sampled columns of each",
                [f"the timed launches left a wrong result ({where}, output {o})" for o in part],
                None if self.r is None else self.r.all[(sets[:, None, None], *at)])

    def _sample_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A random sample of VERIFY_BLOCKS of C's blocks of GATE_BLOCK columns (all of them where C has fewer): C's
        columns, and the GEMM columns behind them (gated: each block's gate and up columns)."""
        blocks = self.p.out_n // GATE_BLOCK
        pick = torch.randperm(blocks, generator=self.checker.gen, device=check.DEVICE)[:VERIFY_BLOCKS].sort().values
        width = 2 * GATE_BLOCK if self.p.fused.gated else GATE_BLOCK
        out_cols = (pick[:, None] * GATE_BLOCK + torch.arange(GATE_BLOCK, device=check.DEVICE)).flatten()
        return out_cols, (pick[:, None] * width + torch.arange(width, device=check.DEVICE)).flatten()


# A candidate's cold time may exceed its warm time by cuBLAS's own gap plus this much before its warm time is
# suspected of reuse: a share of cuBLAS's cold time, and a fixed slack (launch and flush noise).
GAP_SLACK_SHARE, GAP_SLACK_US = 0.10, 1.0
# The re-check rejects a candidate whose speed-up over cuBLAS on fresh inputs is this much below its warm one.
FRESH_DROP = 1.25


def not_reproducible(warm: Timing, fresh: Timing, cublas_warm: Timing, cublas_fresh: Timing) -> bool:
    """The candidate's speed-up over cuBLAS falls by more than FRESH_DROP when every launch gets new inputs, and its
    own time rises by that much over what cuBLAS's does, or over its warm time where cuBLAS got faster on fresh
    inputs (docs/decisions.md `fresh-drop`: a kernel that reuses nothing keeps its own time)."""
    own = fresh.median_us / warm.median_us
    return own > FRESH_DROP * max(cublas_fresh.median_us / cublas_warm.median_us, 1.0)


def suspect(warm: Timing, cold: Timing, cublas_warm: Timing, cublas_cold: Timing) -> bool:
    """Warm far faster than cold, beyond what the L2 explains for cuBLAS on the same problem (both read the same
    operands): the warm launches may be reusing work."""
    gap, cublas_gap = cold.median_us - warm.median_us, cublas_cold.median_us - cublas_warm.median_us
    return gap > max(cublas_gap, 0.0) + GAP_SLACK_SHARE * cublas_cold.median_us + GAP_SLACK_US


def time_subjects(problem: Problem, launches: dict[str, Launch], checker: Checker | None, flush: L2Flush,
                  modes: tuple[str, ...] = ("warm", "cold")) -> dict[str, dict[str, Timing]]:
    """Per mode, the timing of each subject ("candidate", verified by `checker`, and "cublas")."""
    est: dict[str, float] = {}
    for name, fn in launches.items():  # a per-launch estimate on two sets, to size the graphs
        probe = TimedBuffers(problem, fn, 2, "warm")
        est[name] = graph_estimate_us(lambda probe=probe: probe.launch_fn(*probe.args(0)))
        del probe
    flush_us = graph_estimate_us(flush)
    out = {}
    for mode in modes:
        extra = dict.fromkeys(launches, flush_us if mode == "cold" else 0.0)
        if mode == "honest":  # each launch's refills, timed alone (a probe of two slots)
            for name, fn in launches.items():
                probe = TimedBuffers(problem, fn, 2, mode)
                refill = probe.subject().overhead
                extra[name] = graph_estimate_us(lambda refill=refill: refill(0))
                del probe, refill
        buffers = {name: TimedBuffers(problem, fn, launches_for(est[name] + extra[name]), mode,
                                      checker if name == "candidate" else None, flush)
                   for name, fn in launches.items()}
        out[mode] = measure({name: b.subject() for name, b in buffers.items()}, cupti=mode == "warm")
        del buffers
    return out


def time_candidate(problem: Problem, kernel: Launch, checker: Checker, flush: L2Flush,
                   honest: bool = False, honest_only: bool = False) -> dict[str, Timing | None]:
    """Warm and cold timings of the candidate and cuBLAS (and with `honest` the honest ones, which then rank it);
    where the candidate's warm time is suspect, the fresh re-check too, and CheckFailed if its speed-up does not
    hold on fresh inputs. With `honest_only` (a re-measurement of a candidate the first screen passed) the honest
    timings alone."""
    launches = {"candidate": kernel, "cublas": cublas_launch(problem)}
    if honest_only:
        t = time_subjects(problem, launches, checker, flush, ("honest",))["honest"]
        return dict(honest=t["candidate"], cublas_honest=t["cublas"])
    t = time_subjects(problem, launches, checker, flush, ("warm", "cold", "honest") if honest else ("warm", "cold"))
    warm, cold = t["warm"], t["cold"]
    result = dict(warm=warm["candidate"], cold=cold["candidate"], cublas_warm=warm["cublas"],
                  cublas_cold=cold["cublas"], fresh=None, cublas_fresh=None)
    if honest:
        result.update(honest=t["honest"]["candidate"], cublas_honest=t["honest"]["cublas"])
    if suspect(warm["candidate"], cold["candidate"], warm["cublas"], cold["cublas"]):
        fresh = time_subjects(problem, launches, checker, flush, ("fresh",))["fresh"]
        result.update(fresh=fresh["candidate"], cublas_fresh=fresh["cublas"])
        warm_ratio = warm["cublas"].median_us / warm["candidate"].median_us
        fresh_ratio = fresh["cublas"].median_us / fresh["candidate"].median_us
        if not_reproducible(warm["candidate"], fresh["candidate"], warm["cublas"], fresh["cublas"]):
            raise CheckFailed(f"warm time not reproducible on fresh inputs: {warm_ratio:.2f}x cuBLAS warm "
                              f"({warm['candidate'].median_us:.2f} us), {fresh_ratio:.2f}x when each launch gets new "
                              f"inputs ({fresh['candidate'].median_us:.2f} us); cold {cold['candidate'].median_us:.2f}"
                              f" us: the timed launches reuse earlier work")
    return result
