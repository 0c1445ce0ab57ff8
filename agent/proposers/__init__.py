"""Proposers: where candidates come from (built-in search over template spaces, or an LLM)."""

from __future__ import annotations

from agent.config import RunConfig
from agent.proposers.base import Proposer


def make_proposer(config: RunConfig, device: dict | None = None) -> Proposer:
    from agent.proposers.builtin import BuiltinProposer

    if config.proposer == "builtin":
        return BuiltinProposer()
    from agent.proposers.llm import make_llm_proposer  # the LLM proposers (llm, mixed)

    return make_llm_proposer(config, device)
