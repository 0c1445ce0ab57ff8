// The compiled HGEMM op of an hgemm-agent export (built by hgemm_build.py with torch.utils.cpp_extension and the
// host compiler; no CUDA toolkit: hgemm_cuda.h opens the CUDA driver at run time).
//
// Registers hgemm::mm(a, b, bias=None) (torch.matmul with a K x N B; with a bias, torch.addmm as transformers'
// Conv1D calls it) and hgemm::linear(x, w, bias=None) (F.linear) with
// TORCH_LIBRARY; hgemm_module.cpp adds Python entry points that skip the dispatcher's Python argument parsing. A
// call runs an exported kernel where its (N, K, layout, dtype, bias) was tuned for an M interval holding its M
// (a hash lookup of the series, then a binary search of its intervals' starts) and its operands are plain,
// contiguous, 16-byte aligned CUDA tensors of one device, with no gradient wanted; anything else goes to
// at::matmul / at::linear. The launch at M (grid, tensor-map dims and boxes) comes from the kernel's segment
// holding M (another binary search), as the family's launch rule gave it at that M (agent/export/geometry.py).
//
// Per device: each cubin is loaded once into the primary context, its dynamic shared memory raised; one scratch
// buffer and one zeroed counter array serve every kernel that asks for them (the kernels leave the counters zeroed).
// Tensor maps are encoded once per (kernel, operand, address, M). Clusters need nothing here: kernels that use them
// declare __cluster_dims__ in their source, so a plain cuLaunchKernel forms them. The stream is PyTorch's current
// stream for the device (current_stream below: no CUDA build of torch's headers needed), so launches land in
// CUDA-graph captures.
#include "hgemm_op.h"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

#include "hgemm_cuda.h"

namespace {

using namespace hgemm_cuda;
using hgemm::Kernel;
using hgemm::MapSpec;
using hgemm::ProblemKey;

struct ProblemHash {
  size_t operator()(const ProblemKey& p) const {
    return std::hash<int64_t>()(p.n * 1000003 + p.k) ^ (p.nk | p.bf16 << 1 | p.bias << 2);
  }
};

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

std::mutex mutex;  // guards everything below
std::unordered_map<ProblemKey, hgemm::IntervalTable, ProblemHash> kernels;  // series -> kernels by M
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
  const int64_t m = a.numel() / k;
  int64_t lo = 0, hi = 0;
  std::shared_ptr<const Kernel> kern;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = kernels.find({n, k, nk, dtype == at::kBFloat16, bias != nullptr});
    if (it == kernels.end()) return no("shape not tuned");
    const auto* found = it->second.find(m, why ? &lo : nullptr, why ? &hi : nullptr);
    if (!found) return no("M=" + std::to_string(m) + " not tuned (tuned M: " + it->second.describe() + ")");
    kern = *found;
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
  if (why)
    *why = "kernel " + kern->key + " (M=" + std::to_string(m) + " in " + std::to_string(lo) +
           (hi != lo ? "-" + std::to_string(hi) : "") + ")";
  return kern;
}

// Runs the kernel; nullopt where its cubin does not fit this GPU.
std::optional<at::Tensor> launch(const Kernel& kern, const at::Tensor& a, const at::Tensor& b,
                                 const at::Tensor* bias) {
  c10::DeviceGuard guard(a.device());
  const int device = a.get_device();
  const int64_t m = a.numel() / kern.k;
  const hgemm::Geometry at = hgemm::geometry_at(kern, m);
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
    for (size_t i = 0; i < kern.maps.size(); ++i)
      maps[i] = tensor_map(kern, device, i, ptrs[kern.maps[i].operand], m, at);
  }
  int32_t sizes[3] = {static_cast<int32_t>(m), static_cast<int32_t>(kern.n), static_cast<int32_t>(kern.k)};
  void* bias_ptr = bias ? const_cast<void*>(bias->const_data_ptr()) : nullptr;
  std::array<void*, 12> params;
  size_t np = 0;
  for (auto& p : ptrs) params[np++] = &p;
  for (auto& s : sizes) params[np++] = &s;
  if (bias) params[np++] = &bias_ptr;
  for (size_t i = 0; i < kern.maps.size(); ++i) params[np++] = &maps[i];
  if (scratch) params[np++] = &scratch, params[np++] = &counters;
  check(driver().LaunchKernel(fn, at.grid[0], at.grid[1], at.grid[2], kern.block[0], kern.block[1],
                              kern.block[2], kern.smem, current_stream(device), params.data(), nullptr),
        "cuLaunchKernel");
  return c;
}

// What the call means, computed by PyTorch: F.linear, torch.matmul, or with a K x N B and a bias the fused addmm
// (at::linear of B's transpose: torch.addmm(bias, a, b) for a 2-D a, the same folded for more dimensions).
at::Tensor fallback(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk) {
  if (nk) return at::linear(a, b, bias);
  return bias && bias->defined() ? at::linear(a, b.t(), bias) : at::matmul(a, b);
}

at::Tensor run(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk) {
  const at::Tensor* bp = bias && bias->defined() ? &*bias : nullptr;
  if (auto kern = choose(a, b, bp, nk, nullptr))
    if (auto c = launch(*kern, a, b, bp)) return *c;
  return fallback(a, b, bias, nk);
}

// ---- the registered ops ---------------------------------------------------------------------------------------------
at::Tensor mm_cuda(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  return run(a, b, bias, false);
}
at::Tensor linear_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return run(x, w, bias, true);
}
// Every other backend, and meta / fake tensors (shapes for torch.compile): what the op means.
at::Tensor mm_plain(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  return fallback(a, b, bias, false);
}
at::Tensor linear_plain(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return fallback(x, w, bias, true);
}

