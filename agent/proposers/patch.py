"""Search/replace patches against a template: applied as plain text, or refused with a short, precise reason.

Each edit's `search` must occur exactly once in the text as the earlier edits left it, so that a patch means one
thing whatever the model assumed about the rest of the file. The text patched is a family's template, or the template
of an edited or patched candidate already tried for the same problem (named by its id, or a unique prefix of it).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from agent.proposers.base import SearchState
from core.records import Candidate, Patch, TextEdit


class PatchError(ValueError):
    """Why a patch cannot be applied: shown to the model in the next prompt."""


def apply_patch(text: str, edits: Sequence[TextEdit]) -> str:
    """The text with the edits applied in order; PatchError naming the first edit that cannot be applied."""
    if not edits:
        raise PatchError("the patch has no edits")
    original = text
    for i, edit in enumerate(edits, 1):
        if not edit.search:
            raise PatchError(f"edit {i}: the search text is empty")
        count = _occurrences(text, edit.search)
        if count == 0:
            raise PatchError(f"edit {i}: search text not found{_near_miss(original, text, edit.search)}")
        if count > 1:
            raise PatchError(f"edit {i}: search text occurs {count} times: add context to make it unique")
        text = text.replace(edit.search, edit.replace, 1)
    if text == original:
        raise PatchError("the edits change nothing")
    return text


def find_base(ref: str | None, family: str, state: SearchState) -> Candidate | None:
    """The edited candidate a patch names as its base, or None where it patches the family's own template."""
    if not ref or ref == family:
        return None
    hits = {c.id: c for c, _, _ in state.tried if c.id.startswith(ref)}
    if not hits:
        raise PatchError(f"base {ref!r}: no candidate tried for this problem has that id (name the family, or an "
                         "edited or patched candidate shown)")
    if len(hits) > 1:
        raise PatchError(f"base {ref!r} is ambiguous: {len(hits)} candidates start with it")
    [base] = hits.values()
    if base.family != family:
        raise PatchError(f"base {base.id} is a {base.family} candidate, not {family}")
    if base.template_override is None:
        raise PatchError(f"base {base.id} uses the family's own template: name the family {family!r} as the base")
    return base


def template_changes(family_template: str, template: str, max_chars: int) -> str:
    """A unified diff from the family's template to an edited one (two lines of context), cut at a line boundary
    within max_chars and saying so."""
    lines = list(difflib.unified_diff(family_template.splitlines(True), template.splitlines(True),
                                      "family template", "this candidate", n=2))
    out, size = [], 0
    for i, line in enumerate(lines):
        line = line if line.endswith("\n") else line + "\n"
        if size + len(line) > max_chars:
            out.append(f"... [diff cut here: {len(lines) - i} more lines]\n")
            break
        out.append(line)
        size += len(line)
    return "".join(out)


def patch_text(patch: Patch) -> str:
    """A patch's edits in diff notation, one hunk an edit."""
    parts = [f"# base: {patch.base}\n"]
    for i, edit in enumerate(patch.edits, 1):
        parts.append(f"@@ edit {i} of {len(patch.edits)} @@\n")
        parts += [f"-{line}\n" for line in edit.search.splitlines()]
        parts += [f"+{line}\n" for line in edit.replace.splitlines()]
    return "".join(parts)


def _occurrences(text: str, search: str) -> int:
    """How many places the search text starts at, overlapping ones included ('aa' occurs twice in 'aaa')."""
    count, at = 0, text.find(search)
    while at >= 0:
        count += 1
        at = text.find(search, at + 1)
    return count


def _near_miss(original: str, text: str, search: str) -> str:
    """A hint at why a search text is not found: an earlier edit changed it, or only whitespace differs."""
    if text != original and _occurrences(original, search):
        return " (an earlier edit of this patch changed that text)"
    squeeze = re.compile(r"\s+")
    if squeeze.sub(" ", search).strip() in squeeze.sub(" ", text):
        return " (it matches only if whitespace is ignored: copy the template's spaces and line breaks exactly)"
    return " (copy it from the template exactly)"
