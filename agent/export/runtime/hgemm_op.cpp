// The compiled HGEMM op of an hgemm-agent export (built by hgemm_build.py with torch.utils.cpp_extension and the
// host compiler; no CUDA toolkit: hgemm_cuda.h opens the CUDA driver at run time): routing and launches.
// hgemm_library.cpp registers the ops (hgemm::mm, hgemm::linear, hgemm::fused_linear, hgemm::norm_linear) on top of
// what is here; hgemm_route.cpp chooses the kernel for a call and computes what PyTorch does where none serves;
// hgemm_table.cpp keeps the kernels by M interval; hgemm_module.cpp is the Python side.
//
// A call runs an exported kernel where its (N, K, layout, dtype, bias, epilogue) was tuned for an M interval holding
// its M (a hash lookup of the series, then a binary search of its intervals' starts) and its operands are plain,
// contiguous, 16-byte aligned CUDA tensors of one device; anything else goes to at::matmul / at::linear and the
// epilogue's ops (an unserved gated call: cuBLAS's GEMM, then the export's one gated kernel, hgemm_gated.cu, where it
// fits the GPU). The launch at M (grid, tensor-map dims and boxes) comes from the kernel's segment holding M (another
// binary search), as the family's launch rule gave it at that M (agent/export/geometry.py). rms_norm runs the export's
// RMSNorm kernel (hgemm_norm.cu) for a patched model's norms.
//
// Per device: each cubin is loaded once into the primary context, its dynamic shared memory raised; one scratch
// buffer and one zeroed counter array serve every kernel that asks for them (the kernels leave the counters zeroed).
// Tensor maps are encoded once per (kernel, operand, address, M). Clusters need nothing here: kernels that use them
// declare __cluster_dims__ in their source, so a plain cuLaunchKernel forms them. The stream is PyTorch's current
// stream for the device (current_stream below: no CUDA build of torch's headers needed), so launches land in
// CUDA-graph captures. A kernel registered with `overlap` (it waits for the kernel ahead itself: core/overlap.py)
// is launched overlapped on sm_90 and newer (cuLaunchKernelEx, programmatic stream serialisation) unless the switch
// is off (HGEMM_OPS_OVERLAP=0, or hgemm::set_overlap).
#include "hgemm_op.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DeviceGuard.h>

#include "hgemm_cuda.h"

namespace {

using namespace hgemm_cuda;
using hgemm::Kernel;
using hgemm::MapSpec;
using hgemm::ProblemKey;

struct MapKey {
  uint64_t kernel;
  int device, map;
  uintptr_t address;
  int64_t m;
  bool operator==(const MapKey& o) const {
    return kernel == o.kernel && device == o.device && map == o.map && address == o.address && m == o.m;
  }
};
struct MapHash {
  size_t operator()(const MapKey& k) const {
    return std::hash<uintptr_t>()(k.address) ^ (k.kernel * 0x9E3779B97F4A7C15ull) ^ (k.device << 4 | k.map) ^
           (static_cast<uint64_t>(k.m) * 0xC2B2AE3D27D4EB4Full);
  }
};

struct DeviceState {
  CUcontext context = nullptr;
  int major = 0, minor = 0;
  std::unordered_map<uint64_t, CUfunction> functions;  // nullptr: the cubin is not for this GPU
  CUdeviceptr scratch = 0, counters = 0;
  size_t scratch_bytes = 0, counter_bytes = 0;
};

constexpr size_t kMapCacheLimit = 1 << 14;  // activations move: bound the cache, refill after clearing

std::mutex mutex;  // guards everything below (the registry has its own: hgemm_table.cpp)
std::unordered_map<int, DeviceState> devices;
std::unordered_map<MapKey, CUtensorMap, MapHash> map_cache;

bool arch_fits(const std::string& arch, int major, int minor) {
  if (arch == "sm_90a") return major == 9 && minor == 0;  // arch-specific code (wgmma, setmaxnreg): sm_90 only
  if (arch.size() != 5 || arch.compare(0, 3, "sm_") != 0) return false;
  return major == arch[3] - '0' && minor >= arch[4] - '0';  // SASS runs on later minors of its major
}

// The overlap switch (hgemm::set_overlap): on unless HGEMM_OPS_OVERLAP is 0.
std::atomic<bool>& overlap_switch() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("HGEMM_OPS_OVERLAP");
    return !(v && std::string(v) == "0");
  }()};
  return on;
}

// Whether kern is launched overlapped on this device: it waits for the kernel ahead itself, the GPU is sm_90 or
// newer, the driver has cuLaunchKernelEx, and the switch is on.
bool overlaps(const DeviceState& st, const Kernel& kern) {
  return kern.overlap && overlap_switch().load(std::memory_order_relaxed) && st.major >= 9 && driver().LaunchKernelEx;
}

