#include "optim/runs.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace fsdp::optim::detail {
namespace {

bool fusable(const at::Tensor& p) {
  const at::Tensor& g = p.grad();
  const auto t = p.scalar_type();
  return p.device().is_cpu() && (t == at::kFloat || t == at::kDouble) && p.is_contiguous() &&
         !p.is_sparse() && g.defined() && !g.is_sparse() && g.device().is_cpu() &&
         g.scalar_type() == t && g.is_contiguous() && g.sizes() == p.sizes();
}

// Whether b lies in a's storage right after a (gaps allowed: a shard's padding, or parameters of
// another parameter group between them), in the same dtype.
bool follows(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
         b.storage_offset() >= a.storage_offset() + a.numel();
}

}  // namespace

std::vector<StepItem> plan_steps(const std::vector<at::Tensor>& params) {
  std::vector<StepItem> items;
  const at::Tensor* last = nullptr;  // the last parameter of the open run
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (!p.grad().defined()) continue;  // LibTorch skips it (no step count either)
    const bool fused = fusable(p);
    if (fused && last && follows(*last, p)) {
      items.back().params.push_back(i);
    } else {
      items.push_back({{i}, fused});
    }
    last = fused ? &p : nullptr;
  }
  return items;
}

void make_flat(const std::vector<at::Tensor>& params, const std::vector<at::Tensor*>& slots) {
  bool flat = true;
  for (size_t k = 0; k < slots.size() && flat; ++k) {
    const at::Tensor& s = *slots[k];
    flat = s.defined() && s.scalar_type() == params[k].scalar_type() && s.is_contiguous() &&
           s.device() == params[k].device() && s.sizes() == params[k].sizes() &&
           (k == 0 || follows(*slots[k - 1], s));
  }
  if (flat) return;
  int64_t total = 0;
  for (const auto& p : params) total += p.numel();
  at::Tensor buffer = at::zeros({total}, params[0].options());
  int64_t offset = 0;
  for (size_t k = 0; k < slots.size(); ++k) {
    at::Tensor view = buffer.narrow(0, offset, params[k].numel()).view(params[k].sizes());
    if (slots[k]->defined()) view.copy_(*slots[k]);
    *slots[k] = view;
    offset += params[k].numel();
  }
}

void parallel_pass(const std::vector<int64_t>& numels,
                   const std::function<void(size_t, int64_t, int64_t)>& fn, int64_t grain) {
  std::vector<int64_t> start(numels.size() + 1, 0);  // start[k]: the first element of k
  for (size_t k = 0; k < numels.size(); ++k) start[k + 1] = start[k] + numels[k];
  at::parallel_for(0, start.back(), grain, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (; k < numels.size() && start[k] < end; ++k) {
      const int64_t lo = std::max(begin, start[k]), hi = std::min(end, start[k + 1]);
      if (hi > lo) fn(k, lo - start[k], hi - start[k]);
    }
  });
}

void bump_versions(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) p.unsafeGetTensorImpl()->bump_version();
}

}  // namespace fsdp::optim::detail
