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

// Registers a kernel for its problem, replacing one registered before.
void add_kernel(const ProblemKey& problem, std::shared_ptr<Kernel> kernel);
std::vector<std::string> kernel_keys();

// a @ B (+ bias), B K x N or N x K (nk), as the fast entry points run it: through the dispatcher where tensor
// subclasses, fake tensors, functorch or dispatch modes must see the op; as at::matmul / at::linear where a gradient
// is wanted; otherwise the tuned kernel, or at::matmul / at::linear where the call is not one it was tuned for.
at::Tensor call(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk);

// "kernel KEY", or why such a call goes to at::matmul / at::linear.
std::string explain(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk);

}  // namespace hgemm
