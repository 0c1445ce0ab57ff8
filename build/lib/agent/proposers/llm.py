"""The LLM proposer: candidates from a model behind any OpenAI-compatible endpoint.

One conversation a call: the prompt (prompts/, filled from a bounded view of the search and cut to its token budget
by budget.py), the reply parsed into proposals (reply.py), each checked against its family's parameter model and
turned into a candidate: parameters, a whole edited template, or a patched one (patch.py applies the search/replace
edits to the family's template or to an edited candidate's). A reply that yields nothing usable is sent back once
with the reason, then dropped; proposals refused before compiling are named in the next prompt. Every request is
reported (take_calls) with its tokens and what became of each proposal. Endpoint failures and spent budgets end the
LLM's part of the run, never the run (mixed.py goes on with the built-in proposer). Edited and patched templates are
rendered by the loop like every candidate, not here.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jinja2

import prompts
from agent.config import LlmSettings
from agent.proposers.base import Proposer, SearchState
from agent.proposers.budget import estimate_tokens, fit_prompt
from agent.proposers.context import build_context
from agent.proposers.llm_client import BudgetSpent, ChatClient, EndpointFailed
from agent.proposers.patch import apply_patch, find_base
from agent.proposers.reply import ParamsProposal, PatchProposal, Proposal, parse_reply
from core.records import Candidate, ModelCall, Patch, ProposalFate, TextEdit
from templates import get_family
from templates.family import Family

PROMPTS = Path(prompts.__file__).resolve().parent
MAX_RATIONALE_CHARS = 500
MAX_ECHO_CHARS = 100_000  # a bad reply is echoed back whole (an edit needs its template), up to this
MAX_REASON_CHARS = 500  # a refused proposal's reason, as a call's record keeps it
SECRET_LIKE = re.compile(r"\bsk-[A-Za-z0-9_*\-]{6,}")


@dataclass
class ProposalCounts:
    """What became of the model's proposals: accepted as candidates, repeats of tried ones, refused before
    compiling; replies sent back once, and dropped after that."""

    proposals: int = 0
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    resent: int = 0
    dropped: int = 0


class LlmProposer(Proposer):
    name = "llm"

    def __init__(self, settings: LlmSettings, *, per_call: int = 4, edits: bool = True, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, sleep: Callable[[float], None] | None = None):
        self.settings, self.per_call, self.edits = settings, per_call, edits
        extra = {"sleep": sleep} if sleep else {}
        self.client = ChatClient(settings, backoff_s=backoff_s, max_backoff_s=max_backoff_s, **extra)
        self.prompts = jinja2.Environment(loader=jinja2.FileSystemLoader(PROMPTS), undefined=jinja2.StrictUndefined,
                                          trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        self.counts = ProposalCounts()
        self.gave_up: str | None = None
        self.spent: str | None = None
        self._problem_key: str | None = None
        self._queue: deque[Candidate] = deque()  # valid proposals of the last reply, not yet handed out
        self._rejected: deque[str] = deque(maxlen=4)  # why recent proposals were refused: shown in the next prompt
        self._calls: list[ModelCall] = []  # not yet handed over

    @property
    def stopped(self) -> str | None:
        """Why this proposer proposes nothing more (gave up, or a budget is spent), or None while it works."""
        return self.gave_up or self.spent

    def propose(self, state: SearchState, n: int = 1) -> list[Candidate]:
        if state.problem.key != self._problem_key:
            self._problem_key = state.problem.key
            self._queue.clear()
            self._rejected.clear()
        out = self._take(state, n)
        if len(out) < n and self.stopped is None:
            try:
                self._queue.extend(self._ask(state, max(n - len(out), self.per_call)))
            except BudgetSpent as e:
                self.spent = str(e)
            except EndpointFailed as e:
                self.gave_up = self._scrub(str(e))
            except Exception as e:  # whatever else goes wrong with the LLM, the run goes on without it
                self.gave_up = self._scrub(f"unexpected {type(e).__name__}: {e}")[:300]
            out += self._take(state, n - len(out), {c.id for c in out})
        return out

    def take_calls(self) -> list[ModelCall]:
        calls, self._calls = self._calls, []
        return calls

    def stats(self) -> dict[str, Any]:
        return {"proposer": self.name, "model": self.settings.model, **self.client.stats(), **asdict(self.counts),
                "gave_up": self.gave_up, "budget_spent": self.spent}

    def close(self) -> None:
        self.client.close()

    # one conversation: the prompt, and the reply sent back once if it cannot be used
    def _ask(self, state: SearchState, n: int) -> list[Candidate]:
        system = self.prompts.get_template("system.j2").render(edits=self.edits)
        context = build_context(state, n, edits=self.edits, rejected=tuple(self._rejected))
        prompt, left_out = fit_prompt(context, self.prompts.get_template("propose.j2").render,
                                      self.settings.max_prompt_tokens - estimate_tokens(system))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        good, text, error = self._exchange(messages, state, "propose", left_out)
        if error is None:
            return good
        self.counts.resent += 1
        messages += [{"role": "assistant", "content": text[:MAX_ECHO_CHARS]},
                     {"role": "user", "content": self.prompts.get_template("resend.j2").render(error=error)}]
        try:
            good, _, error = self._exchange(messages, state, "resend", ())
        except (BudgetSpent, EndpointFailed):
            self.counts.dropped += 1
            raise
        if error is None:
            return good
        self.counts.dropped += 1
        self._rejected.append(f"a whole reply was dropped: {error}")
        return []

    def _exchange(self, messages: list[dict[str, str]], state: SearchState, purpose: str,
                  left_out: tuple[str, ...]) -> tuple[list[Candidate], str, str | None]:
        """One request, reported: the reply's new candidates, its text, and why it cannot be used (None if it can)."""
        before = self.client.usage.tokens()
        fates: list[ProposalFate] = []
        try:
            text, finish = self.client.complete(messages)
        except EndpointFailed as e:
            self._report(state, purpose, before, left_out, fates, self._scrub(f"endpoint failed: {e}"))
            raise
        try:
            good = self._candidates(text, state, fates)
        except ValueError as e:
            error = str(e) + (" (the reply was cut off at the length limit: propose fewer or shorter candidates)"
                              if finish == "length" else "")
            fate = "sent back" if purpose == "propose" else "dropped"
            self._report(state, purpose, before, left_out, fates, f"reply {fate}: {error}")
            return [], text, error
        self._report(state, purpose, before, left_out, fates)
        return good, text, None

    def _report(self, state: SearchState, purpose: str, before: dict[str, Any], left_out: tuple[str, ...],
                fates: list[ProposalFate], error: str = "") -> None:
        after = self.client.usage.tokens()
        self._calls.append(ModelCall(state.problem.key, purpose, after["prompt"] - before["prompt"],
                                     after["completion"] - before["completion"], after["estimated"], left_out,
                                     tuple(fates), error[:1000]))

    def _candidates(self, text: str, state: SearchState, fates: list[ProposalFate]) -> list[Candidate]:
        """The new, valid candidates of a reply, each proposal's fate appended to `fates`; ValueError (the message
        for the model) if it has none."""
        reply = parse_reply(text)
        known = state.tried_ids | {c.id for c in self._queue}
        good: list[Candidate] = []
        errors: list[str] = []
        duplicates = 0
        for i, proposal in enumerate(reply.proposals, 1):
            base = (proposal.base or proposal.family) if isinstance(proposal, PatchProposal) else None
            try:
                cand = self._candidate(proposal, state)
            except ValueError as e:
                errors.append(self._scrub(f"proposal {i} ({proposal.kind}, family {proposal.family!r}): {e}"))
                fates.append(ProposalFate(proposal.kind, proposal.family, "refused", base,
                                          reason=self._scrub(str(e))[:MAX_REASON_CHARS]))
                continue
            base = cand.patch.base if cand.patch else None
            if cand.id in known:
                duplicates += 1
                fates.append(ProposalFate(proposal.kind, cand.family, "duplicate", base, cand.id))
                continue
            known.add(cand.id)
            good.append(cand)
            fates.append(ProposalFate(proposal.kind, cand.family, "accepted", base, cand.id))
        self.counts.proposals += len(reply.proposals)
        self.counts.accepted += len(good)
        self.counts.duplicates += duplicates
        self.counts.rejected += len(errors)
        if errors and not good:
            dup_note = f" ({duplicates} other proposals repeat candidates already tried)" if duplicates else ""
            raise ValueError("; ".join(errors) + dup_note)
        self._rejected.extend(errors)
        return good

    def _candidate(self, p: Proposal, state: SearchState) -> Candidate:
        family = get_family(p.family)
        if state.arch not in family.arches:
            raise ValueError(f"family {family.name} does not compile for {state.arch}")
        rationale = p.rationale.strip()[:MAX_RATIONALE_CHARS]
        if isinstance(p, PatchProposal):
            return self._patched(p, family, state, rationale)
        params = family.parse(p.params, state.problem).model_dump()  # defaults filled in: one id per setting
        if isinstance(p, ParamsProposal):
            return Candidate(state.problem, family.name, params, origin="llm", rationale=rationale)
        return Candidate(state.problem, family.name, params, origin="llm-edit", rationale=rationale,
                         template_override=p.template)

    @staticmethod
    def _patched(p: PatchProposal, family: Family, state: SearchState, rationale: str) -> Candidate:
        """A candidate whose template is the base's with the patch applied; ValueError (PatchError) says why not."""
        base = find_base(p.base, family.name, state)
        edits = tuple(TextEdit(e.search, e.replace) for e in p.edits)
        template = apply_patch(base.template_override if base else family.template_source(), edits)
        if p.params is not None:
            raw = p.params
        elif base is not None:
            raw = base.params
        else:
            settings = family.space(state.problem, state.device)
            if not settings:
                raise ValueError(f"family {family.name} has no setting for this problem: give params")
            raw = settings[0]
        params = family.parse(raw, state.problem).model_dump()
        return Candidate(state.problem, family.name, params, origin="llm-patch", rationale=rationale,
                         template_override=template, patch=Patch(base.id if base else family.name, edits))

    def _take(self, state: SearchState, n: int, taken: set[str] | None = None) -> list[Candidate]:
        skip = state.tried_ids | (taken or set())
        out: list[Candidate] = []
        while self._queue and len(out) < n:
            c = self._queue.popleft()
            if c.id not in skip:
                out.append(c)
                skip.add(c.id)
        return out

    def _scrub(self, text: str) -> str:
        key = LlmSettings.api_key()
        if len(key) >= 4:
            text = text.replace(key, "***")
        return SECRET_LIKE.sub("sk-***", text)
