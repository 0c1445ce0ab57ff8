"""Validation helpers shared by every stage: pydantic's findings as one line a user can act on."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError


def validation_message(e: ValidationError, names: Mapping[str, str] | None = None) -> str:
    """The first problem pydantic found, as one line: `field: message`, the field named as `names` maps it (a
    command-line option, say) where it has an entry."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "value"
    message = err["msg"].removeprefix("Value error, ")
    return f"{(names or {}).get(where, where)}: {message}"
