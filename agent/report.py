"""What the user reads after a run: run lists, run summaries, the model's calls and candidate diffs (rich
renderables). The live progress view is agent/view.py."""

from __future__ import annotations

import difflib
import json
import shlex
from pathlib import Path

from rich.console import Group
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from agent import buckets
from agent.proposers.patch import patch_text
from agent.store import DEFAULT_RUNS_DIR, RunStore
from agent.view import fmt_ratio, fmt_us
from core.device import DeviceFacts
from core.records import Problem, ProposalFate, Status
from core.roofline import floor_pct


def runs_table(stores: list[RunStore]) -> Table:
    t = Table(title="runs")
    for col in ("run", "shapes", "candidates", "passed checks", "arch", "state"):
        t.add_column(col)
    for s in stores:
        counts = s.failure_counts()
        passed = f"- (compile only: {counts.get('skipped', 0)} compiled)" if s.compile_only else \
            str(counts.get("ok", 0))
        t.add_row(s.run_id, str(len(s.problems())), str(sum(counts.values())), passed,
                  str(s.get_meta("arch", "?")), str(s.get_meta("state", "?")))
    return t


LEADERS_SHOWN = 3  # candidates `show` lists per shape


def runs_dir_option(store: RunStore) -> str:
    """` --runs-dir DIR` where the run is not under the default folder, else nothing: commands for it need it."""
    parent = store.folder.parent
    return "" if parent == Path(DEFAULT_RUNS_DIR) else f" --runs-dir {shlex.quote(str(parent))}"


def resume_command(store: RunStore) -> str:
    return f"python -m agent run --resume {store.run_id}{runs_dir_option(store)}"


def next_steps(store: RunStore) -> str:
    """The commands that work for this run next."""
    r, opt = store.run_id, runs_dir_option(store)
    if store.compile_only:
        return (f"run {r} compiled its candidates and ran nothing: no kernel was checked or timed. "
                f"python -m agent show {r}{opt} | diff {r} A B{opt} (candidate ids from show); on a GPU machine, "
                "run the shapes without --compile-only")
    if not any(store.winner(p) for p in store.problems()):
        return f"run {r}: no candidate passed the checks. python -m agent show {r}{opt} (failures by kind)"
    return f"run {r}: python -m agent show {r}{opt} | diff {r} baseline best{opt} | export {r}{opt}"


def show_run(store: RunStore) -> Group:
    cfg = store.get_meta("config", {})
    t = Table(title=f"run {store.run_id} ({store.get_meta('state', '?')}, arch {store.get_meta('arch', '?')}, "
                    f"proposer {cfg.get('proposer', '?')})")
    for col in ("shape", "B", "dtype", "tried", "failures", "best", "family", "µs", "cuBLAS µs", "ratio (median)",
                "cold ratio", "cold÷warm ours/cuBLAS", "% floor"):
        t.add_column(col)
    profiles = []
    facts = DeviceFacts.from_dict(store.get_meta("device"))  # the H200 stand-in where none was recorded
    for p in store.problems():
        counts = store.failure_counts(p)
        fails = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("ok", "skipped")) or "-"
        win = store.winner(p)
        dtype = p.dtype + (" +bias" if p.bias else "") + (f" {p.epilogue}" if p.epilogue != "none" else "")
        if win is None:
            t.add_row(p.mnk, p.b_layout, dtype, str(sum(counts.values())), fails, *["-"] * 8)
            continue
        c, r, ratio = win.candidate, win.result, win.speedup
        cold = r.cublas_cold.median_us / r.cold.median_us if r.cold and r.cublas_cold else None
        cub_cw = r.cublas_cold.median_us / r.cublas_warm.median_us if r.cublas_cold and r.cublas_warm else None
        cold_warm = f"{r.cold_over_warm:.2f}/{cub_cw:.2f}" if r.cold_over_warm and cub_cw else "-"
        if r.fresh:
            cold_warm += " (re-checked)"
        floor = floor_pct(p, facts, r.time_us)
        if (prof := store.profile(c.id)) is not None:
            text = prof.summary if prof.ok else f"profiling failed: {(prof.error.splitlines() or ['?'])[-1][:120]}"
            profiles.append(Text(f"profile {p.mnk} {p.b_layout} {c.id}: {text}"))  # Text: no markup in ncu's words
        t.add_row(p.mnk, p.b_layout, dtype, str(sum(counts.values())), fails, c.id, c.family, fmt_us(r.time_us),
                  fmt_us(r.ranked[1].median_us), fmt_ratio(ratio), fmt_ratio(cold), cold_warm, f"{floor:.0f}%")
    device = store.get_meta("device")
    parts = [t, *bucket_lines(store), *alike_lines(store), *profiles, candidates_table(store)]
    if store.compile_only:
        parts.append("compile-only run: candidates were rendered and compiled, not run; nothing was checked or timed")
    stats = store.get_meta("proposer_stats") or {}
    if stats:
        parts.append("proposer: " + ", ".join(f"{k} {json.dumps(v)}" for k, v in stats.items() if v not in ({}, None)))
    if calls := store.model_calls():
        failed = sum(bool(c.error) for c in calls)
        parts.append(f"LLM: {len(calls)} call{'s' * (len(calls) != 1)}" + (f" ({failed} failed)" if failed else "")
                     + f", {sum(c.prompt_tokens for c in calls):,} prompt and "
                     f"{sum(c.completion_tokens for c in calls):,} completion tokens; python -m agent show "
                     f"{store.run_id} --llm{runs_dir_option(store)} lists them")
    if device:
        sw = device.get("software", device)  # runs from before DeviceFacts kept versions at the top level
        parts.append(f"device: {device.get('name')} (driver {sw.get('driver', '?')}, torch {sw.get('torch')}"
                     f", SM clock {sw.get('sm_clock_mhz', '?')} MHz)")
    return Group(*parts)


