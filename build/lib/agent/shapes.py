"""Parse GEMM shapes from the command line (`M_N_K[,M_N_K...]`) and from shape files (one a line, `#` comments)."""

from __future__ import annotations

import re
from pathlib import Path

from core.records import Problem

_SHAPE = re.compile(r"^(\d+)_(\d+)_(\d+)$")


class ShapeError(ValueError):
    pass


def parse_shape(text: str, b_layout: str = "kn") -> Problem:
    text = text.strip()
    m = _SHAPE.match(text)
    if not m:
        raise ShapeError(f"malformed shape {text!r}: expected M_N_K with three positive integers, e.g. 4096_4096_4096")
    try:
        return Problem(int(m[1]), int(m[2]), int(m[3]), b_layout)
    except ValueError as e:
        raise ShapeError(f"shape {text!r}: {e}") from None


def parse_shape_list(text: str, b_layout: str = "kn") -> list[Problem]:
    items = [s for s in text.split(",")]
    if not any(s.strip() for s in items):
        raise ShapeError("no shape given: expected M_N_K, e.g. 4096_4096_4096")
    return _dedupe([parse_shape(s, b_layout) for s in items])


def read_shapes_file(path: Path, b_layout: str = "kn") -> list[Problem]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ShapeError(f"cannot read shapes file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ShapeError(f"shapes file {path} is not text") from None
    problems = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            problems.append(parse_shape(line, b_layout))
        except ShapeError as e:
            raise ShapeError(f"{path}:{number}: {e}") from None
    if not problems:
        raise ShapeError(f"shapes file {path} holds no shape")
    return _dedupe(problems)


def _dedupe(problems: list[Problem]) -> list[Problem]:
    return list(dict.fromkeys(problems))
