// The compiled HGEMM op's registered ops: hgemm::mm(a, b, bias=None) (torch.matmul with a K x N B; with a bias,
// torch.addmm as transformers' Conv1D calls it), hgemm::linear(x, w, bias=None) (F.linear) and
// hgemm::fused_linear(x, w, bias, epilogue, residual=None) and hgemm::norm_linear (the same of an RMSNorm of x) with
// TORCH_LIBRARY: the CUDA kernels route and launch
// (hgemm_op.cpp), every other backend and fake tensors compute what the op means, and autograd takes PyTorch's
// path where a gradient is wanted. hgemm::call is what the fast Python entry points (hgemm_module.cpp) call.
#include "hgemm_op.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

namespace {

using hgemm::fallback;
using hgemm::run;

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
at::Tensor fused_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      int64_t epilogue, const std::optional<at::Tensor>& residual) {
  return run(x, w, bias, true, epilogue, residual);
}
at::Tensor fused_plain(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       int64_t epilogue, const std::optional<at::Tensor>& residual) {
  return fallback(x, w, bias, true, epilogue, residual);
}

bool wants_grad(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                const std::optional<at::Tensor>& residual = std::nullopt) {
  auto wants = [](const std::optional<at::Tensor>& t) { return t && t->defined() && t->requires_grad(); };
  return c10::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad() || wants(bias) || wants(residual));
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

using FusedSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                  const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<FusedSignature>& registered_fused() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("hgemm::fused_linear", "").typed<FusedSignature>();
  return op;
}

at::Tensor autograd_fused(c10::DispatchKeySet ks, const at::Tensor& x, const at::Tensor& w,
                          const std::optional<at::Tensor>& bias, int64_t epilogue,
                          const std::optional<at::Tensor>& residual) {
  if (wants_grad(x, w, bias, residual)) return fallback(x, w, bias, true, epilogue, residual);
  at::AutoDispatchBelowADInplaceOrView below;
  return registered_fused().redispatch(ks & c10::after_autograd_keyset, x, w, bias, epilogue, residual);
}

using NormSignature = at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t, const at::Tensor&,
                                 const std::optional<at::Tensor>&, int64_t, const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<NormSignature>& registered_norm() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("hgemm::norm_linear", "").typed<NormSignature>();
  return op;
}

at::Tensor norm_cuda(const at::Tensor& x, const at::Tensor& norm_w, double eps, int64_t kind, const at::Tensor& w,
                     const std::optional<at::Tensor>& bias, int64_t epilogue,
                     const std::optional<at::Tensor>& residual) {
  return hgemm::norm_run(x, norm_w, eps, kind, w, bias, epilogue, residual);
}

at::Tensor autograd_norm(c10::DispatchKeySet ks, const at::Tensor& x, const at::Tensor& norm_w, double eps,
                         int64_t kind, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t epilogue,
                         const std::optional<at::Tensor>& residual) {
  if (wants_grad(x, w, bias, residual) || (c10::GradMode::is_enabled() && norm_w.requires_grad()))
    return hgemm::norm_fallback(x, norm_w, eps, kind, w, bias, epilogue, residual);
  at::AutoDispatchBelowADInplaceOrView below;
  return registered_norm().redispatch(ks & c10::after_autograd_keyset, x, norm_w, eps, kind, w, bias, epilogue,
                                      residual);
}

}  // namespace


TORCH_LIBRARY(hgemm, m) {
  m.def("mm(Tensor a, Tensor b, Tensor? bias=None) -> Tensor", {at::Tag::flexible_layout});
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor", {at::Tag::flexible_layout});
  // epilogue: core/epilogue.py's EPILOGUES index (hgemm_op.h); w N x K (gated: gate and up interleaved)
  m.def("fused_linear(Tensor x, Tensor w, Tensor? bias, int epilogue, Tensor? residual=None) -> Tensor",
        {at::Tag::flexible_layout});
  // fused_linear of the RMSNorm of x (norm_w: its weight; kind: hgemm_norm.cu's rounding)
  m.def("norm_linear(Tensor x, Tensor norm_w, float eps, int kind, Tensor w, Tensor? bias, int epilogue, "
        "Tensor? residual=None) -> Tensor", {at::Tag::flexible_layout});
}
TORCH_LIBRARY_IMPL(hgemm, CUDA, m) {
  m.impl("mm", &mm_cuda);
  m.impl("linear", &linear_cuda);
  m.impl("fused_linear", &fused_cuda);
  m.impl("norm_linear", &norm_cuda);
}
TORCH_LIBRARY_IMPL(hgemm, CompositeExplicitAutograd, m) {
  m.impl("mm", &mm_plain);
  m.impl("linear", &linear_plain);
  m.impl("fused_linear", &fused_plain);
  m.impl("norm_linear", &hgemm::norm_fallback);
}
TORCH_LIBRARY_IMPL(hgemm, Autograd, m) {
  m.impl("mm", &autograd<false>);
  m.impl("linear", &autograd<true>);
  m.impl("fused_linear", &autograd_fused);
  m.impl("norm_linear", &autograd_norm);
}

namespace hgemm {

// Whether the dispatcher must see a call of these operands: a tensor subclass, a fake tensor, functorch or a
// dispatch mode.
static bool dispatched(std::initializer_list<const at::Tensor*> operands) {
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                            c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper,
                                            c10::DispatchKey::Functionalize});
  if (c10::impl::TorchDispatchModeTLS::any_modes_set()) return true;
  for (const at::Tensor* t : operands)
    if (t && t->defined() && t->key_set().has_any(wrapped)) return true;
  return false;
}

at::Tensor call(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk,
                int64_t epilogue, const std::optional<at::Tensor>& residual) {
  if (dispatched({&a, &b, bias ? &*bias : nullptr, residual ? &*residual : nullptr}))
    return epilogue == kNone && !residual ? registered(nk).call(a, b, bias)
                                          : registered_fused().call(a, b, bias, epilogue, residual);
  if (wants_grad(a, b, bias, residual)) return fallback(a, b, bias, nk, epilogue, residual);
  return run(a, b, bias, nk, epilogue, residual);
}

at::Tensor norm_call(const at::Tensor& x, const at::Tensor& norm_w, double eps, int64_t kind, const at::Tensor& w,
                     const std::optional<at::Tensor>& bias, int64_t epilogue,
                     const std::optional<at::Tensor>& residual) {
  if (dispatched({&x, &norm_w, &w, bias ? &*bias : nullptr, residual ? &*residual : nullptr}))
    return registered_norm().call(x, norm_w, eps, kind, w, bias, epilogue, residual);
  if (wants_grad(x, w, bias, residual) || (c10::GradMode::is_enabled() && norm_w.requires_grad()))
    return norm_fallback(x, norm_w, eps, kind, w, bias, epilogue, residual);
  return norm_run(x, norm_w, eps, kind, w, bias, epilogue, residual);
}

std::string explain(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias, bool nk,
                    int64_t epilogue, const std::optional<at::Tensor>& residual) {
  std::string why;
  choose(a, b, bias ? &*bias : nullptr, nk, static_cast<int>(epilogue), residual ? &*residual : nullptr, &why);
  return why;
}

}  // namespace hgemm
