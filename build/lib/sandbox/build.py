"""Compile CUDA sources to cubins with NVRTC (no GPU needed), cached by content and toolchain.

The cache key hashes the source, the target arch, the options and the NVRTC version; entries are written
atomically (`os.replace`), so a crash never leaves a half-written cubin. The compiler's resource report
(registers, shared memory, stack frame, spills) is parsed from the `--ptxas-options=-v` log.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

from core.records import BuildResult
from core.source import NO_FILES, reads_host_files

ARCHES = ("sm_90a", "sm_80")
BASE_OPTIONS = ("--ptxas-options=-v", "-std=c++17")
DEFAULT_CACHE = Path(os.environ.get("HGEMM_AGENT_CACHE", Path.home() / ".cache" / "hgemm-agent" / "cubins"))


class NvrtcUnavailable(RuntimeError):
    pass


def nvrtc_version() -> str:
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:  # cupy missing entirely
        raise NvrtcUnavailable(f"CuPy's NVRTC bindings cannot be imported: {e}") from None
    try:
        major, minor = nvrtc.getVersion()
    except Exception as e:  # libnvrtc not found
        raise NvrtcUnavailable(f"libnvrtc cannot be loaded ({e}); pip install nvidia-cuda-nvrtc") from None
    return f"{major}.{minor}"


def _parse_resources(log: str) -> dict[str, int | None]:
    def grab(pattern: str) -> int | None:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else None

    spill_st = grab(r"(\d+) bytes spill stores") or 0
    spill_ld = grab(r"(\d+) bytes spill loads") or 0
    return {
        "registers": grab(r"Used (\d+) registers"),
        "smem_static": grab(r"(\d+) bytes smem") or 0,
        "stack_bytes": grab(r"(\d+) bytes stack frame"),
        "spill_bytes": spill_st + spill_ld if "spill" in log else None,
    }


def _compile(source: str, arch: str, options: tuple[str, ...]) -> tuple[bool, bytes | None, str]:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "kernel.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", *options])
        except Exception as e:
            log = nvrtc.getProgramLog(prog) or str(e)
            return False, None, log
        return True, nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_cuda(
    source: str,
    arch: str = "sm_90a",
    *,
    candidate_id: str = "",
    options: tuple[str, ...] = BASE_OPTIONS,
    cache_dir: Path | None = DEFAULT_CACHE,
    timeout_s: float = 60.0,
) -> BuildResult:
    """Compile one source for one arch; never raises for a bad source (the failure is in the record)."""
    if arch not in ARCHES:
        return BuildResult(candidate_id, False, arch, source, error=f"unknown arch {arch!r}")
    if reads_host_files(source):
        return BuildResult(candidate_id, False, arch, source, error=NO_FILES)
    try:
        version = nvrtc_version()
    except NvrtcUnavailable as e:
        return BuildResult(candidate_id, False, arch, source, error=str(e))
    key = hashlib.sha256(json.dumps([source, arch, options, version]).encode()).hexdigest()[:24]
    if cache_dir is not None:
        hit = _cache_load(cache_dir, key)
        if hit is not None:
            cubin, log = hit
            return BuildResult(candidate_id, True, arch, source, cubin, log, cached=True, **_parse_resources(log))
    t0 = time.perf_counter()
    ok, cubin, log, error = _compile_with_timeout(source, arch, options, timeout_s)
    elapsed = time.perf_counter() - t0
    if not ok:
        return BuildResult(candidate_id, False, arch, source, None, log, compile_s=elapsed, error=error)
    if cache_dir is not None:
        _cache_store(cache_dir, key, cubin, log)
    return BuildResult(candidate_id, True, arch, source, cubin, log, compile_s=elapsed, **_parse_resources(log))


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _compile_with_timeout(source, arch, options, timeout_s):
    """NVRTC releases the GIL, so a thread bounds the wait; a runaway compile is abandoned, not awaited."""
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvrtc")
    future = _POOL.submit(_compile, source, arch, options)
    try:
        ok, cubin, log = future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        _POOL = None  # leave the stuck thread behind; later compiles get a fresh pool
        return False, None, "", f"compile timed out after {timeout_s:.0f} s"
    return ok, cubin, log, "" if ok else _first_error_line(log)


def _first_error_line(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()[:300]
    return (log.strip().splitlines() or ["compile failed"])[0][:300]


def _cache_load(cache_dir: Path, key: str) -> tuple[bytes, str] | None:
    cubin_path, log_path = cache_dir / f"{key}.cubin", cache_dir / f"{key}.log"
    try:
        return cubin_path.read_bytes(), log_path.read_text()
    except OSError:
        return None


def _cache_store(cache_dir: Path, key: str, cubin: bytes, log: str) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # log first: a cubin without its log is never visible, since the load reads both
        for suffix, data in ((".log", log.encode()), (".cubin", cubin)):
            fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, cache_dir / f"{key}{suffix}")
    except OSError:
        pass  # a read-only or full cache only costs a recompile
