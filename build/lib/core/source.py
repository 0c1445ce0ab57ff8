"""What every kernel source must be before it reaches the compiler: self-contained, with the one entry point.

NVRTC reads host files named by `#include`-like directives, and its log (which reaches prompts) would carry them back,
so such sources are refused. Families check rendered sources here; the build refuses them again as a last line.
"""

from __future__ import annotations

import re

MAX_SOURCE_CHARS = 256_000
KERNEL_ENTRY = re.compile(r'extern\s+"C"[^;{]*\bhgemm\s*\(')
_FILE_DIRECTIVE = re.compile(r"(#|%:)\s*(include|include_next|import|embed)\b|__has_include")
NO_FILES = ("#include and other file-reading directives are not allowed: the kernel must be self-contained "
            "(inline PTX, no headers)")


def reads_host_files(source: str) -> bool:
    """True when the source has a directive that makes the compiler read a file (comments and line splices seen
    through)."""
    text = re.sub(r"\\[ \t]*\r?\n", "", source)
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return bool(_FILE_DIRECTIVE.search(text))


def source_problem(source: str) -> str | None:
    """Why a rendered kernel source cannot be compiled as a candidate, or None if it can."""
    if len(source) > MAX_SOURCE_CHARS:
        return f"the rendered source has {len(source)} characters; at most {MAX_SOURCE_CHARS}"
    if reads_host_files(source):
        return NO_FILES
    if not KERNEL_ENTRY.search(source):
        return ('the rendered source must define extern "C" __global__ void hgemm(const unsigned short* A, '
                "const unsigned short* B, unsigned short* C, int M, int N, int K)")
    return None
