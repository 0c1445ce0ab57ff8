// The compiled HGEMM op's routing (no CUDA here: hgemm_op.cpp launches): which exported kernel serves a call
// (choose), what a call means when none does, computed by PyTorch (fallback, compose: the epilogue's ops as a model
// runs them), and hgemm::norm_linear's routing: F.linear(rms_norm(x), w, bias), then the epilogue, where rms_norm is
// one of the export's RMSNorm kinds (hgemm_norm.cu's: 0 Llama's, 1 Gemma's, 2 the weight times the fp32 value). A
// kernel exported with a norm variant (the gemv family's, compiled with -DHGEMM_NORM: it normalises A's rows as it
// reads them) runs the whole call; otherwise the norm runs first (the export's kernel, or PyTorch's ops as the
// model's norm computes them) and its output goes through run() as any call would.
#include <ATen/ops/add.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/square.h>

#include "hgemm_op.h"

namespace {

// x in fp32 times rsqrt(mean(x^2) + eps), then the weight as `kind` says: hgemm_recognise.RMS_NORMS op for op.
at::Tensor composed_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t kind) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "hgemm::norm_linear: the norm's kind is 0, 1 or 2, not ", kind);
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor n = h.mul(h.pow(2).mean(-1, true).add(eps).rsqrt());
  if (kind == 1) return n.mul(w.to(at::kFloat).add(1.0)).to(x.scalar_type());
  if (kind == 2) return w.mul(n).to(x.scalar_type());
  return w.mul(n.to(x.scalar_type()));
}

// The norm's weight as the norm variant reads it: K contiguous, 16-byte aligned elements of x's dtype on x's device.
bool plain_norm(const at::Tensor& x, const at::Tensor& norm_w, int64_t kind) {
  return kind >= 0 && kind <= 2 && norm_w.is_cuda() && norm_w.dim() == 1 && x.dim() >= 1 && norm_w.size(0) == x.size(-1) &&
         norm_w.scalar_type() == x.scalar_type() && norm_w.device() == x.device() && norm_w.is_contiguous() &&
         reinterpret_cast<uintptr_t>(norm_w.const_data_ptr()) % 16 == 0;
}

}  // namespace

namespace hgemm {

// ---- routing ------------------------------------------------------------------------------------------------------
// The kernel for a @ B (B given K x N, or N x K when nk) + bias, then the epilogue (R the residual), or nullptr with
// the reason in *why.
std::shared_ptr<const Kernel> choose(const at::Tensor& a, const at::Tensor& b, const at::Tensor* bias, bool nk,
                                     int epilogue, const at::Tensor* residual, std::string* why) {
  auto no = [&](auto&& reason) {
    if (why) *why = reason;
    return std::shared_ptr<const Kernel>();
  };
  if (b.dim() != 2 || a.dim() < 1) return no("B is not a matrix");
  const int64_t k = a.size(-1), n = b.size(nk ? 0 : 1);
  if (b.size(nk ? 1 : 0) != k || k == 0) return no("A's last dimension is not B's K");
  const auto dtype = a.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) return no("dtype is neither float16 nor bfloat16");
  if (b.scalar_type() != dtype || (bias && bias->scalar_type() != dtype) ||
      (residual && residual->scalar_type() != dtype))
    return no("operands of mixed dtypes");
  const int64_t m = a.numel() / k;
  const ProblemKey series{n, k, nk, dtype == at::kBFloat16, bias != nullptr, epilogue};
  int64_t lo = 0, hi = 0;
  std::shared_ptr<const Kernel> kern = hgemm::find_kernel(series, m, &lo, &hi);
  if (!kern) {
    if (!why) return kern;
    const auto tuned = hgemm::describe_series(series);
    return no(tuned ? "M=" + std::to_string(m) + " not tuned (tuned M: " + *tuned + ")" : "shape not tuned");
  }
  auto tuned_but = [&](const char* reason) {
    if (why) *why = std::string(reason) + " (tuned: " + kern->key + ")";
    return std::shared_ptr<const Kernel>();
  };
  if (bias && (bias->dim() != 1 || bias->size(0) != n)) return tuned_but("bias is not a vector of N");
  if (epilogue == hgemm::kResidual) {
    std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end() - 1);
    shape.push_back(n);
    if (!residual || residual->sizes() != at::IntArrayRef(shape)) return tuned_but("the residual is not M x N");
  }
  const at::Tensor* operands[4] = {&a, &b, bias, residual};
  for (const at::Tensor* t : operands)
    if (t && !t->is_contiguous()) return tuned_but("an operand is not contiguous");
  for (const at::Tensor* t : operands)
    if (t && reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 16 != 0)
      return tuned_but("an operand is not 16-byte aligned");
  for (const at::Tensor* t : operands)
    if (t && (!t->is_cuda() || t->device() != a.device())) return tuned_but("operands are not on one CUDA device");
  if (why)
    *why = "kernel " + kern->key + " (M=" + std::to_string(m) + " in " + std::to_string(lo) +
           (hi != lo ? "-" + std::to_string(hi) : "") + ")";
  return kern;
}

