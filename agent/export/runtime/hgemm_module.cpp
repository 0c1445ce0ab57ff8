// The compiled HGEMM op's Python module (its name is the extension's): registering kernels from the manifest, and
// mm / linear / fused_linear entry points that take tensors positionally and call hgemm::call directly, without the
// dispatcher's Python argument parsing (hgemm_ops.py calls these in eager mode; torch.compile sees the registered
// ops instead).
#include <algorithm>

#include <torch/csrc/autograd/python_variable.h>

#include "hgemm_op.h"

namespace {

namespace py = pybind11;

template <size_t N, typename T>
void fill(std::array<T, N>& out, const std::vector<int64_t>& values, const char* what) {
  TORCH_CHECK_VALUE(values.size() <= N, "add_kernel: ", what, " has more than ", N, " values");
  for (size_t i = 0; i < values.size(); ++i) out[i] = static_cast<T>(values[i]);
}

// A kernel record with what every registration names: key, arch, cubin (bytes), and where given the epilogue
// (hgemm::Epilogue's number; none by default).
std::shared_ptr<hgemm::Kernel> kernel_record(const py::dict& entry, const char* verb) {
  auto kern = std::make_shared<hgemm::Kernel>();
  kern->key = entry["key"].cast<std::string>();
  kern->arch = entry["arch"].cast<std::string>();
  kern->cubin = entry["cubin"].cast<py::bytes>();
  kern->epilogue = entry.contains("epilogue") ? entry["epilogue"].cast<int>() : hgemm::kNone;
  kern->overlap = entry.contains("overlap") && entry["overlap"].cast<bool>();
  TORCH_CHECK_VALUE(kern->epilogue >= 0 && kern->epilogue < hgemm::kEpilogues, verb, ": unknown epilogue ",
                    kern->epilogue);
  return kern;
}

// add_kernel(entry: dict): key, n, k, nk, bf16, bias, epilogue (hgemm::Epilogue's number), serves (the [lo, hi] M
// intervals it serves), arch, cubin (bytes), overlap (optional: it waits for the kernel ahead, so it may be launched
// overlapped; core/overlap.py), segments (dicts: m, grid, boxes (one per tensor map)), block, smem_bytes,
// workspace_bytes, counters, norm_cubin (optional, bytes: the kernel with the norm ahead, for norm_linear), tensor_maps (dicts: operand 0-3 (A, B, C, R), dims, m_dims (the dims that are the call's
// M), strides (bytes, all but the first), swizzle and l2 (the driver's enum values)). Replaces what served those
// intervals of the series before.
PyObject* py_add_kernel(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(PyDict_Check(arg), "add_kernel takes a dict");
  const auto entry = py::reinterpret_borrow<py::dict>(arg);
  auto kern = kernel_record(entry, "add_kernel");
  kern->n = entry["n"].cast<int64_t>(), kern->k = entry["k"].cast<int64_t>();
  const auto block = entry["block"].cast<std::vector<int64_t>>();
  TORCH_CHECK_VALUE(block.size() == 3, "add_kernel: grid and block take 3 values");
  fill(kern->block, block, "block");
  kern->smem = entry["smem_bytes"].cast<unsigned>();
  if (entry.contains("norm_cubin")) kern->norm_cubin = entry["norm_cubin"].cast<py::bytes>();
  kern->workspace_bytes = entry["workspace_bytes"].cast<size_t>();
  kern->counters = entry["counters"].cast<size_t>();
  for (const auto& item : entry["tensor_maps"].cast<py::list>()) {
    const auto m = item.cast<py::dict>();
    hgemm::MapSpec s;
    s.operand = m["operand"].cast<int>();
    const auto dims = m["dims"].cast<std::vector<int64_t>>();
    const auto strides = m["strides"].cast<std::vector<int64_t>>();
    TORCH_CHECK_VALUE(!dims.empty() && strides.size() + 1 == dims.size() && s.operand >= 0 && s.operand < 4,
                      "add_kernel: a tensor map covers A, B, C or R with one box size per dimension and a byte "
                      "stride for each dimension but the first");
    s.rank = dims.size();
    fill(s.dims, dims, "dims");
    fill(s.strides, strides, "strides");
    for (const auto d : m["m_dims"].cast<std::vector<int64_t>>()) {
      TORCH_CHECK_VALUE(d >= 0 && d < static_cast<int64_t>(s.rank), "add_kernel: m_dims names a dimension past the "
                        "map's rank");
      s.m_dims |= 1u << d;
    }
    s.swizzle = m["swizzle"].cast<int>();
    s.l2 = m["l2"].cast<int>();
    kern->maps.push_back(s);
  }
  TORCH_CHECK_VALUE(kern->maps.size() <= hgemm::kMaxMaps, "add_kernel: at most 4 tensor maps (A, B, C, R)");
  for (const auto& item : entry["segments"].cast<py::list>()) {
    const auto d = item.cast<py::dict>();
    hgemm::Segment seg;
    seg.m = d["m"].cast<int64_t>();
    const auto grid = d["grid"].cast<std::vector<int64_t>>();
    TORCH_CHECK_VALUE(grid.size() == 3, "add_kernel: grid and block take 3 values");
    fill(seg.grid, grid, "grid");
    const auto boxes = d["boxes"].cast<std::vector<std::vector<int64_t>>>();
    TORCH_CHECK_VALUE(boxes.size() == kern->maps.size(), "add_kernel: a segment has one box per tensor map");
    for (size_t i = 0; i < boxes.size(); ++i) {
      TORCH_CHECK_VALUE(boxes[i].size() == kern->maps[i].rank, "add_kernel: a tensor map covers A, B or C with one "
                        "box size per dimension and a byte stride for each dimension but the first");
      fill(seg.boxes[i], boxes[i], "box");
    }
    TORCH_CHECK_VALUE(kern->segments.empty() || seg.m > kern->segments.back().m,
                      "add_kernel: segments must be sorted by M");
    kern->segments.push_back(seg);
  }
  std::vector<std::pair<int64_t, int64_t>> serves;
  for (const auto& item : entry["serves"].cast<py::list>()) {
    const auto lohi = item.cast<std::vector<int64_t>>();
    TORCH_CHECK_VALUE(lohi.size() == 2 && 1 <= lohi[0] && lohi[0] <= lohi[1], "add_kernel: serves takes [lo, hi] "
                      "intervals of M, 1 <= lo <= hi");
    TORCH_CHECK_VALUE(!kern->segments.empty() && kern->segments.front().m <= lohi[0], "add_kernel: the segments "
                      "must start at or below the lowest M served");
    serves.emplace_back(lohi[0], lohi[1]);
  }
  const hgemm::ProblemKey series{kern->n, kern->k, entry["nk"].cast<bool>(), entry["bf16"].cast<bool>(),
                                 entry["bias"].cast<bool>(), kern->epilogue};
  hgemm::add_kernel(series, serves, std::move(kern));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// add_helper(entry: dict): key ("silu_mul:f16", "rms_norm:bf16": the manifest's), arch, cubin (bytes), overlap
// (optional, as add_kernel's): one of the export's helper kernels (hgemm_gated.cu, hgemm_norm.cu; 256 threads a block).
PyObject* py_add_helper(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(PyDict_Check(arg), "add_helper takes a dict");
  auto kern = kernel_record(py::reinterpret_borrow<py::dict>(arg), "add_helper");
  static const std::vector<std::string> keys = {"silu_mul:f16", "silu_mul:bf16", "gelu_mul:f16", "gelu_mul:bf16",
                                                "rms_norm:f16", "rms_norm:bf16"};
  TORCH_CHECK_VALUE(std::find(keys.begin(), keys.end(), kern->key) != keys.end(),
                    "add_helper: not a helper kernel's key: ", kern->key);
  kern->block = {256, 1, 1};
  hgemm::add_helper(std::move(kern));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// rms_norm(x, w, eps, kind=0, residual=None) -> the RMSNorm of that rounding kind (hgemm_norm.cu; plus the residual
// where given) by the export's kernel, or None where it does not serve the call
PyObject* py_rms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const bool residual_given = nargs == 5 && args[4] != Py_None;
  TORCH_CHECK_TYPE(nargs >= 3 && nargs <= 5 && THPVariable_Check(args[0]) && THPVariable_Check(args[1]) &&
                       (!residual_given || THPVariable_Check(args[4])),
                   "rms_norm(x, w, eps, kind=0, residual=None) takes two tensors, a float, an int and a tensor or "
                   "None, positionally");
  const double eps = PyFloat_AsDouble(args[2]);
  if (PyErr_Occurred()) throw py::error_already_set();
  const long kind = nargs >= 4 ? PyLong_AsLong(args[3]) : 0;
  if (PyErr_Occurred()) throw py::error_already_set();
  std::optional<at::Tensor> residual;
  if (residual_given) residual = THPVariable_Unpack(args[4]);
  std::optional<at::Tensor> out;
  {
    py::gil_scoped_release no_gil;
    out = hgemm::rms_norm(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), eps, kind, residual);
  }
  if (!out) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(*out));
  END_HANDLE_TH_ERRORS
}