DeviceState& device_state(int index) {  // with the device's primary context current
  auto [it, fresh] = devices.try_emplace(index);
  DeviceState& st = it->second;
  if (fresh) {
    RelaxedCapture relaxed;
    const Driver& d = driver();
    CUdevice dev = 0;
    check(d.DeviceGet(&dev, index), "cuDeviceGet");
    check(d.DevicePrimaryCtxRetain(&st.context, dev), "cuDevicePrimaryCtxRetain");
    check(d.DeviceGetAttribute(&st.major, kCcMajor, dev), "cuDeviceGetAttribute");
    check(d.DeviceGetAttribute(&st.minor, kCcMinor, dev), "cuDeviceGetAttribute");
  }
  CUcontext current = nullptr;
  check(driver().CtxGetCurrent(&current), "cuCtxGetCurrent");
  if (current != st.context) check(driver().CtxSetCurrent(st.context), "cuCtxSetCurrent");
  return st;
}

// The kernel's function on this GPU (normed: its norm variant's), loaded once; nullptr where it does not fit.
CUfunction function_for(DeviceState& st, const Kernel& kern, bool normed = false) {
  const uint64_t id = normed ? ~kern.id : kern.id;  // registrations count up from 1: never another's id
  auto it = st.functions.find(id);
  if (it != st.functions.end()) return it->second;
  CUfunction fn = nullptr;
  if (arch_fits(kern.arch, st.major, st.minor)) {
    RelaxedCapture relaxed;
    CUmodule module = nullptr;
    check(driver().ModuleLoadData(&module, (normed ? kern.norm_cubin : kern.cubin).data()), "cuModuleLoadData");
    check(driver().ModuleGetFunction(&fn, module, "hgemm"), "cuModuleGetFunction");
    check(driver().FuncSetAttribute(fn, kFuncMaxDynamicSharedBytes, static_cast<int>(kern.smem)),
          "cuFuncSetAttribute");
  } else {
    TORCH_WARN_ONCE("hgemm: kernels built for ", kern.arch, " do not run on this GPU (sm_", st.major, st.minor,
                    "): cuBLAS serves them");
  }
  st.functions.emplace(id, fn);
  return fn;
}

CUdeviceptr grow(CUdeviceptr& ptr, size_t& have, size_t need, bool zeroed) {
  if (need <= have) return ptr;
  RelaxedCapture relaxed;
  const Driver& d = driver();
  CUdeviceptr fresh = 0;
  check(d.MemAlloc(&fresh, need), "cuMemAlloc");
  if (zeroed) {  // on a private stream, finished before any kernel can use it (a capture would only record it)
    CUstream s = nullptr;
    check(d.StreamCreate(&s, kStreamNonBlocking), "cuStreamCreate");
    check(d.MemsetD8Async(fresh, 0, need, s), "cuMemsetD8Async");
    check(d.StreamSynchronize(s), "cuStreamSynchronize");
    d.StreamDestroy(s);
  }
  ptr = fresh, have = need;  // the old buffer stays allocated: a captured graph may still use it
  return ptr;
}

const CUtensorMap& tensor_map(const Kernel& kern, int device, int index, void* address, int64_t m,
                              const hgemm::Geometry& at) {
  const MapKey key{kern.id, device, index, reinterpret_cast<uintptr_t>(address), m};
  auto it = map_cache.find(key);
  if (it != map_cache.end()) return it->second;
  if (map_cache.size() >= kMapCacheLimit) map_cache.clear();
  const MapSpec& s = kern.maps[index];
  static const std::array<unsigned, 5> ones{1, 1, 1, 1, 1};
  CUtensorMap map;
  check(driver().TensorMapEncodeTiled(&map, kTmaFloat16, s.rank, address, at.dims[index].data(), s.strides.data(),
                                      at.boxes[index].data(), ones.data(), 0, s.swizzle, s.l2, 0),
        "cuTensorMapEncodeTiled");
  return map_cache.emplace(key, map).first->second;
}

