"""Proposers: where candidates come from (built-in search over template spaces, or an LLM)."""

from __future__ import annotations

from agent.config import RunConfig
from agent.cost_model import CostModel, Learner
from agent.proposers.base import Proposer


def make_proposer(config: RunConfig, model: CostModel | Learner | None = None) -> Proposer:
    """--proposer builtin; mixed: the LLM every other call; llm: the LLM every call, built-in only where it has none.
    The built-in proposer orders its candidates by `model` where it has one."""
    from agent.proposers.builtin import BuiltinProposer

    if config.proposer == "builtin":
        return BuiltinProposer(model)
    from agent.proposers.llm import LlmProposer
    from agent.proposers.mixed import MixedProposer

    llm = LlmProposer(config.llm)
    if config.proposer == "mixed":
        return MixedProposer(llm, BuiltinProposer(model), llm_every=2)
    return MixedProposer(llm, BuiltinProposer(model), llm_every=1, name="llm")