// (n, k, nk, bf16, bias, m[, epilogue]) -> the kernel registered for M of that series, or nullptr.
std::shared_ptr<const hgemm::Kernel> kernel_for(PyObject* const* args, Py_ssize_t nargs, const char* usage) {
  TORCH_CHECK_TYPE(nargs == 6 || nargs == 7, usage);
  const hgemm::ProblemKey series{PyLong_AsLongLong(args[0]), PyLong_AsLongLong(args[1]), PyObject_IsTrue(args[2]) == 1,
                                 PyObject_IsTrue(args[3]) == 1, PyObject_IsTrue(args[4]) == 1,
                                 nargs == 7 ? static_cast<int>(PyLong_AsLong(args[6])) : hgemm::kNone};
  const int64_t m = PyLong_AsLongLong(args[5]);
  if (PyErr_Occurred()) throw py::error_already_set();
  return hgemm::find_kernel(series, m);
}

// lookup(n, k, nk, bf16, bias, m) -> the key of the kernel a call of that M runs, or None
PyObject* py_lookup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const auto kern = kernel_for(args, nargs, "lookup(n, k, nk, bf16, bias, m[, epilogue])");
  if (!kern) Py_RETURN_NONE;
  return py::cast(kern->key).release().ptr();
  END_HANDLE_TH_ERRORS
}

