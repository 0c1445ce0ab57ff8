// The compiled HGEMM op of an hgemm-agent export (built by hgemm_build.py with torch.utils.cpp_extension and the
// host compiler; no CUDA toolkit: the CUDA driver is opened at run time and its few entry points declared here).
//
// Registers hgemm::mm(a, b) (torch.matmul with a K x N B) and hgemm::linear(x, w, bias=None) (F.linear) with
// TORCH_LIBRARY, and makes a Python module with the same two calls that skips the dispatcher's Python argument
// parsing (hgemm_ops.py uses them in eager mode, the registered ops under torch.compile). A call runs an exported
// kernel where its (M, N, K, layout, dtype, bias) was tuned and its operands are plain, contiguous, 16-byte aligned
// CUDA tensors of one device, with no gradient wanted; anything else goes to at::matmul / at::linear.
//
// Kernels are registered from Python (add_kernel, one manifest entry each, tensor-map arguments precomputed by
// hgemm_driver.py so the encoding rules live in one place). Per device: each cubin is loaded once into the primary
// context, its dynamic shared memory raised; one scratch buffer and one zeroed counter array serve every kernel
// that asks for them (the kernels leave the counters zeroed). Tensor maps are encoded once per (kernel, operand,
// address). Clusters need nothing here: kernels that use them declare __cluster_dims__ in their source, so a plain
// cuLaunchKernel forms them. The stream is PyTorch's current stream for the device, read through the
// device-generic c10 API (no CUDA build of torch's headers needed), so launches land in CUDA-graph captures.
#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

namespace {

// ---- the CUDA driver API, opened at run time ---------------------------------------------------------------------
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
};

template <typename F>
void bind(void* lib, F*& slot, const char* name) {
  slot = reinterpret_cast<F*>(dlsym(lib, name));
  TORCH_CHECK(slot, "hgemm: the CUDA driver lacks ", name);
}

const Driver& driver() {
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
    return x;
  }();
  return d;
}

void check(CUresult rc, const char* what) {
  if (rc == 0) return;
  const char* text = nullptr;
  driver().GetErrorString(rc, &text);
  TORCH_CHECK(false, "hgemm: ", what, " failed: CUDA error ", rc, " (", text ? text : "?", ")");
}

// First use on a device may fall inside a CUDA-graph capture: loading a module, allocating and zeroing are not
// captured work, and the default (global) capture mode forbids them on this thread; relaxed mode allows them.
struct RelaxedCapture {
  int mode = kCaptureRelaxed;
  RelaxedCapture() { check(driver().ThreadExchangeStreamCaptureMode(&mode), "cuThreadExchangeStreamCaptureMode"); }
  ~RelaxedCapture() { driver().ThreadExchangeStreamCaptureMode(&mode); }
};

// ---- registered kernels -------------------------------------------------------------------------------------------
struct MapSpec {  // cuTensorMapEncodeTiled's arguments but the address
  int operand = 0;  // 0 A, 1 B, 2 C
  unsigned rank = 0;
  std::array<unsigned long long, 5> dims{}, strides{};
  std::array<unsigned, 5> box{};
  int swizzle = 0, l2 = 0;
};

struct Kernel {
  uint64_t id = 0;  // unique per registration: caches key on it, so a replaced kernel's entries go unused
  std::string key, arch, cubin;
  int64_t m = 0, n = 0, k = 0;
  std::array<unsigned, 3> grid{}, block{};
  unsigned smem = 0;
  std::vector<MapSpec> maps;
  size_t workspace_bytes = 0, counters = 0;
};

struct ProblemKey {
  int64_t m, n, k;
  bool nk, bf16, bias;
  bool operator==(const ProblemKey& o) const {
    return m == o.m && n == o.n && k == o.k && nk == o.nk && bf16 == o.bf16 && bias == o.bias;
  }
};
struct ProblemHash {
  size_t operator()(const ProblemKey& p) const {
    return std::hash<int64_t>()((p.m * 1000003 + p.n) * 1000003 + p.k) ^ (p.nk | p.bf16 << 1 | p.bias << 2);
  }
};

