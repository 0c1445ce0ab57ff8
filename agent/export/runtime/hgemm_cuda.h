// The few CUDA driver API entry points the compiled HGEMM op uses, declared here and opened at run time with
// dlopen("libcuda.so.1"): no CUDA headers or toolkit are needed to build it, and a machine without a GPU (CI) builds
// and loads it (the driver is opened on the first launch only).
#pragma once

#include <dlfcn.h>

#include <array>

#include <c10/util/Exception.h>

namespace hgemm_cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
struct alignas(64) CUtensorMap {
  unsigned long long opaque[16];
};
constexpr int kFuncMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kCcMajor = 75, kCcMinor = 76;    // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
constexpr int kCaptureRelaxed = 2;             // CU_STREAM_CAPTURE_MODE_RELAXED
constexpr unsigned kStreamNonBlocking = 1;     // CU_STREAM_NON_BLOCKING
constexpr int kTmaFloat16 = 6;                 // CU_TENSOR_MAP_DATA_TYPE_FLOAT16: TMA copies bytes, bf16 too

// cuLaunchKernelEx's configuration, with one attribute: programmatic stream serialisation (an overlapped launch:
// the kernel may start before the one ahead of it on the stream has finished, and waits for it itself)
constexpr int kProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
struct CUlaunchAttribute {
  int id;
  char pad[4];
  union {
    int flag;
    char value[64];
  };
};
struct CUlaunchConfig {
  unsigned grid[3], block[3], smem;
  CUstream stream;
  CUlaunchAttribute* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(CUlaunchAttribute) == 72 && sizeof(CUlaunchConfig) == 56, "the driver's launch structs");

struct Driver {
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*CtxGetCurrent)(CUcontext*);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*ModuleLoadData)(CUmodule*, const void*);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*FuncSetAttribute)(CUfunction, int, int);
  CUresult (*MemAlloc)(CUdeviceptr*, size_t);
  CUresult (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  CUresult (*StreamCreate)(CUstream*, unsigned);
  CUresult (*StreamSynchronize)(CUstream);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*ThreadExchangeStreamCaptureMode)(int*);
  CUresult (*TensorMapEncodeTiled)(CUtensorMap*, int, unsigned, void*, const unsigned long long*,
                                   const unsigned long long*, const unsigned*, const unsigned*, int, int, int, int);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void**, void**);
  CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);  // null: a driver without it
};

template <typename F>
inline void bind(void* lib, F*& slot, const char* name) {
  slot = reinterpret_cast<F*>(dlsym(lib, name));
  TORCH_CHECK(slot, "hgemm: the CUDA driver lacks ", name);
}

inline const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(lib, "hgemm: the CUDA driver library could not be loaded: ", dlerror());
    Driver x{};
    bind(lib, x.GetErrorString, "cuGetErrorString");
    bind(lib, x.CtxGetCurrent, "cuCtxGetCurrent");
    bind(lib, x.CtxSetCurrent, "cuCtxSetCurrent");
    bind(lib, x.DeviceGet, "cuDeviceGet");
    bind(lib, x.DeviceGetAttribute, "cuDeviceGetAttribute");
    bind(lib, x.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    bind(lib, x.ModuleLoadData, "cuModuleLoadData");
    bind(lib, x.ModuleGetFunction, "cuModuleGetFunction");
    bind(lib, x.FuncSetAttribute, "cuFuncSetAttribute");
    bind(lib, x.MemAlloc, "cuMemAlloc_v2");
    bind(lib, x.MemsetD8Async, "cuMemsetD8Async");
    bind(lib, x.StreamCreate, "cuStreamCreate");
    bind(lib, x.StreamSynchronize, "cuStreamSynchronize");
    bind(lib, x.StreamDestroy, "cuStreamDestroy_v2");
    bind(lib, x.ThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode");
    bind(lib, x.TensorMapEncodeTiled, "cuTensorMapEncodeTiled");
    bind(lib, x.LaunchKernel, "cuLaunchKernel");
    x.LaunchKernelEx = reinterpret_cast<decltype(x.LaunchKernelEx)>(dlsym(lib, "cuLaunchKernelEx"));
    return x;
  }();
  return d;
}

inline void check(CUresult rc, const char* what) {
  if (rc == 0) return;
  const char* text = nullptr;
  driver().GetErrorString(rc, &text);
  TORCH_CHECK(false, "hgemm: ", what, " failed: CUDA error ", rc, " (", text ? text : "?", ")");
}

// Launches fn on `stream`, overlapped with the kernel ahead where `overlap` (a driver with cuLaunchKernelEx).
inline void launch_kernel(CUfunction fn, const std::array<unsigned, 3>& grid, const std::array<unsigned, 3>& block,
                          unsigned smem, CUstream stream, void** params, bool overlap) {
  if (!overlap) {
    check(driver().LaunchKernel(fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, stream, params,
                                nullptr),
          "cuLaunchKernel");
    return;
  }
  CUlaunchAttribute attr{};
  attr.id = kProgrammaticStreamSerialization;
  attr.flag = 1;
  const CUlaunchConfig config{{grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, smem, stream, &attr, 1};
  check(driver().LaunchKernelEx(&config, fn, params, nullptr), "cuLaunchKernelEx");
}

// First use on a device may fall inside a CUDA-graph capture: loading a module, allocating and zeroing are not
// captured work, and the default (global) capture mode forbids them on this thread; relaxed mode allows them.
struct RelaxedCapture {
  int mode = kCaptureRelaxed;
  RelaxedCapture() { check(driver().ThreadExchangeStreamCaptureMode(&mode), "cuThreadExchangeStreamCaptureMode"); }
  ~RelaxedCapture() { driver().ThreadExchangeStreamCaptureMode(&mode); }
};

}  // namespace hgemm_cuda
