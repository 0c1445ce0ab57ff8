"""Validation helpers shared by every stage: pydantic's findings as one line a user can act on."""

from __future__ import annotations

from pydantic import ValidationError


def validation_message(e: ValidationError) -> str:
    """The first problem pydantic found, as one line: `field: message`."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "value"
    return f"{where}: {err['msg']}"