struct MapKey {
  uint64_t kernel;
  int device, map;
  uintptr_t address;
  bool operator==(const MapKey& o) const {
    return kernel == o.kernel && device == o.device && map == o.map && address == o.address;
  }
};
struct MapHash {
  size_t operator()(const MapKey& k) const {
    return std::hash<uintptr_t>()(k.address) ^ (k.kernel * 0x9E3779B97F4A7C15ull) ^ (k.device << 4 | k.map);
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

std::mutex mutex;  // guards everything below
std::unordered_map<ProblemKey, std::shared_ptr<const Kernel>, ProblemHash> kernels;
std::unordered_map<int, DeviceState> devices;
std::unordered_map<MapKey, CUtensorMap, MapHash> map_cache;
uint64_t next_id = 1;

bool arch_fits(const std::string& arch, int major, int minor) {
  if (arch == "sm_90a") return major == 9 && minor == 0;  // arch-specific code (wgmma, setmaxnreg): sm_90 only
  if (arch.size() != 5 || arch.compare(0, 3, "sm_") != 0) return false;
  return major == arch[3] - '0' && minor >= arch[4] - '0';  // SASS runs on later minors of its major
}

DeviceState& device_state(int index) {  // with the device's primary context current
  auto [it, fresh] = devices.try_emplace(index);
  DeviceState& st = it->second;
  if (fresh) {
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

CUfunction function_for(DeviceState& st, const Kernel& kern) {
  auto it = st.functions.find(kern.id);
  if (it != st.functions.end()) return it->second;
  CUfunction fn = nullptr;
  if (arch_fits(kern.arch, st.major, st.minor)) {
    RelaxedCapture relaxed;
    CUmodule module = nullptr;
    check(driver().ModuleLoadData(&module, kern.cubin.data()), "cuModuleLoadData");
    check(driver().ModuleGetFunction(&fn, module, "hgemm"), "cuModuleGetFunction");
    check(driver().FuncSetAttribute(fn, kFuncMaxDynamicSharedBytes, static_cast<int>(kern.smem)),
          "cuFuncSetAttribute");
  } else {
    TORCH_WARN_ONCE("hgemm: kernels built for ", kern.arch, " do not run on this GPU (sm_", st.major, st.minor,
                    "): cuBLAS serves them");
  }
  st.functions.emplace(kern.id, fn);
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

const CUtensorMap& tensor_map(const Kernel& kern, int device, int index, void* address) {
  const MapKey key{kern.id, device, index, reinterpret_cast<uintptr_t>(address)};
  auto it = map_cache.find(key);
  if (it != map_cache.end()) return it->second;
  if (map_cache.size() >= kMapCacheLimit) map_cache.clear();
  const MapSpec& s = kern.maps[index];
  static const std::array<unsigned, 5> ones{1, 1, 1, 1, 1};
  CUtensorMap map;
  check(driver().TensorMapEncodeTiled(&map, kTmaFloat16, s.rank, address, s.dims.data(), s.strides.data(),
                                      s.box.data(), ones.data(), 0, s.swizzle, s.l2, 0),
        "cuTensorMapEncodeTiled");
  return map_cache.emplace(key, map).first->second;
}

// ---- routing ------------------------------------------------------------------------------------------------------
// The kernel for a @ B (B given K x N, or N x K when nk) + bias, or nullptr with the reason in *why.
std::shared_ptr<const Kernel> choose(const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias, bool nk,
                                     std::string* why) {
  auto no = [&](auto&& reason) {
    if (why) *why = reason;
    return std::shared_ptr<const Kernel>();
  };
  if (b.dim() != 2 || a.dim() < 1) return no("B is not a matrix");
  const int64_t k = a.size(-1), n = b.size(nk ? 0 : 1);
  if (b.size(nk ? 1 : 0) != k || k == 0) return no("A's last dimension is not B's K");
  const auto dtype = a.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) return no("dtype is neither float16 nor bfloat16");
  if (b.scalar_type() != dtype || (bias && bias->scalar_type() != dtype)) return no("operands of mixed dtypes");
  std::shared_ptr<const Kernel> kern;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = kernels.find({a.numel() / k, n, k, nk, dtype == at::kBFloat16, bias != nullptr});
    if (it == kernels.end()) return no("shape not tuned");
    kern = it->second;
  }
  auto tuned_but = [&](const char* reason) {
    if (why) *why = std::string(reason) + " (tuned: " + kern->key + ")";
    return std::shared_ptr<const Kernel>();
  };
  if (bias && (bias->dim() != 1 || bias->size(0) != n)) return tuned_but("bias is not a vector of N");
  if (!a.is_contiguous() || !b.is_contiguous() || (bias && !bias->is_contiguous()))
    return tuned_but("an operand is not contiguous");
  auto misaligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0; };
  if (misaligned(a) || misaligned(b) || (bias && misaligned(*bias)))
    return tuned_but("an operand is not 16-byte aligned");
  if (!a.is_cuda() || b.device() != a.device() || (bias && bias->device() != a.device()))
    return tuned_but("operands are not on one CUDA device");
  if (why) *why = "kernel " + kern->key;
  return kern;
}

// Runs the kernel; nullopt where its cubin does not fit this GPU.
std::optional<at::Tensor> launch(const Kernel& kern, const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor* bias) {
  c10::DeviceGuard guard(a.device());
  const int device = a.get_device();
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end() - 1);
  shape.push_back(kern.n);
  std::array<CUtensorMap, 3> maps;
  void* ptrs[3] = {const_cast<void*>(a.const_data_ptr()), const_cast<void*>(b.const_data_ptr()), nullptr};
  CUfunction fn = nullptr;
  CUdeviceptr scratch = 0, counters = 0;
  at::Tensor c;
  {
    std::lock_guard<std::mutex> lock(mutex);
    DeviceState& st = device_state(device);
    fn = function_for(st, kern);
    if (!fn) return std::nullopt;
    if (kern.workspace_bytes || kern.counters) {
      scratch = grow(st.scratch, st.scratch_bytes, std::max<size_t>(kern.workspace_bytes, 16), false);
      counters = grow(st.counters, st.counter_bytes, std::max<size_t>(kern.counters * 4, 16), true);
    }
    c = at::empty(shape, a.options());
    ptrs[2] = c.data_ptr();
    for (size_t i = 0; i < kern.maps.size(); ++i) maps[i] = tensor_map(kern, device, i, ptrs[kern.maps[i].operand]);
  }
  int32_t sizes[3] = {static_cast<int32_t>(kern.m), static_cast<int32_t>(kern.n), static_cast<int32_t>(kern.k)};
  void* bias_ptr = bias ? const_cast<void*>(bias->const_data_ptr()) : nullptr;
  std::array<void*, 12> params;
  size_t np = 0;
  for (auto& p : ptrs) params[np++] = &p;
  for (auto& s : sizes) params[np++] = &s;
  if (bias) params[np++] = &bias_ptr;
  for (size_t i = 0; i < kern.maps.size(); ++i) params[np++] = &maps[i];
  if (scratch) params[np++] = &scratch, params[np++] = &counters;
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  auto stream = static_cast<CUstream>(impl.getStream(a.device()).native_handle());
  check(driver().LaunchKernel(fn, kern.grid[0], kern.grid[1], kern.grid[2], kern.block[0], kern.block[1],
                              kern.block[2], kern.smem, stream, params.data(), nullptr),
        "cuLaunchKernel");
  return c;
}

at::Tensor run(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk) {
  const at::Tensor* bp = bias && bias->defined() ? &*bias : nullptr;
  if (auto kern = choose(a, b, bp, nk, nullptr))
    if (auto c = launch(*kern, a, b, bp)) return *c;
  return nk ? at::linear(a, b, bias) : at::matmul(a, b);
}

// ---- the registered ops ---------------------------------------------------------------------------------------------
at::Tensor mm_cuda(const at::Tensor& a, const at::Tensor& b) { return run(a, b, std::nullopt, false); }
at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return run(x, w, bias, true);
}
// Every other backend, and meta / fake tensors (shapes for torch.compile): what the op means.
at::Tensor mm_plain(const at::Tensor& a, const at::Tensor& b) { return at::matmul(a, b); }
at::Tensor linear_plain(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return at::linear(x, w, bias);
}

