"""The prompt's token budget: what is cut when the prompt does not fit, in an explicit order, and never silently.

Tokens are estimated at about four characters each (no tokenizer: endpoints differ, and the estimate only has to be
conservative for code). Cut first, least useful first:

  1. templates of base families (references the built-in search does not walk);
  2. the template changes of the best candidates, except the fastest one's (slowest first);
  3. the error text and changes of failures, except the latest one's (the last shown first);
  4. templates of searched families, except the most useful one (lowest-ranked by the bandit first);
  5. the fastest candidate's changes, then the latest failure's details;
  6. the most useful family's template.

Each cut is named, with its size, in the prompt ("Left out to fit the prompt budget") and in the call's record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from core.plan import ceil_div

CHARS_PER_TOKEN = 4

Cut = Callable[[], str]  # removes one part of the context, and says what it removed


def estimate_tokens(text: str) -> int:
    return ceil_div(len(text), CHARS_PER_TOKEN)


def fit_prompt(context: dict[str, Any], render: Callable[[dict[str, Any]], str],
               max_tokens: int) -> tuple[str, tuple[str, ...]]:
    """The prompt rendered from the context, cut until its estimate is within max_tokens, and what was left out
    (the context's `left_out` list, which the prompt shows, grows as parts are cut)."""
    left_out: list[str] = context["left_out"]
    text = render(context)
    cuts = _cuts(context)
    while estimate_tokens(text) > max_tokens:
        cut = next(cuts, None)
        if cut is None:
            left_out.append(f"nothing more could be cut: this prompt is about {estimate_tokens(text):,} tokens, "
                            f"over the budget of {max_tokens:,}")
            text = render(context)
            break
        left_out.append(cut())
        text = render(context)
    return text, tuple(left_out)


def _cuts(context: dict[str, Any]) -> Iterator[Cut]:
    families = sorted((f for f in context["families"] if f["template"] is not None), key=lambda f: f["usefulness"])
    base = [f for f in families if not f["searched"]]
    searched = [f for f in families if f["searched"]]
    best = [c for c in context["best"] if c["changes"]]
    failures = [c for c in context["failures"] if c["error"] or c["changes"]]
    for f in reversed(base):
        yield _template_cut(f, "base family")
    for c in reversed(best[1:]):
        yield _changes_cut(c)
    for c in reversed(failures[1:]):
        yield _failure_cut(c)
    for f in reversed(searched[1:]):
        yield _template_cut(f, "searched family")
    if best:
        yield _changes_cut(best[0])
    if failures:
        yield _failure_cut(failures[0])
    if searched:
        yield _template_cut(searched[0], "the most useful family")


def _template_cut(view: dict[str, Any], what: str) -> Cut:
    def cut() -> str:
        tokens = estimate_tokens(view["template"])
        view["template"] = None
        return f"the Jinja template of {view['name']} ({what}, ~{tokens:,} tokens)"
    return cut


def _changes_cut(view: dict[str, Any]) -> Cut:
    def cut() -> str:
        tokens = estimate_tokens(view["changes"])
        view["changes"] = None
        return f"the template changes of candidate {view['id']} (~{tokens:,} tokens)"
    return cut


def _failure_cut(view: dict[str, Any]) -> Cut:
    def cut() -> str:
        tokens = estimate_tokens(view["error"] + (view["changes"] or ""))
        view["error"], view["changes"] = "", None
        return f"the error text and changes of failed candidate {view['id']} (~{tokens:,} tokens)"
    return cut
