"""Parse GEMM shapes from the command line (`M_N_K[,M_N_K...]`) and from shape files (one a line, `#` comments).

A shape is `M_N_K`, optionally followed by its B layout, its dtype, a bias and a fused epilogue, as the run tables
print them: `M_N_K`, `M_N_K:nk`, `M_N_K:nk:bf16`, `M_N_K:nk:bf16:bias`, `M_N_K:nk:bf16:bias:silu_mul`,
`M_N_K:nk:f16:residual`. Fields a shape leaves out take the caller's defaults (the command line's --b-layout, --dtype,
--bias, --epilogue); a shape that names its dtype also says whether it has a bias and an epilogue (named after it,
or none). M may be a range, `LO-HI_N_K` (every M from LO to HI: `run` searches it in buckets, agent/buckets.py);
`M-M` is the single M.
"""

from __future__ import annotations

import re
from pathlib import Path

from agent.buckets import representative
from core.epilogue import EPILOGUES
from core.records import B_LAYOUTS, Problem

_SHAPE = re.compile(r"^(\d+)(?:-(\d+))?_(\d+)_(\d+)$")
DTYPE_NAMES = {"f16": "f16", "fp16": "f16", "bf16": "bf16"}  # spellings accepted -> Problem.dtype


class ShapeError(ValueError):
    pass


def parse_dtype(text: str) -> str:
    try:
        return DTYPE_NAMES[text]
    except KeyError:
        raise ShapeError(f"unknown dtype {text!r}: use one of {', '.join(DTYPE_NAMES)}") from None


def parse_shape(text: str, b_layout: str = "kn", dtype: str = "f16", bias: bool = False,
                epilogue: str = "none") -> Problem:
    text = text.strip()
    mnk, *fields = text.split(":")
    m = _SHAPE.match(mnk)
    if not m or len(fields) > 4 or "" in fields:
        raise ShapeError(f"malformed shape {text!r}: expected M_N_K[:layout[:dtype][:bias][:epilogue]] with three "
                         "positive integers (M may be a range LO-HI), e.g. 4096_4096_4096, "
                         "16_28672_4096:nk:bf16:bias:silu_mul or 1-512_4096_4096:nk")
    if fields:
        if fields[0] not in B_LAYOUTS:
            raise ShapeError(f"shape {text!r}: unknown B layout {fields[0]!r}: use one of {', '.join(B_LAYOUTS)}")
        b_layout = fields[0]
    rest = fields[1:]
    if rest:  # the shape names its own dtype (or takes the default one), bias and epilogue
        bias, epilogue = False, "none"
        if rest[0] != "bias" and rest[0] not in EPILOGUES:
            dtype, rest = parse_dtype(rest[0]), rest[1:]
    if rest and rest[0] == "bias":
        bias, rest = True, rest[1:]
    if rest:
        if len(rest) > 1 or rest[0] not in EPILOGUES:
            raise ShapeError(f"shape {text!r}: expected 'bias' and/or an epilogue ({', '.join(EPILOGUES)}) after the "
                             f"dtype, got {':'.join(rest)!r}")
        epilogue = rest[0]
    lo, hi = int(m[1]), int(m[2] or m[1])
    try:
        if lo > hi:
            raise ValueError(f"the M range {lo}-{hi} is empty (reversed): write it low-high, e.g. {hi}-{lo}")
        span = (lo, hi) if hi > lo else None
        return Problem(representative(lo, hi) if span else lo, int(m[3]), int(m[4]), b_layout,
                       DTYPE_NAMES.get(dtype, dtype), bias, epilogue, m_range=span)
    except ValueError as e:
        raise ShapeError(f"shape {text!r}: {e}") from None


def parse_shape_list(text: str, b_layout: str = "kn", dtype: str = "f16", bias: bool = False,
                     epilogue: str = "none") -> list[Problem]:
    items = [s for s in text.split(",")]
    if not any(s.strip() for s in items):
        raise ShapeError("no shape given: expected M_N_K, e.g. 4096_4096_4096")
    return _dedupe([parse_shape(s, b_layout, dtype, bias, epilogue) for s in items])


def read_shapes_file(path: Path, b_layout: str = "kn", dtype: str = "f16", bias: bool = False,
                     epilogue: str = "none") -> list[Problem]:
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
            problems.append(parse_shape(line, b_layout, dtype, bias, epilogue))
        except ShapeError as e:
            raise ShapeError(f"{path}:{number}: {e}") from None
    if not problems:
        raise ShapeError(f"shapes file {path} holds no shape")
    return _dedupe(problems)


def _dedupe(problems: list[Problem]) -> list[Problem]:
    return list(dict.fromkeys(problems))