def bucket_lines(store: RunStore) -> list[Text]:
    """Per bucket of M, what serves it: the kernel at least as fast as cuBLAS at its probe M (its ratios there), or
    cuBLAS."""
    lines = []
    for p in store.problems():
        if p.m_range is None or store.winner(p) is None or store.compile_only:
            continue
        served = buckets.served(store, p)
        lines.append(Text(f"bucket {p.mnk} {p.b_layout}: " + (f"kernel {served.note(p)}" if served else "cuBLAS (no "
                          "leader at least as fast as cuBLAS at two neighbouring probe M)")))
    return lines


ALIKE_COUNT, ALIKE_SPREAD = 3, 1.03  # `alike_lines`: how many of the fastest candidates, how close together


def alike_lines(store: RunStore) -> list[Text]:
    """A line for each shape whose winner is slower than its baseline while its fastest ALIKE_COUNT candidates (of
    other settings; warm times, which every checked candidate has) ran within ALIKE_SPREAD of each other: what
    costs there is likely the same in every setting (the epilogue's code, how an operand is read), not the tile,
    so more candidates of the same kinds will not help."""
    lines = []
    for p in [] if store.compile_only else store.problems():
        win = store.winner(p)
        if win is None or win.speedup >= 1.0:
            continue
        times = sorted(r.warm.median_us for _, r in store.results(p) if r.status is Status.OK and r.warm)[:ALIKE_COUNT]
        if len(times) == ALIKE_COUNT and times[-1] <= ALIKE_SPREAD * times[0]:
            lines.append(Text(f"alike {p.key}: its {ALIKE_COUNT} fastest candidates ran within "
                              f"{100 * (times[-1] / times[0] - 1):.1f}% of each other, all slower than "
                              f"{p.fused.baseline} ({win.speedup:.3f}x): the cost is likely in what every setting "
                              "shares (the epilogue, an operand's reads), not the tile"))
    return lines


def candidates_table(store: RunStore) -> Table:
    """Each shape's leading candidates (by median speed-up; in a compile-only run, the first compiled), with the ids
    `diff` takes."""
    t = Table(title="leading candidates per shape (the ids diff takes)")
    for col in ("shape", "candidate", "family", "origin", "status", "µs", "ratio (median)"):
        t.add_column(col)
    for p in store.problems():
        shown = store.leaders(p)[:LEADERS_SHOWN] or store.results(p)[:LEADERS_SHOWN]
        for c, r in shown:
            ok = r.status is Status.OK
            t.add_row(p.key, c.id, c.family, c.origin, r.status.value, fmt_us(r.time_us) if ok else "-",
                      fmt_ratio(store.median_speedup(c.id)) if ok else "-")
    return t


def model_calls_view(store: RunStore) -> Group:
    """Each request to the model: its tokens, what its prompt left out, and per proposal what it was and what
    became of it (accepted as a candidate, with that candidate's status once evaluated; a duplicate; refused)."""
    calls = store.model_calls()
    if not calls:
        return Group(Text(f"run {store.run_id} made no LLM calls"))
    t = Table(title=f"LLM calls of run {store.run_id}")
    for col in ("#", "shape", "call", "tokens in / out", "proposal", "fate", "status"):
        t.add_column(col)
    notes: list[Text] = []
    for i, call in enumerate(calls, 1):
        tokens = f"{call.prompt_tokens:,} / {call.completion_tokens:,}" + (" (est.)" if call.tokens_estimated else "")
        head = [str(i), call.problem_key, call.purpose, tokens]
        rows = [(_proposal_cell(f), _fate_cell(f), _status_cell(store, f)) for f in call.proposals]
        if call.error:
            rows.append((Text("-"), Text(call.error), Text("")))
        for j, row in enumerate(rows or [(Text("-"), Text("no proposals"), Text(""))]):
            t.add_row(*(head if j == 0 else [""] * len(head)), *row)
        notes += [Text(f"call {i} left out: {what}") for what in call.left_out]
    total_in, total_out = sum(c.prompt_tokens for c in calls), sum(c.completion_tokens for c in calls)
    summary = Text(f"{len(calls)} call{'s' * (len(calls) != 1)}, {total_in:,} prompt and {total_out:,} completion "
                   "tokens")
    return Group(t, summary, *notes)