// PyTorch's current stream on a device, from the C shim that AOTInductor's CUDA code calls
// (aoti_torch_get_current_cuda_stream in libtorch_cuda.so, a plain C function of every CUDA build for many releases;
// c10::Stream::native_handle() is too recent to count on). Looked up once, when the first kernel launches: the CPU
// build of torch (CI) has no such library and never gets here.
CUstream current_stream(int device) {
  using Getter = int32_t (*)(int32_t, void**);
  static const Getter getter = [] {
    void* lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    void* sym = lib ? dlsym(lib, "aoti_torch_get_current_cuda_stream") : nullptr;
    TORCH_CHECK(sym, "hgemm: PyTorch's CUDA library is not loaded (no aoti_torch_get_current_cuda_stream)");
    return reinterpret_cast<Getter>(sym);
  }();
  void* stream = nullptr;
  TORCH_CHECK(getter(device, &stream) == 0, "hgemm: PyTorch's current CUDA stream could not be read");
  return static_cast<CUstream>(stream);
}

// Runs the kernel; nullopt where its cubin does not fit this GPU.
std::optional<at::Tensor> launch(const Kernel& kern, const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor* bias, const at::Tensor* residual,
                                 const hgemm::NormArgs* norm = nullptr) {
  c10::DeviceGuard guard(a.device());
  const int device = a.get_device();
  const int64_t m = a.numel() / kern.k;
  const hgemm::Geometry at = hgemm::geometry_at(kern, m);
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end() - 1);
  shape.push_back(hgemm::gated(kern.epilogue) ? kern.n / 2 : kern.n);
  std::array<CUtensorMap, hgemm::kMaxMaps> maps;
  void* ptrs[3] = {const_cast<void*>(a.const_data_ptr()), const_cast<void*>(b.const_data_ptr()), nullptr};
  void* residual_ptr = residual ? const_cast<void*>(residual->const_data_ptr()) : nullptr;
  CUfunction fn = nullptr;
  bool overlap = false;
  CUdeviceptr scratch = 0, counters = 0;
  at::Tensor c;
  {
    std::lock_guard<std::mutex> lock(mutex);
    DeviceState& st = device_state(device);
    fn = function_for(st, kern, norm != nullptr);
    if (!fn) return std::nullopt;
    overlap = overlaps(st, kern);
    if (kern.workspace_bytes || kern.counters) {
      scratch = grow(st.scratch, st.scratch_bytes, std::max<size_t>(kern.workspace_bytes, 16), false);
      counters = grow(st.counters, st.counter_bytes, std::max<size_t>(kern.counters * 4, 16), true);
    }
    c = at::empty(shape, a.options());
    ptrs[2] = c.data_ptr();
    for (size_t i = 0; i < kern.maps.size(); ++i) {  // operand 3: the residual
      const int op = kern.maps[i].operand;
      maps[i] = tensor_map(kern, device, i, op == 3 ? residual_ptr : ptrs[op], m, at);
    }
  }
  int32_t sizes[3] = {static_cast<int32_t>(m), static_cast<int32_t>(kern.n), static_cast<int32_t>(kern.k)};
  void* bias_ptr = bias ? const_cast<void*>(bias->const_data_ptr()) : nullptr;
  std::array<void*, 17> params;
  size_t np = 0;
  for (auto& p : ptrs) params[np++] = &p;
  for (auto& s : sizes) params[np++] = &s;
  if (bias) params[np++] = &bias_ptr;
  if (residual) params[np++] = &residual_ptr;
  for (size_t i = 0; i < kern.maps.size(); ++i) params[np++] = &maps[i];
  if (scratch) params[np++] = &scratch, params[np++] = &counters;
  void* norm_ptr = norm ? const_cast<void*>(norm->w.const_data_ptr()) : nullptr;
  float epsilon = norm ? static_cast<float>(norm->eps) : 0.0f;
  int rounding = norm ? static_cast<int>(norm->kind) : 0;
  if (norm) params[np++] = &norm_ptr, params[np++] = &epsilon, params[np++] = &rounding;
  launch_kernel(fn, at.grid, kern.block, kern.smem, current_stream(device), params.data(), overlap);
  return c;
}

// The helper kernel registered under `key` as this GPU runs it (x's device current; fn nullptr where none is or its
// cubin does not fit the GPU), and whether it is launched overlapped.
struct Helper {
  CUfunction fn = nullptr;
  bool overlap = false;
};
Helper helper_function(const std::string& key, const at::Tensor& x) {
  const auto kern = hgemm::find_helper(key);
  if (!kern) return {};
  std::lock_guard<std::mutex> lock(mutex);
  DeviceState& st = device_state(x.get_device());
  return {function_for(st, *kern), overlaps(st, *kern)};
}

void launch_helper(const Helper& h, unsigned grid, const at::Tensor& x, void** params) {
  launch_kernel(h.fn, {grid, 1, 1}, {256, 1, 1}, 0, current_stream(x.get_device()), params, h.overlap);
}

