"""The proposer interface and what a proposer sees of the search so far."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from agent.bandit import ThompsonBandit, stream_seed
from core.device import H200, DeviceFacts
from core.records import BuildResult, Candidate, EvalResult, ModelCall, Problem


@dataclass
class SearchState:
    """Everything tried for one problem so far, in order, with the bandit that scores the arms."""

    problem: Problem
    arch: str
    bandit: ThompsonBandit
    tried: list[tuple[Candidate, BuildResult | None, EvalResult]] = field(default_factory=list)
    device: DeviceFacts = H200  # the GPU the candidates run on (the H200 stand-in when compiling only)
    profiles: dict[str, str] = field(default_factory=dict)  # candidate id -> Nsight Compute summary line
    pending: set[str] = field(default_factory=set)  # ids proposed and in flight (several GPUs), not yet recorded

    @classmethod
    def start(cls, problem: Problem, arch: str, seed: int, device: DeviceFacts = H200) -> SearchState:
        """A problem's search before anything is tried, its bandit seeded for the problem from the run's `seed`
        (docs/decisions.md `bandit-seeds`)."""
        return cls(problem, arch, ThompsonBandit(seed=stream_seed(seed, problem.key)), device=device)

    @property
    def tried_ids(self) -> set[str]:
        """Ids not to propose again: those recorded and those in flight."""
        return {c.id for c, _, _ in self.tried} | self.pending


def arm_of(c: Candidate) -> str:
    """The bandit arm a candidate belongs to: its proposer and family (docs/decisions.md `bandit-arms`)."""
    return c.arm


class Proposer(ABC):
    name: str

    @abstractmethod
    def propose(self, state: SearchState, n: int = 1) -> list[Candidate]:
        """Up to n new candidates (none already tried); an empty list means this proposer has nothing left."""

    def upcoming(self, state: SearchState, per_family: int = 2) -> list[Candidate]:
        """Candidates this proposer is likely to propose soon for the problem (none tried), for compiling ahead while
        the GPU is busy; proposing does not depend on it. Empty where it cannot tell (an LLM)."""
        return []

    def take_calls(self) -> list[ModelCall]:
        """The model calls made since the last time asked, each handed over once (for the run store)."""
        return []

    def stats(self) -> dict:
        """Counters worth keeping with the run (calls, tokens, dropped responses); never secrets."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the proposer holds (connections)."""