// launch_at(n, k, nk, bf16, bias, m) -> (grid, [(dims, box) per tensor map]) of the kernel at that M, or None
PyObject* py_launch_at(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const auto kern = kernel_for(args, nargs, "launch_at(n, k, nk, bf16, bias, m[, epilogue])");
  if (!kern) Py_RETURN_NONE;
  const hgemm::Geometry at = hgemm::geometry_at(*kern, PyLong_AsLongLong(args[5]));
  py::list maps;
  for (size_t i = 0; i < kern->maps.size(); ++i) {
    const unsigned rank = kern->maps[i].rank;
    maps.append(py::make_tuple(std::vector<unsigned long long>(at.dims[i].begin(), at.dims[i].begin() + rank),
                               std::vector<unsigned>(at.boxes[i].begin(), at.boxes[i].begin() + rank)));
  }
  return py::make_tuple(std::vector<unsigned>(at.grid.begin(), at.grid.end()), maps).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* py_kernels(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  return py::cast(hgemm::kernel_keys()).release().ptr();
  END_HANDLE_TH_ERRORS
}

// (a, b[, bias]): tensors, bias possibly None.
std::optional<at::Tensor> tensors(PyObject* const* args, Py_ssize_t nargs, const char* usage) {
  TORCH_CHECK_TYPE(nargs == 2 || nargs == 3, usage, " takes tensors, positionally");
  TORCH_CHECK_TYPE(THPVariable_Check(args[0]) && THPVariable_Check(args[1]), usage, ": a and b must be tensors");
  if (nargs < 3 || args[2] == Py_None) return std::nullopt;
  TORCH_CHECK_TYPE(THPVariable_Check(args[2]), usage, ": bias must be a tensor or None");
  return THPVariable_Unpack(args[2]);
}

PyObject* fast_call(PyObject* const* args, Py_ssize_t nargs, bool nk) {
  const auto bias = tensors(args, nargs, nk ? "linear(x, w, bias=None)" : "mm(a, b, bias=None)");
  const at::Tensor& a = THPVariable_Unpack(args[0]);
  const at::Tensor& b = THPVariable_Unpack(args[1]);
  at::Tensor c;
  {
    py::gil_scoped_release no_gil;  // as torch's own ops: a launch may wait for room in the queue
    c = hgemm::call(a, b, bias, nk);
  }
  return THPVariable_Wrap(std::move(c));
}

PyObject* py_mm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  return fast_call(args, nargs, false);
  END_HANDLE_TH_ERRORS
}
PyObject* py_linear(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  return fast_call(args, nargs, true);
  END_HANDLE_TH_ERRORS
}

