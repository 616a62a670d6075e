// c10d::Reducer (PyTorch's DDP gradient reducer) as fsdp-bench's DDP baseline builds it. Its
// constructor changed between LibTorch 1.13 and 2.x: 1.13 takes the per-bucket size limits third;
// 2.x drops them and appends skip_all_reduce_unused_params, use_python_reducer and
// bucket_bytes_cap_list (plus defaulted batched_grad_copy and lazy_bucket_allocation).
#pragma once

#include <torch/version.h>

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <unordered_map>
#include <vector>

namespace fsdp::compat {

// A reducer over `params` with the given buckets (indices into params), all parameters used
// (no unused-parameter search), gradients copied into buckets (not bucket views).
// `bucket_limits` is the per-bucket size limit compute_bucket_assignment_by_size returned; 2.x
// no longer takes it (its rebuild uses bucket_bytes and first_bucket_bytes).
inline std::shared_ptr<c10d::Reducer> make_reducer(
    const std::vector<at::Tensor>& params, const std::vector<std::vector<size_t>>& bucket_indices,
    const std::vector<size_t>& bucket_limits,
    const c10::intrusive_ptr<c10d::ProcessGroup>& process_group, int64_t bucket_bytes,
    int64_t first_bucket_bytes) {
  const std::vector<bool> sparse(params.size(), false);
  const std::unordered_map<size_t, std::string> no_names;
#if TORCH_VERSION_MAJOR >= 2
  (void)bucket_limits;
  return std::make_shared<c10d::Reducer>(
      params, bucket_indices, process_group, sparse, bucket_bytes,
      /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/false, no_names,
      first_bucket_bytes, /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
      /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
#else
  return std::make_shared<c10d::Reducer>(
      params, bucket_indices, bucket_limits, process_group, sparse, bucket_bytes,
      /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/false, no_names,
      first_bucket_bytes);
#endif
}

}  // namespace fsdp::compat
