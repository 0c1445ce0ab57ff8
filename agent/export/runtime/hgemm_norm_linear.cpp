// hgemm::norm_linear's routing: F.linear(rms_norm(x), w, bias), then the epilogue, where rms_norm is one of the
// export's RMSNorm kinds (hgemm_norm.cu's: 0 Llama's, 1 Gemma's, 2 the weight times the fp32 value). A kernel
// exported with a norm variant (the gemv family's, compiled with -DHGEMM_NORM: it normalises A's rows as it reads
// them) runs the whole call; otherwise the norm runs first (the export's kernel, or PyTorch's ops as the model's
// norm computes them) and its output goes through run() as any call would.
#include <ATen/core/Tensor.h>

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