// fused_linear(x, w, bias, epilogue: int, residual) with bias and residual tensors or None
PyObject* py_fused_linear(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const char* usage = "fused_linear(x, w, bias, epilogue, residual)";
  TORCH_CHECK_TYPE(nargs == 5, usage, " takes its five arguments positionally");
  const auto bias = tensors(args, 3, usage);
  const int64_t epilogue = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) throw py::error_already_set();
  TORCH_CHECK_TYPE(args[4] == Py_None || THPVariable_Check(args[4]), usage, ": residual must be a tensor or None");
  const std::optional<at::Tensor> residual =
      args[4] == Py_None ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(args[4]));
  at::Tensor c;
  {
    py::gil_scoped_release no_gil;
    c = hgemm::call(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), bias, true, epilogue, residual);
  }
  return THPVariable_Wrap(std::move(c));
  END_HANDLE_TH_ERRORS
}

// norm_linear(x, norm_w, eps: float, kind: int, w, bias, epilogue: int, residual): fused_linear of x's RMSNorm
PyObject* py_norm_linear(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const char* usage = "norm_linear(x, norm_w, eps, kind, w, bias, epilogue, residual)";
  TORCH_CHECK_TYPE(nargs == 8, usage, " takes its eight arguments positionally");
  TORCH_CHECK_TYPE(THPVariable_Check(args[0]) && THPVariable_Check(args[1]) && THPVariable_Check(args[4]), usage,
                   ": x, norm_w and w must be tensors");
  PyObject* optional[2] = {args[5], args[7]};
  for (PyObject* o : optional) TORCH_CHECK_TYPE(o == Py_None || THPVariable_Check(o), usage, ": bias and residual "
                                                "must be tensors or None");
  auto maybe = [](PyObject* o) {
    return o == Py_None ? std::nullopt : std::optional<at::Tensor>(THPVariable_Unpack(o));
  };
  const double eps = PyFloat_AsDouble(args[2]);
  const int64_t kind = PyLong_AsLongLong(args[3]), epilogue = PyLong_AsLongLong(args[6]);
  if (PyErr_Occurred()) throw py::error_already_set();
  at::Tensor c;
  {
    py::gil_scoped_release no_gil;
    c = hgemm::norm_call(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), eps, kind,
                         THPVariable_Unpack(args[4]), maybe(args[5]), epilogue, maybe(args[7]));
  }
  return THPVariable_Wrap(std::move(c));
  END_HANDLE_TH_ERRORS
}

