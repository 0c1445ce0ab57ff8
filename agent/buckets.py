"""Buckets of M: how `run` splits a range of M into buckets, the M each bucket is searched at, the measured
neighbour whose leaders seed its search and its candidate budget, its re-timing at probe M, and which kernel
serves which of its M (its winner where that was at least as fast as cuBLAS, else cuBLAS).

The ladder: bucket upper ends at SERVING_LADDER's sizes up to 512, then steps of at most 1.5x in multiples of 64
(768, 1152, 1728, 2560, 3840, ...). A range lo-hi becomes the buckets between consecutive ladder points inside it:
1-512 is 18 buckets (1, 2, 3-4, 5-8, 9-16, 17-24, 25-32, 33-48, 49-64, 65-96, 97-128, 129-160, 161-192, 193-256,
257-320, 321-384, 385-448, 449-512). A bucket is a Problem whose m_range is its ends and whose m is its middle
(`representative`): searched and timed there, checked at its ends and at M inside (sandbox.check.edge_shapes),
and re-timed at its probe M once its winner is known (EndChecks): its ends and PROBES points in between, since
cuBLAS changes kernels at M values of its own, inside a bucket too. The kernel serves the stretches between
consecutive probe M where it was at least as fast as cuBLAS at both (`spans`); cuBLAS serves the rest.

Search cost: the first bucket of a series searched gets the run's --max-candidates; each later one starts from
its nearest searched neighbour's SEEDS best candidates and gets `budget()` candidates in all (16 -> 5), so 1-512
costs about 16 + 17 x 5 candidates plus up to five probe timings a bucket, not 18 x 16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from core.records import Candidate, EvalJob, EvalResult, Problem, Status

SERVING_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
STEP_BEYOND = 1.5  # beyond the ladder: each bucket's upper end at most this times the last one's
ROUND_BEYOND = 64  # ... in multiples of this many rows
SEEDS = 3  # the neighbour's best candidates tried first in a bucket
END_TRIES = 2  # leaders re-timed at a bucket's probe M, in order, until one serves all of it
PROBES = 3  # M re-timed inside a bucket besides its ends: at its quarters


def ladder_after(m: int) -> int:
    """The first ladder point above m."""
    for point in SERVING_LADDER:
        if point > m:
            return point
    point = SERVING_LADDER[-1]
    while point <= m:
        point = max(point + ROUND_BEYOND, int(point * STEP_BEYOND) // ROUND_BEYOND * ROUND_BEYOND)
    return point


def split(lo: int, hi: int) -> list[tuple[int, int]]:
    """The buckets (lo_i, hi_i) of the range lo-hi: between consecutive ladder points inside it, the range's own ends
    at the outside."""
    out = []
    while lo <= hi:
        top = ladder_after(lo - 1)
        out.append((lo, min(hi, top)))
        lo = min(hi, top) + 1
    return out


def representative(lo: int, hi: int) -> int:
    """The M a bucket (or a range) is searched and timed at: its middle, rounded up."""
    return (lo + hi + 1) // 2


def series(p: Problem) -> Problem:
    """What a problem is apart from its M (buckets of one series share N, K, layout, dtype, bias, ...)."""
    return dataclasses.replace(p, m=1, m_range=None)


def bucket(p: Problem, lo: int, hi: int) -> Problem:
    return dataclasses.replace(p, m=representative(lo, hi), m_range=(lo, hi))


def plan(problems: list[Problem]) -> list[Problem]:
    """The problems a run searches: each problem of one M as it is; the ranges of a series merged where they
    overlap or touch, then split into buckets (in the place of the series' first range, lowest M first)."""
    ranges: dict[Problem, list[tuple[int, int]]] = {}
    for p in problems:
        if p.m_range:
            ranges.setdefault(series(p), []).append(p.m_range)
    out, placed = [], set()
    for p in problems:
        if not p.m_range:
            out.append(p)
            continue
        s = series(p)
        if s in placed:
            continue
        placed.add(s)
        merged: list[list[int]] = []
        for lo, hi in sorted(ranges[s]):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        out += [bucket(s, a, b) for lo, hi in merged for a, b in split(lo, hi)]
    return list(dict.fromkeys(out))


def budget(max_candidates: int, seeded: bool) -> int:
    """Candidates for a bucket: the run's per-shape count, or, where a measured neighbour seeds it, its seeds and
    two more (at least a quarter of the run's count)."""
    return max_candidates if not seeded else min(max_candidates, max(SEEDS + 2, -(-max_candidates // 4)))


def neighbour(store, b: Problem) -> Problem | None:
    """The bucket of the same series, searched and with a candidate that passed, nearest to `b` in M (the lower on
    a tie); None where there is none."""
    s = series(b)
    near = [p for p in store.problems() if p.m_range and p != b and series(p) == s and store.leaders(p)]
    return min(near, key=lambda p: (abs(p.m - b.m), p.m), default=None)


def seeds(store, b: Problem) -> list[Candidate]:
    """The nearest searched neighbour's best SEEDS candidates (by median speed-up), for bucket `b`."""
    near = neighbour(store, b) if b.m_range else None
    if near is None:
        return []
    return [dataclasses.replace(c, problem=b, rationale=f"leader of the neighbouring bucket {near.mnk}")
            for c, _ in store.leaders(near)[:SEEDS]]


def probe_ms(b: Problem) -> list[int]:
    """The M a bucket's leaders are re-timed at: its ends and its quarters (fewer where the bucket is narrow)."""
    lo, hi = b.m_span
    return sorted({lo, hi} | {lo + round((hi - lo) * i / (PROBES + 1)) for i in range(1, PROBES + 1)})


def probe_problems(b: Problem) -> list[Problem]:
    """The bucket's probe M as problems of one M each (one where the bucket is a single M)."""
    return [dataclasses.replace(b, m=m, m_range=None) for m in probe_ms(b)]


def passes(r: EvalResult | None) -> bool:
    return r is not None and r.status is Status.OK and (r.speedup or 0.0) >= 1.0


def spans(b: Problem, timed: dict[int, EvalResult]) -> list[tuple[int, int]]:
    """The stretches of the bucket a kernel serves: from one probe M to the next where it was at least as fast as
    cuBLAS at both (a bucket of one M: that M where it passed). None where it failed a check at any probe M (wrong
    there, it is trusted nowhere in the bucket). Probes not timed (a run from before interior probes) are skipped;
    both ends must have been timed. Empty: cuBLAS serves the bucket."""
    lo, hi = b.m_span
    if lo not in timed or hi not in timed or any(r.status is not Status.OK for r in timed.values()):
        return []
    ms = [m for m in probe_ms(b) if m in timed]
    if len(ms) == 1:
        return [(lo, lo)] if passes(timed[lo]) else []
    out: list[tuple[int, int]] = []
    for a, z in zip(ms, ms[1:], strict=False):
        if passes(timed[a]) and passes(timed[z]):
            out = out[:-1] + [(out[-1][0], z)] if out and out[-1][1] == a else out + [(a, z)]
    return out


def rows(pieces: list[tuple[int, int]]) -> int:
    return sum(z - a + 1 for a, z in pieces)


@dataclass(frozen=True)
class Served:
    """The kernel that serves a bucket: a candidate, its median speed-up at the representative M, its results at
    the bucket's probe M (M -> result) and the stretches of the bucket it serves (`spans`)."""

    candidate: Candidate
    result: EvalResult
    speedup: float
    ends: dict[int, EvalResult]
    pieces: tuple[tuple[int, int], ...]

    def note(self, b: Problem) -> str:
        at = ", ".join(f"{r.speedup:.3f}x at M={m}" if r.speedup else f"{r.status.value} at M={m}"
                       for m, r in sorted(self.ends.items()))
        part = "" if list(self.pieces) == [b.m_span] else \
            "; serves M " + ", ".join(f"{a}-{z}" for a, z in self.pieces) + ", cuBLAS the rest"
        return f"{self.speedup:.3f}x at M={b.m}, {at} ({self.candidate.id}){part}"

    def serves(self, m: int) -> bool:
        return any(a <= m <= z for a, z in self.pieces)


def served(store, b: Problem) -> Served | None:
    """The candidate serving bucket `b`: of the winner and the leaders re-timed at its probe M, the one serving the
    most of it (the winner first on a tie); None where none serves any of it (cuBLAS)."""
    win = store.winner(b)
    if win is None:
        return None
    timed = store.bucket_ends(b)
    order = [(win.candidate, win.result)] + [cr for cr in store.leaders(b) if cr[0].id != win.candidate.id]
    best = max(((c, r, spans(b, timed.get(c.id, {}))) for c, r in order), key=lambda x: rows(x[2]),
               default=None)
    if best is None or not best[2]:
        return None
    c, r, pieces = best
    return Served(c, r, store.median_speedup(c.id), timed[c.id], tuple(pieces))


def serving(store, b: Problem, m: int) -> Served | None:
    """The bucket's served kernel where it serves M (else None: cuBLAS runs that M)."""
    s = served(store, b)
    return s if s is not None and s.serves(m) else None


def covering(store, p: Problem) -> Problem | None:
    """The run's bucket whose range holds p's M (p of one M, the same series), or None."""
    s = series(p)
    return next((b for b in store.problems() if b.m_range and series(b) == s
                 and b.m_range[0] <= p.m <= b.m_range[1]), None)


class EndChecks:
    """A searched bucket's leaders (winner first, at most END_TRIES), each re-checked and re-timed next to cuBLAS at
    the bucket's probe M (timed honestly: this decides what ships), until one is at least as fast as cuBLAS at every
    one; probes timed before (a resumed run) are not timed again."""

    def __init__(self, store, b: Problem, timeout_s: float):
        self.store, self.bucket, self.timeout_s = store, b, timeout_s
        win = store.winner(b)
        leaders = [c for c, _ in store.leaders(b)]
        self.todo = ([win.candidate] if win else []) + [c for c in leaders if not win or c.id != win.candidate.id]
        self.todo = self.todo[:END_TRIES]
        self.verdict: Candidate | None = None
        self.settled = False

    def next_jobs(self) -> list[EvalJob]:
        """The next leader's probe timings still to run; empty once a leader passed or none is left."""
        while self.todo:
            c = self.todo[0]
            done = self.store.bucket_ends(self.bucket).get(c.id, {})
            missing = [p for p in probe_problems(self.bucket) if p.m not in done]
            if missing:
                build = self.store.build(c.id)
                return [EvalJob.built(c.id, p, c.family, c.params, build, timeout_s=self.timeout_s, honest=True)
                        for p in missing]
            self.todo.pop(0)
            pieces = spans(self.bucket, done)
            if pieces == [self.bucket.m_span]:
                self.verdict, self.todo = c, []
                self.store.event("bucket", f"{self.bucket.key}: {c.id} at least as fast as cuBLAS at every probe M")
                return []
            share = ", ".join(f"{a}-{z}" for a, z in pieces) or "none"
            self.store.event("bucket", f"{self.bucket.key}: {c.id} slower than cuBLAS or failed at a probe M "
                                       f"(would serve M {share})")
        if self.verdict is None and not self.settled:
            self.store.event("bucket", f"{self.bucket.key}: no leader at least as fast as cuBLAS at every probe M: "
                                       "the leader serving most of it serves its share, cuBLAS the rest")
        self.settled = True
        return []

    def record(self, job: EvalJob, r: EvalResult) -> None:
        self.store.add_bucket_end(self.bucket, job.candidate_id, job.problem.m, r)
