"""sandbox.driver on the CPU: the documented tensor-map rules are checked before the driver is called, and a
missing driver is a clear error (the encode and launch paths themselves run in the GPU tests)."""

from __future__ import annotations

import ctypes

import pytest

from sandbox import driver
from tests.conftest import HAS_GPU


def test_a_gemm_operand_map_passes():
    driver.check_tiled(0x10000, (4096, 1000), (64, 128), 128)
    driver.check_tiled(0x10000, (8, 1), (64, 256), 128)  # the box may be larger than a tiny tensor
    # kn B (K x N) viewed as 64-column panels 128 bytes apart: strides in any order
    driver.check_tiled(0x10000, (64, 2000, 48), (64, 64, 2), 128, (6144, 128))


@pytest.mark.parametrize("strides", [(6144,), (6144, 120), (6144, 0), (1 << 40, 128)])
def test_broken_strides_are_named(strides):
    with pytest.raises(driver.DriverError, match="strides"):
        driver.check_tiled(0x10000, (64, 2000, 48), (64, 64, 2), 128, strides)


@pytest.mark.parametrize("address,dims,box,swizzle,message", [
    (0x10008, (64, 64), (64, 64), 128, "not 16-byte aligned"),
    (0x10000, (64, 64), (64, 64), 96, "swizzle 96"),
    (0x10000, (64, 64), (128, 64), 128, "within the 128 B swizzle"),
    (0x10000, (64, 64), (4, 64), 0, "multiple of 16 B"),
    (0x10000, (64, 64), (64, 512), 128, "at most 256"),
    (0x10000, (60, 64), (32, 64), 128, "row pitch"),
    (0x10000, (64, 64), (64,), 128, "one box size per dimension"),
    (0x10000, (1, 1, 1, 1, 1, 1), (1,) * 6, 0, "rank 6"),
    (0x10000, (0, 64), (64, 64), 128, "must be positive"),
])
def test_broken_rules_are_named(address, dims, box, swizzle, message):
    with pytest.raises(driver.DriverError, match=message):
        driver.check_tiled(address, dims, box, swizzle)
    with pytest.raises(driver.DriverError, match=message):  # checked before any driver call
        driver.encode_tiled(address, dims, box, swizzle)


def test_tensor_map_is_the_driver_s_128_bytes():
    assert ctypes.sizeof(driver.TensorMap) == driver.TENSOR_MAP_BYTES == 128


@pytest.mark.skipif(HAS_GPU, reason="checks the no-driver path")
def test_without_a_driver_the_error_says_so(monkeypatch):
    monkeypatch.setattr(driver, "_lib", None)
    with pytest.raises(driver.DriverError, match="could not be loaded"):
        driver.encode_tiled(0x10000, (64, 64), (64, 64), 128)


def test_tensor_maps_are_remembered_per_address_and_shape(monkeypatch):
    calls = []
    monkeypatch.setattr(driver, "encode_tiled", lambda *args: calls.append(args) or driver.TensorMap())
    driver.tensor_map.cache_clear()
    first = driver.tensor_map(0x10000, (64, 64), (64, 64), 128)
    assert driver.tensor_map(0x10000, (64, 64), (64, 64), 128) is first
    driver.tensor_map(0x20000, (64, 64), (64, 64), 128)
    driver.tensor_map(0x10000, (64, 128), (64, 64), 128)
    assert len(calls) == 3
    driver.tensor_map.cache_clear()


def test_launch_encodes_each_map_over_the_operand_it_names(monkeypatch):
    encoded, launched = [], []

    class FakeDriver:
        def cuLaunchKernel(self, function, *rest):  # noqa: N802 - the driver's name
            launched.append(rest)
            return 0

    monkeypatch.setattr(driver, "_cuda", lambda: FakeDriver())
    monkeypatch.setattr(driver, "tensor_map", lambda *args: encoded.append(args) or driver.TensorMap())
    driver.launch(1, (2, 1, 1), (384, 1, 1), 1024, 0, (0xA00, 0xB00, 0xC00), (64, 64, 64),
                  [("A", [64, 64], [64, 64], 128), ("B", (64, 64, 1), (64, 64, 1), 128, [128, 128]),
                   ("C", (64, 64), (64, 64), 128)])
    assert encoded == [(0xA00, (64, 64), (64, 64), 128, ()), (0xB00, (64, 64, 1), (64, 64, 1), 128, (128, 128)),
                       (0xC00, (64, 64), (64, 64), 128, ())]
    params = launched[0][-2]
    assert len(params) == 3 + 3 + 3  # pointers, sizes, then the maps by value


def test_launch_appends_scratch_and_counters_reused_per_context(monkeypatch):
    allocs, memsets, launched = [], [], []

    class FakeDriver:
        def cuCtxGetCurrent(self, ctx):  # noqa: N802
            ctx._obj.value = 0x1234
            return 0

        def cuMemAlloc_v2(self, ptr, size):  # noqa: N802
            ptr._obj.value = 0x100000 * (len(allocs) + 1)
            allocs.append(size.value)
            return 0

        def cuMemsetD8Async(self, ptr, value, size, stream):  # noqa: N802
            memsets.append((ptr.value, value.value, size.value))
            return 0

        def cuLaunchKernel(self, function, *rest):  # noqa: N802
            launched.append(rest)
            return 0

    monkeypatch.setattr(driver, "_cuda", lambda: FakeDriver())
    monkeypatch.setattr(driver, "_workspaces", {})
    for scratch in (4096, 1024, 8192):
        driver.launch(1, (8, 1, 1), (256, 1, 1), 1024, 0, (0xA00, 0xB00, 0xC00), (64, 64, 64),
                      workspace_bytes=scratch, counters=16)
    assert allocs == [4096, 64, 8192]  # scratch, counters; reused until a larger scratch is needed
    assert all(value == 0 for _, value, _ in memsets)  # zeroed when allocated
    params = launched[-1][-2]
    assert len(params) == 3 + 3 + 2
    assert ctypes.cast(params[6], ctypes.POINTER(ctypes.c_uint64)).contents.value == 0x300000  # the new scratch
    assert ctypes.cast(params[7], ctypes.POINTER(ctypes.c_uint64)).contents.value == 0x200000  # same counters
    driver.launch(1, (8, 1, 1), (256, 1, 1), 1024, 0, (0xA00, 0xB00, 0xC00), (64, 64, 64))
    assert len(launched[-1][-2]) == 6  # no workspace asked for: none passed


def test_l2_promotion_narrows_for_rows_off_128_byte_boundaries():
    assert driver.l2_promotion((4096, 4096)) == driver.L2_PROMOTION_256B
    assert driver.l2_promotion((64, 1000)) == driver.L2_PROMOTION_256B  # 128-byte rows
    assert driver.l2_promotion((3000, 2000)) == driver.L2_PROMOTION_128B  # 6000-byte rows: 16-byte aligned only
    assert driver.l2_promotion((2000, 1000)) == driver.L2_PROMOTION_128B
    assert driver.l2_promotion((64, 2000, 64), (8192, 128)) == driver.L2_PROMOTION_256B  # the row stride decides
    assert driver.l2_promotion((64, 2000, 47), (6000, 128)) == driver.L2_PROMOTION_128B
