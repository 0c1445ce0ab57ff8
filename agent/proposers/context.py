"""What the next LLM prompt sees of a search: a bounded, JSON-ready view of a SearchState.

The bandit decides what goes in: the best candidate of each top-ranked arm is always shown, failures from
high-ranked arms come before others, and everything is capped (examples, failures, error text, template changes) so
the prompt stays the same size however long the run. Every family's template is in the view, with each edited
candidate's changes to it as a diff; budget.py cuts what does not fit the prompt's token budget, least useful first.
"""

from __future__ import annotations

import json
import math
from typing import Any

from agent.proposers.base import SearchState, arm_of
from agent.proposers.patch import template_changes
from core.device import DeviceFacts
from core.records import BuildResult, Candidate, EvalResult, Problem, Status
from core.roofline import floor_us
from templates import FAMILIES
from templates.family import Family

MAX_EXAMPLES = 6
TOP_ARMS = 3  # each of these arms' best candidate is shown, whatever its rank overall
MAX_FAILURES = 5
MAX_ERROR_CHARS = 700
MAX_RANKING = 8
MAX_REJECTED = 4
MAX_CHANGES_CHARS = 6_000  # an edited candidate's diff to its family's template, in the best candidates
MAX_FAILED_CHANGES_CHARS = 1_500
USABLE = (Status.OK, Status.SKIPPED)  # compiled (and, unless compile-only, correct)


def families_for_prompt(arch: str) -> list[Family]:
    """Every family that compiles for the arch and is shown to the LLM, including unsearched base families an edit
    may start from."""
    return [f for f in FAMILIES.values() if arch in f.arches and f.prompted]