bool wants_grad(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  return c10::GradMode::is_enabled() &&
         (a.requires_grad() || b.requires_grad() || (bias && bias->defined() && bias->requires_grad()));
}

const auto& mm_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("hgemm::mm", "").typed<at::Tensor(const at::Tensor&,
                                                                                        const at::Tensor&)>();
  return op;
}
const auto& linear_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hgemm::linear", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op;
}

// Where a gradient is wanted the call is at::matmul / at::linear, differentiated as usual; otherwise below autograd.
at::Tensor mm_autograd(c10::DispatchKeySet ks, const at::Tensor& a, const at::Tensor& b) {
  if (wants_grad(a, b, std::nullopt)) return at::matmul(a, b);
  at::AutoDispatchBelowADInplaceOrView below;
  return mm_op().redispatch(ks & c10::after_autograd_keyset, a, b);
}
at::Tensor linear_autograd(c10::DispatchKeySet ks, const at::Tensor& x, const at::Tensor& w,
                           const std::optional<at::Tensor>& bias) {
  if (wants_grad(x, w, bias)) return at::linear(x, w, bias);
  at::AutoDispatchBelowADInplaceOrView below;
  return linear_op().redispatch(ks & c10::after_autograd_keyset, x, w, bias);
}

}  // namespace

TORCH_LIBRARY(hgemm, m) {
  m.def("mm(Tensor a, Tensor b) -> Tensor");
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(hgemm, CUDA, m) {
  m.impl("mm", &mm_cuda);
  m.impl("linear", &linear_cuda);
}
TORCH_LIBRARY_IMPL(hgemm, CompositeExplicitAutograd, m) {
  m.impl("mm", &mm_plain);
  m.impl("linear", &linear_plain);
}
TORCH_LIBRARY_IMPL(hgemm, Autograd, m) {
  m.impl("mm", &mm_autograd);
  m.impl("linear", &linear_autograd);
}

// ---- the Python module --------------------------------------------------------------------------------------------
namespace {

namespace py = pybind11;

template <size_t N, typename T>
void fill(std::array<T, N>& out, const std::vector<int64_t>& values, const char* what) {
  TORCH_CHECK_VALUE(values.size() <= N, "add_kernel: ", what, " has more than ", N, " values");
  for (size_t i = 0; i < values.size(); ++i) out[i] = static_cast<T>(values[i]);
}

// add_kernel(entry: dict): key, m, n, k, nk, bf16, bias, arch, cubin (bytes), grid, block, smem_bytes,
// workspace_bytes, counters, tensor_maps (dicts: operand 0-2, dims, strides (bytes, all but the first), box,
// swizzle and l2 (the driver's enum values)). Replaces a kernel registered for the same problem.
PyObject* py_add_kernel(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(PyDict_Check(arg), "add_kernel takes a dict");
  const auto entry = py::reinterpret_borrow<py::dict>(arg);
  auto kern = std::make_shared<Kernel>();
  kern->key = entry["key"].cast<std::string>();
  kern->arch = entry["arch"].cast<std::string>();
  kern->cubin = entry["cubin"].cast<py::bytes>();
  kern->m = entry["m"].cast<int64_t>(), kern->n = entry["n"].cast<int64_t>(), kern->k = entry["k"].cast<int64_t>();
  const auto grid = entry["grid"].cast<std::vector<int64_t>>(), block = entry["block"].cast<std::vector<int64_t>>();
  TORCH_CHECK_VALUE(grid.size() == 3 && block.size() == 3, "add_kernel: grid and block take 3 values");
  fill(kern->grid, grid, "grid");
  fill(kern->block, block, "block");
  kern->smem = entry["smem_bytes"].cast<unsigned>();
  kern->workspace_bytes = entry["workspace_bytes"].cast<size_t>();
  kern->counters = entry["counters"].cast<size_t>();
  for (const auto& item : entry["tensor_maps"].cast<py::list>()) {
    const auto m = item.cast<py::dict>();
    MapSpec s;
    s.operand = m["operand"].cast<int>();
    const auto dims = m["dims"].cast<std::vector<int64_t>>(), box = m["box"].cast<std::vector<int64_t>>();
    const auto strides = m["strides"].cast<std::vector<int64_t>>();
    TORCH_CHECK_VALUE(!dims.empty() && box.size() == dims.size() && strides.size() + 1 == dims.size() &&
                          s.operand >= 0 && s.operand < 3,
                      "add_kernel: a tensor map covers A, B or C with one box size per dimension and a byte "
                      "stride for each dimension but the first");
    s.rank = dims.size();
    fill(s.dims, dims, "dims");
    fill(s.box, box, "box");
    fill(s.strides, strides, "strides");
    s.swizzle = m["swizzle"].cast<int>();
    s.l2 = m["l2"].cast<int>();
    kern->maps.push_back(s);
  }
  TORCH_CHECK_VALUE(kern->maps.size() <= 3, "add_kernel: at most 3 tensor maps (A, B, C)");
  const ProblemKey key{kern->m, kern->n, kern->k, entry["nk"].cast<bool>(), entry["bf16"].cast<bool>(),
                       entry["bias"].cast<bool>()};
  std::lock_guard<std::mutex> lock(mutex);
  kern->id = next_id++;
  kernels[key] = std::move(kern);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_kernels(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  std::lock_guard<std::mutex> lock(mutex);
  PyObject* out = PyList_New(0);
  for (const auto& kv : kernels) {
    PyObject* s = PyUnicode_FromString(kv.second->key.c_str());
    PyList_Append(out, s);
    Py_DECREF(s);
  }
  return out;
  END_HANDLE_TH_ERRORS
}

// The fast entry points: (a, b) and (x, w[, bias]) positional, the same results as the registered ops.
PyObject* call(PyObject* const* args, Py_ssize_t nargs, bool nk) {
  const Py_ssize_t want = nk ? 3 : 2;
  TORCH_CHECK_TYPE(nargs == want || (nk && nargs == 2), nk ? "linear(x, w, bias=None)" : "mm(a, b)",
                   " takes tensors, positionally");
  for (Py_ssize_t i = 0; i < nargs; ++i)
    TORCH_CHECK_TYPE(THPVariable_Check(args[i]) || (i == 2 && args[i] == Py_None),
                     "hgemm: argument ", i, " is not a tensor");
  const at::Tensor& a = THPVariable_Unpack(args[0]);
  const at::Tensor& b = THPVariable_Unpack(args[1]);
  std::optional<at::Tensor> bias;
  if (nargs == 3 && args[2] != Py_None) bias = THPVariable_Unpack(args[2]);
  at::Tensor c;
  {
    pybind11::gil_scoped_release no_gil;
    // Tensor subclasses, fake tensors, functorch wrappers and dispatch modes must see the op: the dispatcher.
    static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                              c10::DispatchKey::FuncTorchBatched,
                                              c10::DispatchKey::FuncTorchGradWrapper,
                                              c10::DispatchKey::Functionalize});
    const bool dispatch = c10::impl::TorchDispatchModeTLS::any_modes_set() ||
                          a.key_set().has_any(wrapped) || b.key_set().has_any(wrapped) ||
                          (bias && bias->key_set().has_any(wrapped));
    if (dispatch) {
      c = nk ? linear_op().call(a, b, bias) : mm_op().call(a, b);
    } else if (wants_grad(a, b, bias)) {
      c = nk ? at::linear(a, b, bias) : at::matmul(a, b);
    } else {
      c = run(a, b, bias, nk);
    }
  }
  return THPVariable_Wrap(std::move(c));
}

PyObject* py_mm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  return call(args, nargs, false);
  END_HANDLE_TH_ERRORS
}
PyObject* py_linear(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  return call(args, nargs, true);
  END_HANDLE_TH_ERRORS
}