def _proposal_cell(f: ProposalFate) -> Text:
    return Text(f"{f.kind} {f.family}" + (f" on {f.base}" if f.base else ""))


def _fate_cell(f: ProposalFate) -> Text:
    if f.outcome == "refused":
        return Text(f"refused: {f.reason}")
    return Text(f"accepted as {f.candidate_id}" if f.outcome == "accepted" else f"duplicate of {f.candidate_id}")


def _status_cell(store: RunStore, f: ProposalFate) -> Text:
    if f.candidate_id is None:
        return Text("")
    r = store.result(f.candidate_id)
    if r is None:
        return Text("not tried")
    return Text(r.status.value + (f" {fmt_ratio(r.speedup)}" if r.speedup else ""))


def resolve_candidate(store: RunStore, ref: str, problem: Problem | None = None) -> str:
    """A candidate id from an id (or unique prefix), 'best' or 'baseline' (the first one tried)."""
    problems = [problem] if problem else store.problems()
    if ref == "best" and store.compile_only:
        raise ValueError(f"run {store.run_id} is compile-only: nothing was checked, so there is no best; name "
                         "candidate ids (python -m agent show lists them)")
    if ref in ("best", "baseline"):
        if len(problems) != 1:
            raise ValueError(f"'{ref}' needs one shape; this run has {len(problems)}: pass --shape")
        if ref == "best":
            win = store.winner(problems[0])
            if win is None:
                raise ValueError(f"no candidate passed its checks for {problems[0].key}")
            return win.candidate.id
        cands = store.candidates(problems[0])
        if not cands:
            raise ValueError(f"no candidate for {problems[0].key}")
        return cands[0].id
    ids = [c.id for c in store.candidates() if c.id.startswith(ref)]
    if len(ids) != 1:
        raise ValueError(f"no candidate {ref!r} in run {store.run_id}" if not ids else f"{ref!r} is ambiguous")
    return ids[0]


def diff_view(store: RunStore, a: str, b: str) -> Group:
    sides = []
    for cid in (a, b):
        build = store.build(cid)
        sides.append((store.candidate(cid), build.source if build else "", store.result(cid)))
    (ca, sa, ra), (cb, sb, rb) = sides
    t = Table(title="candidates")
    t.add_column("")
    t.add_column(f"A {a}")
    t.add_column(f"B {b}")
    keys = list(dict.fromkeys([*ca.params, *cb.params]))
    t.add_row("family", ca.family, cb.family)
    t.add_row("origin", ca.origin, cb.origin)
    t.add_row("kind", ca.kind, cb.kind)
    if ca.patch or cb.patch:
        t.add_row("base", ca.patch.base if ca.patch else "-", cb.patch.base if cb.patch else "-")
    for k in keys:
        va, vb = ca.params.get(k), cb.params.get(k)
        mark = "" if va == vb else " *"
        t.add_row(k + mark, json.dumps(va), json.dumps(vb))
    for label, get in (("status", lambda r: r.status.value), ("µs warm", lambda r: fmt_us(r.time_us)),
                       ("ratio", lambda r: fmt_ratio(r.speedup)), ("reason", lambda r: Text(r.reason))):
        t.add_row(label, get(ra) if ra else "-", get(rb) if rb else "-")
    parts: list = [t]
    for side, cid, c in (("A", a, ca), ("B", b, cb)):
        if c.patch:  # what the model wrote, before the rendered sources' diff shows what it did
            n = len(c.patch.edits)
            parts += [Text(f"patch of {side} {cid} ({n} edit{'s' * (n != 1)} of its base's Jinja template):"),
                      _wrapped_diff(patch_text(c.patch))]
    diff = "".join(difflib.unified_diff(sa.splitlines(True), sb.splitlines(True), f"A/{a}.cu", f"B/{b}.cu"))
    parts += [Text("rendered sources:"), _wrapped_diff(diff or "(sources identical)\n")]
    return Group(*parts)


def _wrapped_diff(text: str) -> Syntax:
    """Long lines wrap instead of being cut at the console's width."""
    return Syntax(text, "diff", theme="ansi_dark", line_numbers=False, word_wrap=True)