bool wants_grad(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  return c10::GradMode::is_enabled() &&
         (a.requires_grad() || b.requires_grad() || (bias && bias->defined() && bias->requires_grad()));
}

using OpSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);

// hgemm::linear where nk, else hgemm::mm (both take a, b, bias).
const c10::TypedOperatorHandle<OpSignature>& registered(bool nk) {
  static const auto mm = c10::Dispatcher::singleton().findSchemaOrThrow("hgemm::mm", "").typed<OpSignature>();
  static const auto linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("hgemm::linear", "").typed<OpSignature>();
  return nk ? linear : mm;
}

// Where a gradient is wanted the call is what it means in PyTorch, differentiated as usual; otherwise below autograd.
template <bool NK>
at::Tensor autograd(c10::DispatchKeySet ks, const at::Tensor& a, const at::Tensor& b,
                    const std::optional<at::Tensor>& bias) {
  if (wants_grad(a, b, bias)) return fallback(a, b, bias, NK);
  at::AutoDispatchBelowADInplaceOrView below;
  return registered(NK).redispatch(ks & c10::after_autograd_keyset, a, b, bias);
}

}  // namespace

TORCH_LIBRARY(hgemm, m) {
  m.def("mm(Tensor a, Tensor b, Tensor? bias=None) -> Tensor", {at::Tag::flexible_layout});
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor", {at::Tag::flexible_layout});
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
  m.impl("mm", &autograd<false>);
  m.impl("linear", &autograd<true>);
}

namespace hgemm {

void IntervalTable::insert(int64_t lo, int64_t hi, std::shared_ptr<const Kernel> kernel) {
  std::vector<int64_t> starts, ends;
  std::vector<std::shared_ptr<const Kernel>> kernels;
  auto keep = [&](int64_t a, int64_t b, const std::shared_ptr<const Kernel>& k) {
    if (a <= b) starts.push_back(a), ends.push_back(b), kernels.push_back(k);
  };
  for (size_t i = 0; i < starts_.size(); ++i) {  // what is left of each interval outside lo..hi
    keep(starts_[i], std::min(ends_[i], lo - 1), kernels_[i]);
    keep(std::max(starts_[i], hi + 1), ends_[i], kernels_[i]);
  }
  keep(lo, hi, kernel);
  std::vector<size_t> order(starts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return starts[x] < starts[y]; });
  starts_.clear(), ends_.clear(), kernels_.clear();
  for (size_t i : order) starts_.push_back(starts[i]), ends_.push_back(ends[i]), kernels_.push_back(kernels[i]);
}

const std::shared_ptr<const Kernel>* IntervalTable::find(int64_t m, int64_t* lo, int64_t* hi) const {
  auto it = std::upper_bound(starts_.begin(), starts_.end(), m);  // the first interval starting above m
  if (it == starts_.begin()) return nullptr;
  const size_t i = it - starts_.begin() - 1;
  if (m > ends_[i]) return nullptr;
  if (lo) *lo = starts_[i];
  if (hi) *hi = ends_[i];
  return &kernels_[i];
}

std::string IntervalTable::describe() const {
  std::string out;
  for (size_t i = 0; i < starts_.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(starts_[i]);
    if (ends_[i] != starts_[i]) out += "-" + std::to_string(ends_[i]);
  }
  return out;
}

Geometry geometry_at(const Kernel& kernel, int64_t m) {
  auto it = std::upper_bound(kernel.segments.begin(), kernel.segments.end(), m,
                             [](int64_t v, const Segment& s) { return v < s.m; });
  const Segment& seg = it == kernel.segments.begin() ? *it : *(it - 1);
  Geometry out;
  out.grid = seg.grid;
  out.boxes = seg.boxes;
  for (size_t i = 0; i < kernel.maps.size(); ++i) {
    const MapSpec& s = kernel.maps[i];
    for (unsigned d = 0; d < s.rank; ++d)
      out.dims[i][d] = s.m_dims >> d & 1 ? static_cast<unsigned long long>(m) : s.dims[d];
  }
  return out;
}

void add_kernel(const ProblemKey& series, const std::vector<std::pair<int64_t, int64_t>>& serves,
                std::shared_ptr<Kernel> kernel) {
  std::lock_guard<std::mutex> lock(mutex);
  kernel->id = next_id++;
  std::shared_ptr<const Kernel> registered = std::move(kernel);
  for (const auto& [lo, hi] : serves) kernels[series].insert(lo, hi, registered);
}

std::vector<std::string> kernel_keys() {
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<std::string> out;
  for (const auto& kv : kernels)
    for (const auto& k : kv.second.kernels())
      if (std::find(out.begin(), out.end(), k->key) == out.end()) out.push_back(k->key);
  return out;
}

std::shared_ptr<const Kernel> find_kernel(const ProblemKey& series, int64_t m) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = kernels.find(series);
  if (it == kernels.end()) return nullptr;
  const auto* found = it->second.find(m);
  return found ? *found : nullptr;
}

at::Tensor call(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk) {
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                            c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper,
                                            c10::DispatchKey::Functionalize});
  if (c10::impl::TorchDispatchModeTLS::any_modes_set() || a.key_set().has_any(wrapped) ||
      b.key_set().has_any(wrapped) || (bias && bias->key_set().has_any(wrapped)))
    return registered(nk).call(a, b, bias);
  if (wants_grad(a, b, bias)) return fallback(a, b, bias, nk);
  return run(a, b, bias, nk);
}

std::string explain(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk) {
  std::string why;
  choose(a, b, bias ? &*bias : nullptr, nk, &why);
  return why;
}

}  // namespace hgemm