def build_context(state: SearchState, n: int, *, edits: bool = True,
                  rejected: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The variables of prompts/propose.j2."""
    ranks = {row[0]: i for i, row in enumerate(state.bandit.ranking())}
    counts: dict[str, int] = {}
    for _, _, r in state.tried:
        counts[r.status.value] = counts.get(r.status.value, 0) + 1
    usefulness = {name: i for i, name in enumerate(family_usefulness(state))}
    return {
        "device": hardware_facts(state.device, state.arch),
        "problem": problem_view(state),
        "families": [family_view(f, edits, usefulness[f.name]) for f in families_for_prompt(state.arch)],
        "best": [example_view(c, b, r, ranks, state.profiles.get(c.id)) for c, b, r in best_examples(state, ranks)],
        "failures": [failure_view(c, b, r) for c, b, r in recent_failures(state, ranks)],
        "ranking": ranking_view(state),
        "rejected": [_clip(text, MAX_ERROR_CHARS) for text in list(rejected)[-MAX_REJECTED:]],
        "tried": {"total": len(state.tried), "by_status": counts},
        "n": n,
        "edits": edits,
        "left_out": [],  # what budget.py cut to fit the prompt's token budget, said in the prompt
    }


def family_usefulness(state: SearchState) -> list[str]:
    """The families of the prompt, most useful first: searched families by their best arm's rank in the bandit
    (unmeasured ones in the families' own order), then the base families."""
    best_rank: dict[str, int] = {}
    for i, (arm, *_) in enumerate(state.bandit.ranking()):
        best_rank.setdefault(str(arm).rpartition(":")[2], i)
    families = families_for_prompt(state.arch)
    order = sorted(range(len(families)), key=lambda i: (not families[i].searched,
                                                        best_rank.get(families[i].name, len(best_rank)), i))
    return [families[i].name for i in order]


def hardware_facts(device: DeviceFacts, arch: str) -> dict[str, Any]:
    return {"name": device.name, "target_arch": arch, "compute_capability": device.cc, "sms": device.sms,
            "l2_mib": round(device.l2_bytes / 2**20, 1),
            "smem_per_block_optin_kib": round(device.smem_per_block / 1024, 1),
            "smem_per_sm_kib": round(device.smem_per_sm / 1024, 1),
            "dense_fp16_tflops": round(device.tensor_tflops), "memory_tbps": round(device.hbm_tbps, 2)}


def problem_view(state: SearchState) -> dict[str, Any]:
    p = state.problem
    cublas = sorted(r.cublas_warm.median_us for _, _, r in state.tried if r.cublas_warm)
    return {
        "m": p.m, "n": p.n, "k": p.k, "mnk": p.mnk, "b_layout": p.b_layout, "dtype": p.dtype, "bias": p.bias,
        "b_meaning": "B is K x N row-major (torch.matmul)" if p.b_layout == "kn"
        else "B is N x K row-major (nn.Linear weight)",
        "gflop": round(p.flops / 1e9, 3),
        "floor_us": round(floor_us(p, state.device), 2),
        "cublas_us": round(cublas[len(cublas) // 2], 2) if cublas else None,
    }


def family_view(family: Family, edits: bool, usefulness: int) -> dict[str, Any]:
    return {
        "name": family.name,
        "description": family.description or (family.__doc__ or "").strip(),
        "arches": list(family.arches),
        "searched": family.searched,
        "schema": json.dumps(family.describe_space(), sort_keys=True),
        "template_variables": template_variables(family),
        "template": family.template_source() if edits else None,
        "usefulness": usefulness,  # 0 is the most useful: its template is the last budget.py cuts
    }


def template_variables(family: Family) -> list[str]:
    """The names a template of this family may use: its parameters, its derived values, and the problem's."""
    names = list(family.params_model.model_fields)
    try:
        names += list(family.derived(family.params_model()))
    except Exception:  # a family whose defaults are not a valid setting: its derived names stay unlisted
        pass
    return names + list(family.problem_variables(Problem(64, 64, 64)))


def best_examples(state: SearchState, ranks: dict[str, int]) -> list[tuple[Candidate, BuildResult | None,
                                                                             EvalResult]]:
    """The fastest usable candidates, with the best of each top-ranked arm guaranteed a place."""
    usable = [(i, t) for i, t in enumerate(state.tried) if t[2].status in USABLE]
    usable.sort(key=lambda it: (-(it[1][2].speedup or 0.0), _rank(it[1][0], ranks), -it[0]))
    picked: dict[str, tuple] = {}
    top_arms = [arm for arm, rank in ranks.items() if rank < TOP_ARMS]
    for arm in top_arms:
        hit = next((t for _, t in usable if _arm(t[0]) == arm), None)
        if hit is not None:
            picked.setdefault(hit[0].id, hit)
    for _, t in usable:
        if len(picked) >= MAX_EXAMPLES:
            break
        picked.setdefault(t[0].id, t)
    return sorted(picked.values(), key=lambda t: -(t[2].speedup or 0.0))


def recent_failures(state: SearchState, ranks: dict[str, int]) -> list[tuple[Candidate, BuildResult | None,
                                                                               EvalResult]]:
    """The latest failure always, then recent ones from high-ranked arms, one per distinct error."""
    failed = [(i, t) for i, t in enumerate(state.tried) if t[2].status not in USABLE][-4 * MAX_FAILURES:]
    if not failed:
        return []
    latest = failed[-1]
    rest = sorted(failed[:-1], key=lambda it: (_rank(it[1][0], ranks), -it[0]))
    out, seen = [], set()
    for _, (c, b, r) in [latest, *rest]:
        key = (c.family, r.status, _error_text(b, r)[:80])
        if key in seen:
            continue
        seen.add(key)
        out.append((c, b, r))
        if len(out) >= MAX_FAILURES:
            break
    return out


def ranking_view(state: SearchState) -> list[dict[str, Any]]:
    return [{"arm": str(arm), "mean_speedup": round(math.exp(mean), 3), "sd": round(sd, 3), "n": count}
            for arm, mean, sd, count in state.bandit.ranking()[:MAX_RANKING]]


def example_view(c: Candidate, b: BuildResult | None, r: EvalResult, ranks: dict[str, int],
                 profile: str | None = None) -> dict[str, Any]:
    view = _candidate_view(c, b, MAX_CHANGES_CHARS)
    view["profile"] = _clip(profile, 300) if profile else None  # Nsight Compute's one-line verdict
    view.update(status=r.status.value, arm=_arm(c), arm_rank=_rank(c, ranks) + 1 if _arm(c) in ranks else None,
                time_us=round(r.time_us, 2) if math.isfinite(r.time_us) else None,
                cold_us=round(r.cold.median_us, 2) if r.cold else None,
                spread=round(r.warm.spread, 3) if r.warm else None,
                speedup=round(r.speedup, 3) if r.speedup else None)
    return view


def failure_view(c: Candidate, b: BuildResult | None, r: EvalResult) -> dict[str, Any]:
    view = _candidate_view(c, b, MAX_FAILED_CHANGES_CHARS)
    view.update(status=r.status.value, error=_error_text(b, r))
    return view


def _candidate_view(c: Candidate, b: BuildResult | None, max_changes: int) -> dict[str, Any]:
    return {
        "id": c.id, "family": c.family, "origin": c.origin, "params": json.dumps(c.params, sort_keys=True),
        "kind": c.kind, "base": c.patch.base if c.patch else None,
        "changes": _changes(c, max_changes), "rationale": _clip(c.rationale, 200),
        "registers": b.registers if b else None, "spill_bytes": b.spill_bytes if b else None,
        "smem_static": b.smem_static if b else None,
    }


def _changes(c: Candidate, max_chars: int) -> str | None:
    """An edited candidate's template as a diff to its family's template as it is now (a patch against that
    candidate must match its text, which the diff and the family's template shown give)."""
    if c.template_override is None:
        return None
    try:
        family = FAMILIES[c.family]
    except KeyError:  # a family no longer known
        return None
    return template_changes(family.template_source(), c.template_override, max_chars) or "(no changes)"


def _error_text(b: BuildResult | None, r: EvalResult) -> str:
    """The compiler's error lines for a build failure, else the result's reason; clipped."""
    if r.status is Status.COMPILE_ERROR and b is not None and b.log:
        lines = [line for line in b.log.splitlines() if "error" in line.lower()] or b.log.splitlines()
        return _clip("\n".join(lines[:8]), MAX_ERROR_CHARS)
    return _clip(r.reason or (b.error if b else ""), MAX_ERROR_CHARS)


def _arm(c: Candidate) -> str:
    try:
        return arm_of(c)
    except ValueError:  # a family no longer known
        return c.arm


def _rank(c: Candidate, ranks: dict[str, int]) -> int:
    return ranks.get(_arm(c), len(ranks))


def _clip(text: str, limit: int) -> str:
    text = text or ""
    return text if len(text) <= limit else text[: limit - 15] + " ...[truncated]"