// explain(a, b, bias, nk[, epilogue, residual]) -> str
PyObject* py_explain(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  const char* usage = "explain(a, b, bias, nk[, epilogue, residual])";
  TORCH_CHECK_TYPE(nargs == 4 || nargs == 6, usage);
  const auto bias = tensors(args, 3, usage);
  const int64_t epilogue = nargs == 6 ? PyLong_AsLongLong(args[4]) : hgemm::kNone;
  if (PyErr_Occurred()) throw py::error_already_set();
  const std::optional<at::Tensor> residual = nargs == 6 && args[5] != Py_None
                                                 ? std::optional<at::Tensor>(THPVariable_Unpack(args[5]))
                                                 : std::nullopt;
  return py::cast(hgemm::explain(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), bias,
                                 PyObject_IsTrue(args[3]) == 1, epilogue, residual))
      .release()
      .ptr();
  END_HANDLE_TH_ERRORS
}

// overlap([enabled]) -> bool: whether kernels are launched overlapped; with `enabled`, set it and return what it was
PyObject* py_overlap(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs <= 1, "overlap([enabled])");
  if (nargs == 0) return PyBool_FromLong(hgemm::overlap_enabled());
  const int enabled = PyObject_IsTrue(args[0]);
  if (enabled < 0) throw py::error_already_set();
  return PyBool_FromLong(hgemm::set_overlap(enabled == 1));
  END_HANDLE_TH_ERRORS
}

template <typename F>
PyCFunction fastcall(F f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef methods[] = {
    {"add_kernel", py_add_kernel, METH_O, "register one exported kernel (a manifest entry, prepared)"},
    {"add_helper", py_add_helper, METH_O, "register one of the export's helper kernels (gated fallback, RMSNorm)"},
    {"kernels", py_kernels, METH_NOARGS, "the problem keys of the registered kernels"},
    {"lookup", fastcall(py_lookup), METH_FASTCALL, "lookup(n, k, nk, bf16, bias, m): the kernel key for that M"},
    {"launch_at", fastcall(py_launch_at), METH_FASTCALL,
     "launch_at(n, k, nk, bf16, bias, m): (grid, [(dims, box)]) of the kernel at that M"},
    {"mm", fastcall(py_mm), METH_FASTCALL, "mm(a, b, bias=None): torch.matmul(a, b) (+ bias, fused), b K x N"},
    {"linear", fastcall(py_linear), METH_FASTCALL, "linear(x, w, bias=None): F.linear(x, w, bias)"},
    {"fused_linear", fastcall(py_fused_linear), METH_FASTCALL,
     "fused_linear(x, w, bias, epilogue, residual): F.linear(x, w, bias), then the epilogue (its number)"},
    {"norm_linear", fastcall(py_norm_linear), METH_FASTCALL,
     "norm_linear(x, norm_w, eps, kind, w, bias, epilogue, residual): fused_linear of x's RMSNorm"},
    {"rms_norm", fastcall(py_rms_norm), METH_FASTCALL,
     "rms_norm(x, w, eps, kind=0, residual=None): an RMSNorm (+ residual) by the export's kernel, or None"},
    {"explain", fastcall(py_explain), METH_FASTCALL, "explain(a, b, bias, nk): the kernel a call runs, or why not"},
    {"overlap", fastcall(py_overlap), METH_FASTCALL,
     "overlap([enabled]): whether kernels are launched overlapped; with enabled, set it and return what it was"},
    {nullptr, nullptr, 0, nullptr}};

#define HGEMM_STR2(x) #x
#define HGEMM_STR(x) HGEMM_STR2(x)
#define HGEMM_CAT2(a, b) a##b
#define HGEMM_CAT(a, b) HGEMM_CAT2(a, b)
PyModuleDef module_def = {PyModuleDef_HEAD_INIT, HGEMM_STR(TORCH_EXTENSION_NAME), "the compiled HGEMM op", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC HGEMM_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