bool plain_cuda(const at::Tensor& t) {
  return t.is_cuda() && t.is_contiguous() && t.dim() >= 1 &&
         reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

const char* dtype_name(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? "bf16" : "f16"; }

// act(gate) * up of y (an unfused gated GEMM's output) by the export's gated kernel, y read once; nullopt where
// none is registered for y's dtype and the epilogue, its cubin does not fit this GPU, or y is not a plain tensor.
std::optional<at::Tensor> gated_kernel(const at::Tensor& y, int64_t epilogue) {
  if (!hgemm::gated(static_cast<int>(epilogue)) || !plain_cuda(y) || y.size(-1) % 16 != 0) return std::nullopt;
  c10::DeviceGuard guard(y.device());
  const Helper fn = helper_function(std::string(epilogue == hgemm::kGeluMul ? "gelu_mul:" : "silu_mul:") +
                                        dtype_name(y), y);
  if (!fn.fn) return std::nullopt;
  std::vector<int64_t> shape(y.sizes().begin(), y.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, y.options());
  long long blocks = y.numel() / 16;  // 8 gate and 8 up columns each
  if (blocks == 0) return out;
  void* y_ptr = const_cast<void*>(y.const_data_ptr());
  void* out_ptr = out.data_ptr();
  void* params[3] = {&y_ptr, &out_ptr, &blocks};
  launch_helper(fn, static_cast<unsigned>(std::min<long long>((blocks + 255) / 256, 1 << 20)), y, params);
  return out;
}

}  // namespace

namespace hgemm {

at::Tensor run(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk,
               int64_t epilogue, const std::optional<at::Tensor>& residual) {
  const at::Tensor* bp = bias && bias->defined() ? &*bias : nullptr;
  const at::Tensor* rp = residual && residual->defined() ? &*residual : nullptr;
  if (auto kern = choose(a, b, bp, nk, static_cast<int>(epilogue), rp, nullptr))
    if (auto c = launch(*kern, a, b, bp, rp)) return *c;
  if (hgemm::gated(epilogue)) {  // cuBLAS's GEMM, then act(gate) * up in one kernel where the export has it
    const at::Tensor y = fallback(a, b, bias, nk);
    if (auto c = gated_kernel(y, epilogue)) return *c;
    return compose(y, epilogue, residual);
  }
  return fallback(a, b, bias, nk, epilogue, residual);
}

std::optional<at::Tensor> launch_normed(const Kernel& kernel, const at::Tensor& x, const at::Tensor& w,
                                        const at::Tensor* bias, const at::Tensor* residual, const NormArgs& norm) {
  if (kernel.norm_cubin.empty()) return std::nullopt;
  return launch(kernel, x, w, bias, residual, &norm);
}

bool overlap_enabled() { return overlap_switch().load(); }
bool set_overlap(bool enabled) { return overlap_switch().exchange(enabled); }

std::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t kind,
                                   const std::optional<at::Tensor>& residual) {
  const int64_t h = x.dim() >= 1 ? x.size(-1) : 0;
  if (!plain_cuda(x) || !plain_cuda(w) || w.dim() != 1 || w.size(0) != h || h % 8 != 0 || h == 0 ||
      h > (int64_t{1} << 30) || x.numel() / h >= (int64_t{1} << 31) || w.scalar_type() != x.scalar_type() ||
      w.device() != x.device() || (x.scalar_type() != at::kHalf && x.scalar_type() != at::kBFloat16) || kind < 0 ||
      kind > 2)
    return std::nullopt;  // more rows than one grid holds among them: PyTorch's ops, as on the Python path
  if (residual && (!plain_cuda(*residual) || residual->sizes() != x.sizes() ||
                   residual->scalar_type() != x.scalar_type() || residual->device() != x.device()))
    return std::nullopt;
  c10::DeviceGuard guard(x.device());
  const Helper fn = helper_function(std::string("rms_norm:") + dtype_name(x), x);
  if (!fn.fn) return std::nullopt;
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.numel() / h;
  if (rows == 0) return out;
  void* x_ptr = const_cast<void*>(x.const_data_ptr());
  void* w_ptr = const_cast<void*>(w.const_data_ptr());
  void* r_ptr = residual ? const_cast<void*>(residual->const_data_ptr()) : nullptr;
  void* out_ptr = out.data_ptr();
  int hidden = static_cast<int>(h);
  float epsilon = static_cast<float>(eps);
  int rounding = static_cast<int>(kind);
  void* params[7] = {&x_ptr, &w_ptr, &r_ptr, &out_ptr, &hidden, &epsilon, &rounding};
  launch_helper(fn, static_cast<unsigned>(rows), x, params);  // a block a row
  return out;
}

}  // namespace hgemm
