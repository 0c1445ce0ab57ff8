"""The mixed proposer: an LLM's proposals and the built-in ones in turn, so that the run never waits on the model.

The built-in proposer fills every gap the LLM leaves, and takes over for good when the LLM stops (endpoint down,
budget spent): --proposer mixed asks the LLM every other call, --proposer llm every call.
"""

from __future__ import annotations

from typing import Any

from agent.proposers.base import Proposer, SearchState
from agent.proposers.llm import LlmProposer
from core.records import Candidate, ModelCall


class MixedProposer(Proposer):
    """LLM and built-in proposals in turn; the built-in one fills every gap the LLM leaves, for good if it stops.

    llm_every=2 asks the LLM on every other call (--proposer mixed); llm_every=1 asks it on every call and uses the
    built-in proposer only when the LLM has nothing (--proposer llm: the run goes on if the endpoint is down).
    """

    def __init__(self, llm: LlmProposer, builtin: Proposer, llm_every: int = 2, name: str = "mixed"):
        self.llm, self.builtin, self.llm_every, self.name = llm, builtin, max(1, llm_every), name
        self.turn = 0
        self.handed: dict[str, int] = {}  # by origin: builtin, llm, llm-edit, llm-patch

    def propose(self, state: SearchState, n: int = 1) -> list[Candidate]:
        self.turn += 1
        llm_turn = self.turn % self.llm_every == 0
        order = [self.llm, self.builtin] if llm_turn else [self.builtin, self.llm]
        out: list[Candidate] = []
        for source in order:
            if len(out) >= n:
                break
            seen = state.tried_ids | {c.id for c in out}
            got = [c for c in source.propose(state, n - len(out)) if c.id not in seen]
            for c in got:
                self.handed[c.origin] = self.handed.get(c.origin, 0) + 1
            out += got
        return out

    def upcoming(self, state: SearchState, per_family: int = 2) -> list[Candidate]:
        return self.builtin.upcoming(state, per_family)

    def take_calls(self) -> list[ModelCall]:
        return self.llm.take_calls()

    def stats(self) -> dict[str, Any]:
        stopped = self.llm.stopped
        return {"proposer": self.name, "candidates_from": dict(self.handed),
                "fallback": f"the LLM stopped ({stopped}); the built-in proposer goes on" if stopped else None,
                "llm": self.llm.stats(), "builtin": self.builtin.stats()}

    def close(self) -> None:
        self.llm.close()
        self.builtin.close()
