"""The LLM proposers: candidates from a model behind any OpenAI-compatible endpoint, alone or mixed with built-in.

The model's reply is data: JSON validated by pydantic models, then by the family's own parameter checks; it only
ever becomes parameters or an edited template, which NVRTC compiles and the sandbox runs. An edited template is
rendered here once in Jinja's sandbox, so that one which does not render, reaches for host objects or pulls in host
files (#include) is sent back, not compiled. Endpoint failures are retried with backoff, then end the LLM's part of
the run, never the run: the mixed proposer (also behind --proposer llm) goes on with the built-in one.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import jinja2
import openai
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.config import LlmSettings, RunConfig
from agent.proposers.base import Proposer, SearchState
from agent.proposers.builtin import BuiltinProposer
from agent.proposers.context import build_context
from core.records import Candidate, Problem
from sandbox.build import reads_host_files
from templates import get_family
from templates.family import Family, Params

PROMPTS = Path(__file__).resolve().parents[2] / "prompts"
MAX_TEMPLATE_CHARS = 64_000
MAX_SOURCE_CHARS = 256_000
MAX_RATIONALE_CHARS = 500
MAX_ECHO_CHARS = 100_000  # a bad reply is echoed back whole (an edit needs its template), up to this
KERNEL_ENTRY = re.compile(r'extern\s+"C"[^;{]*\bhgemm\s*\(')
SECRET_LIKE = re.compile(r"\bsk-[A-Za-z0-9_*\-]{6,}")


class _Proposal(BaseModel):
    model_config = ConfigDict(extra="ignore")

    family: str = Field(min_length=1, max_length=64)
    params: dict[str, Any] = Field(default_factory=dict)
    rationale: str = ""


class ParamsProposal(_Proposal):
    kind: Literal["params"]


class EditProposal(_Proposal):
    kind: Literal["edit"]
    template: str = Field(min_length=1, max_length=MAX_TEMPLATE_CHARS)


class ProposalReply(BaseModel):
    proposals: list[Annotated[ParamsProposal | EditProposal, Field(discriminator="kind")]] = Field(
        min_length=1, max_length=16)


class _GiveUp(Exception):
    """The endpoint failed past the retries, or in a way retrying cannot fix."""


class _Spent(Exception):
    """A call or token budget is used up."""


class LlmProposer(Proposer):
    name = "llm"

    def __init__(self, settings: LlmSettings, device: dict[str, Any] | None = None, *, per_call: int = 4,
                 edits: bool = True, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 sleep: Callable[[float], None] = time.sleep):
        self.settings, self.device, self.per_call, self.edits = settings, device, per_call, edits
        self.backoff_s, self.max_backoff_s, self.sleep = backoff_s, max_backoff_s, sleep
        self.client = openai.OpenAI(base_url=settings.base_url, api_key=LlmSettings.api_key() or "none",
                                    timeout=settings.timeout_s, max_retries=0)
        self.prompts = jinja2.Environment(loader=jinja2.FileSystemLoader(PROMPTS), undefined=jinja2.StrictUndefined,
                                          trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        self.json_mode = True  # ask for response_format json_object until the endpoint refuses it
        self.counts = dict.fromkeys(("calls", "failed_requests", "retries", "proposals", "accepted", "duplicates",
                                     "rejected", "resent", "dropped"), 0)
        self.tokens = {"prompt": 0, "completion": 0, "total": 0, "estimated": False}
        self.gave_up: str | None = None
        self.spent: str | None = None
        self._problem_key: str | None = None
        self._queue: deque[Candidate] = deque()  # valid proposals of the last reply, not yet handed out
        self._rejected: deque[str] = deque(maxlen=4)  # why recent proposals were refused: shown in the next prompt

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
            except _Spent as e:
                self.spent = str(e)
            except _GiveUp as e:
                self.gave_up = self._scrub(str(e))
            except Exception as e:  # whatever else goes wrong with the LLM, the run goes on without it
                self.gave_up = self._scrub(f"unexpected {type(e).__name__}: {e}")[:300]
            out += self._take(state, n - len(out), {c.id for c in out})
        return out

    def stats(self) -> dict[str, Any]:
        return {"proposer": self.name, "model": self.settings.model, "endpoint": self._endpoint(), **self.counts,
                "tokens": dict(self.tokens), "json_mode": self.json_mode, "gave_up": self.gave_up,
                "budget_spent": self.spent}

    def close(self) -> None:
        self.client.close()

    # one conversation: the prompt, and the reply sent back once if it cannot be used
    def _ask(self, state: SearchState, n: int) -> list[Candidate]:
        context = build_context(state, self.device, n, edits=self.edits, rejected=tuple(self._rejected))
        messages = [{"role": "system", "content": self.prompts.get_template("system.j2").render(edits=self.edits)},
                    {"role": "user", "content": self.prompts.get_template("propose.j2").render(**context)}]
        text, finish = self._complete(messages)
        try:
            return self._candidates(text, state)
        except ValueError as e:
            error = str(e) + (" (the reply was cut off at the length limit: propose fewer or shorter candidates)"
                              if finish == "length" else "")
        self.counts["resent"] += 1
        messages += [{"role": "assistant", "content": text[:MAX_ECHO_CHARS]},
                     {"role": "user", "content": self.prompts.get_template("resend.j2").render(error=error)}]
        try:
            text, _ = self._complete(messages)
        except (_Spent, _GiveUp):
            self.counts["dropped"] += 1
            raise
        try:
            return self._candidates(text, state)
        except ValueError as e:
            self.counts["dropped"] += 1
            self._rejected.append(f"a whole reply was dropped: {e}")
            return []

    def _complete(self, messages: list[dict[str, str]]) -> tuple[str, str | None]:
        """One chat completion, retried on timeouts, connection errors, 429 and 5xx with exponential backoff."""
        attempt = 0
        while True:
            self._check_budget()
            self.counts["calls"] += 1
            extra = {"response_format": {"type": "json_object"}} if self.json_mode else {}
            try:
                response = self.client.chat.completions.create(model=self.settings.model, messages=messages,
                                                               **extra)
            except openai.APIStatusError as e:
                if e.status_code in (400, 422) and self.json_mode:
                    self.json_mode = False  # many local servers reject response_format; the prompt asks for JSON
                    continue
                if e.status_code not in (408, 409, 429) and e.status_code < 500:
                    raise _GiveUp(f"HTTP {e.status_code} ({type(e).__name__}): {_message(e)}") from None
                failure = f"HTTP {e.status_code} ({type(e).__name__})"
            except openai.APITimeoutError:
                failure = f"timeout after {self.settings.timeout_s:g} s"
            except openai.APIConnectionError as e:
                failure = f"connection error ({_message(e)})"
            else:
                self._count_usage(response, messages)
                choice = response.choices[0] if response.choices else None
                return (choice.message.content or "") if choice else "", choice.finish_reason if choice else None
            self.counts["failed_requests"] += 1
            if attempt >= self.settings.retries:
                raise _GiveUp(f"{failure}; gave up after {attempt + 1} attempts")
            self.sleep(min(self.backoff_s * 2**attempt, self.max_backoff_s))
            attempt += 1
            self.counts["retries"] += 1

    def _check_budget(self) -> None:
        if self.counts["calls"] >= self.settings.max_calls:
            raise _Spent(f"max_calls ({self.settings.max_calls}) used")
        if self.tokens["total"] >= self.settings.max_tokens:
            raise _Spent(f"max_tokens ({self.settings.max_tokens}) used: {self.tokens['total']} tokens")

    def _count_usage(self, response: Any, messages: list[dict[str, str]]) -> None:
        usage = getattr(response, "usage", None)
        if usage is not None and usage.total_tokens:
            prompt, completion = usage.prompt_tokens or 0, usage.completion_tokens or 0
            total = usage.total_tokens
        else:  # servers that report no usage: about four characters a token
            self.tokens["estimated"] = True
            prompt = sum(len(m["content"]) for m in messages) // 4
            completion = sum(len(c.message.content or "") for c in response.choices or []) // 4
            total = prompt + completion
        self.tokens["prompt"] += prompt
        self.tokens["completion"] += completion
        self.tokens["total"] += total

    # from reply text to candidates
    def _candidates(self, text: str, state: SearchState) -> list[Candidate]:
        """The new, valid candidates of a reply; ValueError (the message for the model) if it has none."""
        try:
            reply = ProposalReply.model_validate(_parse_json(text))
        except ValidationError as e:
            raise ValueError(f"the reply does not match the schema: {_validation_errors(e)}") from None
        known = state.tried_ids | {c.id for c in self._queue}
        good: list[Candidate] = []
        errors: list[str] = []
        duplicates = 0
        for i, proposal in enumerate(reply.proposals, 1):
            try:
                cand = self._candidate(proposal, state)
            except ValueError as e:
                errors.append(self._scrub(f"proposal {i} ({proposal.kind}, family {proposal.family!r}): {e}"))
                continue
            if cand.id in known:
                duplicates += 1
                continue
            known.add(cand.id)
            good.append(cand)
        self.counts["proposals"] += len(reply.proposals)
        self.counts["accepted"] += len(good)
        self.counts["duplicates"] += duplicates
        self.counts["rejected"] += len(errors)
        if errors and not good:
            dup_note = f" ({duplicates} other proposals repeat candidates already tried)" if duplicates else ""
            raise ValueError("; ".join(errors) + dup_note)
        self._rejected.extend(errors)
        return good

    def _candidate(self, p: ParamsProposal | EditProposal, state: SearchState) -> Candidate:
        family = get_family(p.family)
        if state.arch not in family.arches:
            raise ValueError(f"family {family.name} does not compile for {state.arch}")
        parsed = family.parse(p.params, state.problem)
        params = parsed.model_dump()  # defaults filled in: the same setting always gets the same candidate id
        rationale = p.rationale.strip()[:MAX_RATIONALE_CHARS]
        if isinstance(p, ParamsProposal):
            return Candidate(state.problem, family.name, params, origin="llm", rationale=rationale)
        check_template(family, parsed, state.problem, p.template)
        return Candidate(state.problem, family.name, params, origin="llm-edit", rationale=rationale,
                         template_override=p.template)

    def _take(self, state: SearchState, n: int, taken: set[str] | None = None) -> list[Candidate]:
        skip = state.tried_ids | (taken or set())
        out: list[Candidate] = []
        while self._queue and len(out) < n:
            c = self._queue.popleft()
            if c.id not in skip:
                out.append(c)
                skip.add(c.id)
        return out

    def _endpoint(self) -> str:
        """Where the endpoint is, without user info or query (either may carry a secret)."""
        url = urlsplit(str(self.client.base_url))
        host = url.hostname or ""
        return f"{url.scheme}://{host}{f':{url.port}' if url.port else ''}{url.path}"

    def _scrub(self, text: str) -> str:
        key = LlmSettings.api_key()
        if len(key) >= 4:
            text = text.replace(key, "***")
        return SECRET_LIKE.sub("sk-***", text)


def check_template(family: Family, params: Params, problem: Problem, template: str) -> str:
    """Render an edited template as the loop will (the family's sandboxed Jinja environment and variables), and
    apply the build's own refusal of file-reading directives; ValueError says what is wrong."""
    try:
        source = family.render(params.model_dump(), problem, template)
    except Exception as e:  # syntax, undefined names, sandbox refusals, errors in template expressions
        raise ValueError(f"the template does not render: {type(e).__name__}: {e}") from None
    if len(source) > MAX_SOURCE_CHARS:
        raise ValueError(f"the rendered source has {len(source)} characters; at most {MAX_SOURCE_CHARS}")
    if reads_host_files(source):
        raise ValueError("#include and other file-reading directives are not allowed: the kernel must be "
                         "self-contained (inline PTX, no headers)")
    if not KERNEL_ENTRY.search(source):
        raise ValueError('the rendered source must define extern "C" __global__ void hgemm(const unsigned short* '
                         "A, const unsigned short* B, unsigned short* C, int M, int N, int K)")
    return source


def _parse_json(text: str) -> Any:
    """The JSON object of a reply, tolerating Markdown fences and prose around it; ValueError if there is none."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    body = (fenced.group(1) if fenced else text).strip()
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        start, end = body.find("{"), body.rfind("}")
        try:
            data = json.loads(body[start:end + 1]) if 0 <= start < end else None
        except json.JSONDecodeError:
            data = None
        if data is None:
            raise ValueError(f"the reply is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(data, list):
        return {"proposals": data}
    if isinstance(data, dict) and "proposals" not in data and "kind" in data:
        return {"proposals": [data]}
    return data


def _validation_errors(e: ValidationError, limit: int = 4) -> str:
    parts = []
    for err in e.errors()[:limit]:
        where = ".".join(str(x) for x in err["loc"]) or "reply"
        parts.append(f"{where}: {err['msg']}")
    more = len(e.errors()) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _message(e: Exception) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"][:200]
    return str(e)[:200]


class MixedProposer(Proposer):
    """LLM and built-in proposals in turn; the built-in one fills every gap the LLM leaves, for good if it stops.

    llm_every=2 asks the LLM on every other call (--proposer mixed); llm_every=1 asks it on every call and uses the
    built-in proposer only when the LLM has nothing (--proposer llm: the run goes on if the endpoint is down).
    """

    def __init__(self, llm: LlmProposer, builtin: Proposer, llm_every: int = 2, name: str = "mixed"):
        self.llm, self.builtin, self.llm_every, self.name = llm, builtin, max(1, llm_every), name
        self.turn = 0
        self.handed = {"llm": 0, "builtin": 0}

    def propose(self, state: SearchState, n: int = 1) -> list[Candidate]:
        self.turn += 1
        llm_turn = self.turn % self.llm_every == 0
        order = [("llm", self.llm), ("builtin", self.builtin)] if llm_turn else [("builtin", self.builtin),
                                                                                ("llm", self.llm)]
        out: list[Candidate] = []
        for label, source in order:
            if len(out) >= n:
                break
            seen = state.tried_ids | {c.id for c in out}
            got = [c for c in source.propose(state, n - len(out)) if c.id not in seen]
            self.handed[label] += len(got)
            out += got
        return out

    def stats(self) -> dict[str, Any]:
        stopped = self.llm.stopped
        return {"proposer": self.name, "candidates_from": dict(self.handed),
                "fallback": f"the LLM stopped ({stopped}); the built-in proposer goes on" if stopped else None,
                "llm": self.llm.stats(), "builtin": self.builtin.stats()}

    def close(self) -> None:
        self.llm.close()
        self.builtin.close()


def make_llm_proposer(config: RunConfig, device: dict[str, Any] | None = None) -> Proposer:
    """--proposer mixed: LLM every other call; --proposer llm: LLM every call, built-in only where it has none."""
    llm = LlmProposer(config.llm, device)
    if config.proposer == "mixed":
        return MixedProposer(llm, BuiltinProposer(), llm_every=2)
    return MixedProposer(llm, BuiltinProposer(), llm_every=1, name="llm")
