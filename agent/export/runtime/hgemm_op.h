// What the compiled HGEMM op's two parts share: the registry's records, filled from Python by hgemm_module.cpp,
// and the calls it makes into hgemm_op.cpp (routing, launching, the registered ops).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace hgemm {

// The fused epilogues, numbered as core/epilogue.py's EPILOGUES lists them (hgemm_ops passes the number).
enum Epilogue : int { kNone = 0, kRelu, kSilu, kGeluTanh, kGelu, kRelu2, kSiluMul, kGeluMul, kResidual, kEpilogues };
inline bool gated(int epilogue) { return epilogue == kSiluMul || epilogue == kGeluMul; }

constexpr size_t kMaxMaps = 4;  // A, B, C and the residual (b_panels: A and B twice)

struct MapSpec {  // cuTensorMapEncodeTiled's arguments but the address and the box (per segment of M)
  int operand = 0;  // 0 A, 1 B, 2 C, 3 the residual
  unsigned rank = 0;
  std::array<unsigned long long, 5> dims{}, strides{};
  unsigned m_dims = 0;  // bit i set: dims[i] is the call's M
  int swizzle = 0, l2 = 0;
};

struct Segment {  // the launch from M = m up to the next segment's m
  int64_t m = 0;
  std::array<unsigned, 3> grid{};
  std::array<std::array<unsigned, 5>, kMaxMaps> boxes{};  // one per tensor map
};

struct Kernel {
  uint64_t id = 0;  // unique per registration: caches key on it, so a replaced kernel's entries go unused
  std::string key, arch, cubin;
  int64_t n = 0, k = 0;  // n: the GEMM's columns (C has n / 2 where gated)
  int epilogue = kNone;
  std::vector<Segment> segments;  // sorted by m; the first starts at the lowest M the kernel serves
  std::array<unsigned, 3> block{};
  unsigned smem = 0;
  std::vector<MapSpec> maps;
  size_t workspace_bytes = 0, counters = 0;  // enough for the largest M it serves
  bool overlap = false;  // it waits for the kernel ahead itself: launched overlapped where the GPU can (sm_90+)
  std::string norm_cubin;  // where not empty: the same kernel with the norm ahead of it (hgemm::norm_linear)
};

// The launch of a kernel at one M: the grid and each tensor map's dims (M filled in) and box.
struct Geometry {
  std::array<unsigned, 3> grid{};
  std::array<std::array<unsigned long long, 5>, kMaxMaps> dims{};
  std::array<std::array<unsigned, 5>, kMaxMaps> boxes{};
};
Geometry geometry_at(const Kernel& kernel, int64_t m);

// A series: everything that selects a kernel but M.
struct ProblemKey {
  int64_t n, k;
  bool nk, bf16, bias;
  int epilogue = kNone;
  bool operator==(const ProblemKey& o) const {
    return n == o.n && k == o.k && nk == o.nk && bf16 == o.bf16 && bias == o.bias && epilogue == o.epilogue;
  }
};

// One series' kernels by M: disjoint intervals sorted by their starts; find() is a binary search over the starts.
class IntervalTable {
 public:
  // Serves lo..hi with the kernel from now on: the parts of intervals registered before that it overlaps go.
  void insert(int64_t lo, int64_t hi, std::shared_ptr<const Kernel> kernel);
  // nullptr: no interval holds m; else the kernel, and the interval in *lo, *hi where given
  const std::shared_ptr<const Kernel>* find(int64_t m, int64_t* lo = nullptr, int64_t* hi = nullptr) const;
  std::string describe() const;                                // "1-16, 17-24, 33"
  std::vector<std::shared_ptr<const Kernel>> kernels() const { return kernels_; }

 private:
  std::vector<int64_t> starts_, ends_;
  std::vector<std::shared_ptr<const Kernel>> kernels_;
};

// Registers a kernel for the M intervals `serves` of its series, replacing what served them before.
void add_kernel(const ProblemKey& series, const std::vector<std::pair<int64_t, int64_t>>& serves,
                std::shared_ptr<Kernel> kernel);
std::vector<std::string> kernel_keys();
// The export's helper kernels by key, 256 threads a block: the gated fallback's ("silu_mul:f16", hgemm_gated.cu:
// act(gate) * up of an unfused GEMM's output, read once) and the RMSNorm's ("rms_norm:bf16", hgemm_norm.cu);
// add_helper replaces the one registered before under its key, find_helper returns it, or nullptr.
void add_helper(std::shared_ptr<Kernel> kernel);
std::shared_ptr<const Kernel> find_helper(const std::string& key);
// Llama's RMSNorm of x (rows x h) with weight w by the export's kernel; nullopt where none is registered for the
// dtype, its cubin does not fit this GPU, or x and w are not contiguous CUDA tensors of one dtype with h % 8 == 0.
// kind: 0 Llama's rounding, 1 Gemma's (1 + w), 2 the weight times the fp32 value (hgemm_norm.cu)
std::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t kind = 0,
                                   const std::optional<at::Tensor>& residual = std::nullopt);
