"""TMA tensor maps and kernel launches through the CUDA driver API, by ctypes.

Standalone on purpose (ctypes only, no project imports): `agent export` copies it next to the exported op. A kernel
takes its six fixed arguments (A, B, C pointers; M, N, K), the bias and residual pointers where its problem has them,
then, by value, one 128-byte `CUtensorMap` for each tensor map its family's launch rule declares, then, where the rule
asks for them, a scratch buffer and a zeroed array of counters (the kernel leaves them zeroed); `launch` passes them all
through `cuLaunchKernel`, or `cuLaunchKernelEx` with programmatic stream serialisation where it is to overlap the kernel
ahead (core/overlap.py).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable

FLOAT16 = 6  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16
SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # bytes -> CU_TENSOR_MAP_SWIZZLE_*
L2_PROMOTION_128B, L2_PROMOTION_256B = 2, 3
TENSOR_MAP_BYTES = 128
MAX_BOX = 256


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union (its first int here)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class DriverError(RuntimeError):
    """A driver call failed, or its inputs break a documented rule (named in the message)."""


_lib: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DriverError(f"the CUDA driver library could not be loaded: {e}") from None
        _lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
        _lib.cuLaunchKernel.restype = ctypes.c_int
        _lib.cuLaunchKernelEx.restype = ctypes.c_int
        _lib.cuGetErrorString.restype = ctypes.c_int
        _lib.cuMemAlloc_v2.restype = ctypes.c_int
        _lib.cuMemsetD8Async.restype = ctypes.c_int
        _lib.cuCtxGetCurrent.restype = ctypes.c_int
    return _lib


def _check(rc: int, what: str) -> None:
    if rc:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(rc, ctypes.byref(text))
        raise DriverError(f"{what} failed: CUDA error {rc} ({(text.value or b'?').decode()})")


class TensorMap(ctypes.Structure):
    """A CUtensorMap: 128 opaque bytes, 64-byte aligned when encoded (ctypes gives no alignment, so the bytes are
    encoded into an aligned scratch buffer and copied here)."""

    _fields_ = [("opaque", ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8))]


def check_tiled(address: int, dims: tuple[int, ...], box: tuple[int, ...], swizzle: int,
                strides: tuple[int, ...] = ()) -> None:
    """The documented rules of cuTensorMapEncodeTiled for an fp16 tensor, packed (no `strides`) or with the byte
    strides of dims[1:]; raises DriverError naming one."""
    if not 1 <= len(dims) <= 5 or len(box) != len(dims):
        raise DriverError(f"tensor map rank {len(dims)} (box {len(box)}): must be 1-5, one box size per dimension")
    if address % 16:
        raise DriverError(f"tensor map base address {address:#x} is not 16-byte aligned")
    if swizzle not in SWIZZLE:
        raise DriverError(f"swizzle {swizzle} B: must be one of {sorted(SWIZZLE)}")
    for i, (d, b) in enumerate(zip(dims, box, strict=True)):
        if d < 1 or not 1 <= b <= MAX_BOX:
            raise DriverError(f"dimension {i}: size {d} and box {b} must be positive, the box at most {MAX_BOX}")
    if box[0] * 2 % 16 or (swizzle and box[0] * 2 > swizzle):
        raise DriverError(f"inner box of {box[0] * 2} B must be a multiple of 16 B and within the {swizzle} B swizzle")
    if strides:
        if len(strides) != len(dims) - 1 or any(s < 16 or s % 16 or s >= 1 << 40 for s in strides):
            raise DriverError(f"strides {strides} B: one per dimension after the first, each a multiple of 16 bytes "
                              "below 2^40")
        return
    for i in range(len(dims) - 1):
        if dims[i] * 2 % 16:
            raise DriverError(f"row pitch of dimension {i} ({dims[i] * 2} B) must be a multiple of 16 bytes")


def l2_promotion(dims: tuple[int, ...], strides: tuple[int, ...] = ()) -> int:
    """256-byte L2 promotion where rows start on 128-byte boundaries, 128-byte otherwise: with rows only 16-byte
    aligned, 256-byte promotion fetched lines the box does not use (measured on the H200, 1000_3000_2000 with B K x N:
    26.2 us against 23.9 us with 128-byte promotion; no change where B's rows are 32-byte aligned)."""
    pitch = strides[0] if strides else dims[0] * 2
    return L2_PROMOTION_256B if len(dims) == 1 or pitch % 128 == 0 else L2_PROMOTION_128B


def packed_strides(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Byte strides of dims[1:] of a packed fp16 tensor (innermost dimension first)."""
    pitches, pitch = [], 2
    for d in dims[:-1]:
        pitch *= d
        pitches.append(pitch)
    return tuple(pitches)


def encode_tiled(address: int, dims: tuple[int, ...], box: tuple[int, ...], swizzle: int = 128,
                 strides: tuple[int, ...] = ()) -> TensorMap:
    """A tiled tensor map over an fp16 tensor at `address`: `dims` and `box` innermost first; rows contiguous, or
    dims[1:] `strides` bytes apart (any order: the caller keeps every address inside the tensor). Reads outside the
    dims fill zeros; stores outside them are dropped."""
    check_tiled(address, dims, box, swizzle, strides)
    rank = len(dims)
    strides = strides or packed_strides(dims)
    scratch = (ctypes.c_uint8 * (TENSOR_MAP_BYTES + 64))()
    aligned = (ctypes.addressof(scratch) + 63) // 64 * 64
    _check(_cuda().cuTensorMapEncodeTiled(
        ctypes.c_void_p(aligned), ctypes.c_int(FLOAT16), ctypes.c_uint32(rank), ctypes.c_void_p(address),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(1, rank - 1))(*strides),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        ctypes.c_int(0), ctypes.c_int(SWIZZLE[swizzle]), ctypes.c_int(l2_promotion(dims, strides)),
        ctypes.c_int(0),
    ), f"cuTensorMapEncodeTiled(dims={dims}, strides={strides}, box={box}, swizzle={swizzle})")
    out = TensorMap()
    ctypes.memmove(ctypes.addressof(out), aligned, TENSOR_MAP_BYTES)
    return out


@functools.lru_cache(maxsize=256)
def tensor_map(address: int, dims: tuple[int, ...], box: tuple[int, ...], swizzle: int = 128,
               strides: tuple[int, ...] = ()) -> TensorMap:
    """encode_tiled, remembered: a map depends only on these values, so one encoded for an address stays right
    for any tensor later placed there with the same shape (launches only read it)."""
    return encode_tiled(address, dims, box, swizzle, strides)


OPERANDS = "ABCR"  # a tensor map's operand names the pointer argument it covers (R: the residual's)


# (context, kind) -> (bytes, device pointer) of the largest buffer handed out there; smaller ones stay allocated (a
# captured graph may still launch with them).
_workspaces: dict[tuple[int, str], tuple[int, int]] = {}


def workspace(kind: str, nbytes: int, stream: int) -> int:
    """A device buffer of at least `nbytes` in the current context, one per `kind` ("scratch": contents undefined;
    "counters": zeroed, and every kernel given it leaves it zeroed), allocated (and zeroed on `stream`) on first need
    and reused. One per GPU context, so two kernels using them must not run at the same time on different streams;
    make the first call outside CUDA-graph capture (a capture would record the zeroing)."""
    ctx = ctypes.c_void_p()
    _check(_cuda().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    key = (ctx.value or 0, kind)
    have = _workspaces.get(key)
    if have is None or have[0] < nbytes:
        ptr = ctypes.c_uint64()
        _check(_cuda().cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), f"cuMemAlloc({nbytes} B {kind})")
        _check(_cuda().cuMemsetD8Async(ptr, ctypes.c_ubyte(0), ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)),
               f"cuMemsetD8Async({kind})")  # on the stream: done before any kernel launched after it there
        have = _workspaces[key] = (nbytes, ptr.value)
    return have[1]


def launch(function: int, grid: tuple[int, int, int], block: tuple[int, int, int], smem_bytes: int, stream: int,
           pointers: tuple[int, int, int], sizes: tuple[int, int, int],
           tensor_maps: Iterable[tuple] = (),
           workspace_bytes: int = 0, counters: int = 0, bias: int | None = None, residual: int | None = None,
           overlap: bool = False) -> None:
    """cuLaunchKernel(function, ...) with (A, B, C, M, N, K[, bias][, R], *maps[, scratch, counters]) on `stream` (a
    CUstream handle); `bias` is the bias vector's address where the problem has one, `residual` R's where its
    epilogue adds one; each of `tensor_maps` is
    (operand "A" | "B" | "C" | "R", dims, box, swizzle[, strides]), encoded (remembered) over that operand;
    workspace_bytes or counters > 0 append the context's scratch buffer of at least workspace_bytes and its zeroed
    buffer of at least `counters` 32-bit counters. `overlap`: the kernel may start before the one ahead of it on
    the stream has finished (it must wait for it itself: core/overlap.py)."""
    args: list[ctypes._SimpleCData | ctypes.Structure] = [ctypes.c_uint64(p) for p in pointers]
    args += [ctypes.c_int32(s) for s in sizes]
    args += [ctypes.c_uint64(p) for p in (bias, residual) if p is not None]
    covered = (*pointers, residual or 0)
    args += [tensor_map(covered[OPERANDS.index(operand)], tuple(dims), tuple(box), swizzle,
                        tuple(strides[0]) if strides else ())
             for operand, dims, box, swizzle, *strides in tensor_maps]
    if workspace_bytes > 0 or counters > 0:
        args.append(ctypes.c_uint64(workspace("scratch", max(workspace_bytes, 16), stream)))
        args.append(ctypes.c_uint64(workspace("counters", max(counters * 4, 16), stream)))
    params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
    if overlap:
        attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem_bytes,
                              ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
        _check(_cuda().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(function), params, None),
               "cuLaunchKernelEx")
        return
    _check(_cuda().cuLaunchKernel(
        ctypes.c_void_p(function), *(ctypes.c_uint(g) for g in grid), *(ctypes.c_uint(b) for b in block),
        ctypes.c_uint(smem_bytes), ctypes.c_void_p(stream), params, None,
    ), "cuLaunchKernel")