// explain(a, b, bias, nk) -> str: the kernel a call would run, or why it goes to at::matmul / at::linear.
PyObject* py_explain(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 4 && THPVariable_Check(args[0]) && THPVariable_Check(args[1]),
                   "explain(a, b, bias, nk)");
  std::optional<at::Tensor> bias;
  if (args[2] != Py_None) bias = THPVariable_Unpack(args[2]);
  std::string why;
  choose(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), bias ? &*bias : nullptr,
         PyObject_IsTrue(args[3]) == 1, &why);
  return PyUnicode_FromString(why.c_str());
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"add_kernel", py_add_kernel, METH_O, "register one exported kernel (a manifest entry, prepared)"},
    {"kernels", py_kernels, METH_NOARGS, "the problem keys of the registered kernels"},
    {"mm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_mm)), METH_FASTCALL, "mm(a, b)"},
    {"linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_linear)), METH_FASTCALL,
     "linear(x, w, bias=None)"},
    {"explain", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_explain)), METH_FASTCALL,
     "explain(a, b, bias, nk)"},
    {nullptr, nullptr, 0, nullptr}};

#define HGEMM_STR2(x) #x
#define HGEMM_STR(x) HGEMM_STR2(x)
#define HGEMM_CAT2(a, b) a##b
#define HGEMM_CAT(a, b) HGEMM_CAT2(a, b)
PyModuleDef module_def = {PyModuleDef_HEAD_INIT, HGEMM_STR(TORCH_EXTENSION_NAME), "the compiled HGEMM op", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC HGEMM_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