// The epilogue's ops on an unfused GEMM's output y, as a model runs them (core/epilogue.py's composition).
at::Tensor compose(const at::Tensor& y, int64_t epilogue, const std::optional<at::Tensor>& residual) {
  auto act = [](const at::Tensor& x, bool silu) { return silu ? at::silu(x) : at::gelu(x, "tanh"); };
  switch (epilogue) {
    case hgemm::kRelu:
      return at::relu(y);
    case hgemm::kSilu:
    case hgemm::kGeluTanh:
      return act(y, epilogue == hgemm::kSilu);
    case hgemm::kGelu:
      return at::gelu(y);
    case hgemm::kRelu2:
      return at::square(at::relu(y));
    case hgemm::kSiluMul:
    case hgemm::kGeluMul: {  // gate and up interleaved in blocks of 8 columns: strided views, no copies
      const at::Tensor blocks = y.unflatten(-1, {y.size(-1) / 16, 2, 8});
      return at::mul(act(blocks.select(-2, 0), epilogue == hgemm::kSiluMul), blocks.select(-2, 1)).flatten(-2);
    }
    case hgemm::kResidual:
      TORCH_CHECK(residual && residual->defined(), "hgemm: a residual epilogue needs the residual");
      return at::add(y, *residual);
    default:
      return y;
  }
}

// What the call means, computed by PyTorch: F.linear, torch.matmul, or with a K x N B and a bias the fused addmm
// (at::linear of B's transpose: torch.addmm(bias, a, b)); then the epilogue's ops (compose). A's rows are one matrix
// first: at::matmul does not fold a (B, 1, K) operand whose middle stride is not K (as torch.compile lays out size-1
// dimensions) and runs a batched GEMM that reads B once a row instead.
at::Tensor fallback(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk,
                    int64_t epilogue, const std::optional<at::Tensor>& residual) {
  // symbolic sizes throughout: fake tensors of torch.compile's dynamic shapes come this way too
  const at::Tensor a2 = a.dim() == 2 ? a : a.reshape_symint({c10::SymInt(-1), a.sym_size(-1)});
  at::Tensor y = nk                          ? at::linear(a2, b, bias)
                 : bias && bias->defined() ? at::linear(a2, b.t(), bias)
                                           : at::matmul(a2, b);
  if (a.dim() != 2) {
    std::vector<c10::SymInt> shape(a.sym_sizes().begin(), a.sym_sizes().end() - 1);
    shape.push_back(y.sym_size(-1));
    y = y.view_symint(shape);
  }
  return epilogue == hgemm::kNone ? y : compose(y, epilogue, residual);
}


at::Tensor norm_run(const at::Tensor& x, const at::Tensor& norm_w, double eps, int64_t kind, const at::Tensor& w,
                    const std::optional<at::Tensor>& bias, int64_t epilogue,
                    const std::optional<at::Tensor>& residual) {
  const at::Tensor* bp = bias && bias->defined() ? &*bias : nullptr;
  const at::Tensor* rp = residual && residual->defined() ? &*residual : nullptr;
  if (plain_norm(x, norm_w, kind))
    if (auto kern = choose(x, w, bp, true, static_cast<int>(epilogue), rp, nullptr))
      if (auto c = launch_normed(*kern, x, w, bp, rp, NormArgs{norm_w, eps, kind})) return *c;
  const auto normed = kind >= 0 && kind <= 2 ? rms_norm(x, norm_w, eps, kind) : std::nullopt;
  return run(normed ? *normed : composed_norm(x, norm_w, eps, kind), w, bias, true, epilogue, residual);  // checks kind
}

at::Tensor norm_fallback(const at::Tensor& x, const at::Tensor& norm_w, double eps, int64_t kind, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias, int64_t epilogue,
                         const std::optional<at::Tensor>& residual) {
  return fallback(composed_norm(x, norm_w, eps, kind), w, bias, true, epilogue, residual);
}

}  // namespace hgemm