// The kernel registered for M of the series, or nullptr; its interval in *lo, *hi where given.
std::shared_ptr<const Kernel> find_kernel(const ProblemKey& series, int64_t m, int64_t* lo = nullptr,
                                          int64_t* hi = nullptr);
// The series' intervals ("1-16, 17-24, 33"), or nullopt where no kernel of the series is registered.
std::optional<std::string> describe_series(const ProblemKey& series);

// Routing (hgemm_route.cpp; run in hgemm_op.cpp), for the registered ops (hgemm_library.cpp): the kernel for a call,
// or nullptr with the reason in *why where given; the call by its kernel, or as fallback computes it; what the call
// means, computed by PyTorch (at::linear / at::matmul, then the epilogue's ops as a model runs them: compose, on an
// unfused GEMM's output y).
std::shared_ptr<const Kernel> choose(const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias, bool nk,
                                     int epilogue, const at::Tensor* residual, std::string* why);
at::Tensor run(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk,
               int64_t epilogue = kNone, const std::optional<at::Tensor>& residual = std::nullopt);
at::Tensor fallback(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk,
                    int64_t epilogue = kNone, const std::optional<at::Tensor>& residual = std::nullopt);
at::Tensor compose(const at::Tensor& y, int64_t epilogue, const std::optional<at::Tensor>& residual);
// A call: a @ B (+ bias), B K x N or N x K (nk), then the epilogue (R the residual where it adds one), as the fast
// entry points run it: through the dispatcher where tensor subclasses, fake tensors, functorch or dispatch modes
// must see the op; as PyTorch computes it (at::matmul / at::linear, then the epilogue's ops) where a gradient is
// wanted; otherwise the tuned kernel, or PyTorch where the call is not one it was tuned for.
at::Tensor call(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk,
                int64_t epilogue = kNone, const std::optional<at::Tensor>& residual = std::nullopt);

// The RMSNorm ahead of a GEMM (norm_linear): its weight (K elements of x's dtype), epsilon and rounding kind (as
// rms_norm's).
struct NormArgs {
  const at::Tensor& w;
  double eps;
  int64_t kind;
};
// The kernel with its norm variant launched on x (x's rows normalised inside it); nullopt where the kernel has no
// norm variant or its cubin does not fit this GPU.
std::optional<at::Tensor> launch_normed(const Kernel& kernel, const at::Tensor& x, const at::Tensor& w,
                                        const at::Tensor* bias, const at::Tensor* residual, const NormArgs& norm);
// norm_linear (hgemm_route.cpp): F.linear(rms_norm(x), w, bias), then the epilogue: in one kernel where the
// call's kernel has a norm variant and the norm's weight is a plain tensor of x's dtype and K elements; otherwise the
// norm (the export's kernel, or PyTorch's ops) and then run(). norm_fallback: what it means, by PyTorch's ops.
at::Tensor norm_run(const at::Tensor& x, const at::Tensor& norm_w, double eps, int64_t kind, const at::Tensor& w,
                    const std::optional<at::Tensor>& bias, int64_t epilogue,
                    const std::optional<at::Tensor>& residual);
at::Tensor norm_fallback(const at::Tensor& x, const at::Tensor& norm_w, double eps, int64_t kind, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias, int64_t epilogue,
                         const std::optional<at::Tensor>& residual);
// norm_linear as the fast entry point calls it (as call() does: the registered op where the dispatcher must see it,
// PyTorch where a gradient is wanted, else norm_run)
at::Tensor norm_call(const at::Tensor& x, const at::Tensor& norm_w, double eps, int64_t kind, const at::Tensor& w,
                     const std::optional<at::Tensor>& bias, int64_t epilogue,
                     const std::optional<at::Tensor>& residual);

// Whether kernels registered with `overlap` are launched overlapped on sm_90 and newer: on unless HGEMM_OPS_OVERLAP=0
// when first asked (a launch, or either call here); set_overlap changes it for the launches that follow (a CUDA graph
// keeps those it captured) and returns what it was.
bool overlap_enabled();
bool set_overlap(bool enabled);

// "kernel KEY (M=m in lo-hi)", or why such a call goes to PyTorch.
std::string explain(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk,
                    int64_t epilogue = kNone, const std::optional<at::Tensor>& residual = std::nullopt);

}  // namespace hgemm
