// The compiled HGEMM op's registry: each series' kernels by M interval (hgemm_op.h), filled by add_kernel from the
// manifest (hgemm_module.cpp) and read by the routing in hgemm_op.cpp.
#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "hgemm_op.h"

namespace {

using hgemm::ProblemKey;

struct ProblemHash {
  size_t operator()(const ProblemKey& p) const {
    return std::hash<int64_t>()(p.n * 1000003 + p.k) ^ (p.nk | p.bf16 << 1 | p.bias << 2 | p.epilogue << 3);
  }
};

std::mutex mutex;  // guards the registry
std::unordered_map<ProblemKey, hgemm::IntervalTable, ProblemHash> kernels;  // series -> kernels by M
uint64_t next_id = 1;
std::unordered_map<std::string, std::shared_ptr<const hgemm::Kernel>> helpers;  // "silu_mul:f16", "rms_norm:bf16"

}  // namespace

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

void add_helper(std::shared_ptr<Kernel> kernel) {
  std::lock_guard<std::mutex> lock(mutex);
  kernel->id = next_id++;
  const std::string key = kernel->key;
  helpers[key] = std::move(kernel);
}

std::shared_ptr<const Kernel> find_helper(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = helpers.find(key);
  return it == helpers.end() ? nullptr : it->second;
}

std::vector<std::string> kernel_keys() {
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<std::string> out;
  for (const auto& kv : kernels)
    for (const auto& k : kv.second.kernels())
      if (std::find(out.begin(), out.end(), k->key) == out.end()) out.push_back(k->key);
  return out;
}

std::shared_ptr<const Kernel> find_kernel(const ProblemKey& series, int64_t m, int64_t* lo, int64_t* hi) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = kernels.find(series);
  if (it == kernels.end()) return nullptr;
  const auto* found = it->second.find(m, lo, hi);
  return found ? *found : nullptr;
}

std::optional<std::string> describe_series(const ProblemKey& series) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = kernels.find(series);
  if (it == kernels.end()) return std::nullopt;
  return it->second.describe();
}

}  // namespace hgemm
