"""What a model may reply: the proposal schema (pydantic), and the reply text parsed into it.

The reply is data: JSON validated here, then by the family's own parameter checks; it only ever becomes parameters
or an edited template (whole, or patched by search/replace edits), which the loop renders in Jinja's sandbox, NVRTC
compiles and the sandbox runs. What a patch's edits must satisfy is checked where they are applied (patch.py), one
proposal at a time, so that one bad patch does not sink its neighbours.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_TEMPLATE_CHARS = 64_000
MAX_PATCH_EDITS = 32


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


class SearchReplace(BaseModel):
    model_config = ConfigDict(extra="ignore")

    search: str = Field(max_length=MAX_TEMPLATE_CHARS)
    replace: str = Field(max_length=MAX_TEMPLATE_CHARS)


class PatchProposal(_Proposal):
    kind: Literal["patch"]
    params: dict[str, Any] | None = None  # None: the base candidate's, or the family's first setting for the problem
    base: str | None = Field(None, max_length=64)  # None or the family's name: its template; else a candidate id
    edits: list[SearchReplace] = Field(default_factory=list, max_length=MAX_PATCH_EDITS)


Proposal = Annotated[ParamsProposal | EditProposal | PatchProposal, Field(discriminator="kind")]


class ProposalReply(BaseModel):
    proposals: list[Proposal] = Field(min_length=1, max_length=16)


def parse_reply(text: str) -> ProposalReply:
    """The reply's proposals; ValueError with a message for the model when the text is not such a reply."""
    try:
        return ProposalReply.model_validate(_json_object(text))
    except ValidationError as e:
        raise ValueError(f"the reply does not match the schema: {_validation_errors(e)}") from None


def _json_object(text: str) -> Any:
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
