// DDP baseline for fsdp-bench: PyTorch's own DDP reducer (c10d::Reducer, compiled into LibTorch),
// driven from C++ the way torch.nn.parallel.DistributedDataParallel drives it in 1.13: buckets from
// c10d::compute_bucket_assignment_by_size with a 1 MiB first bucket and `bucket_bytes` after it,
// reversed; before each forward rebuild_buckets() (the first backward's gradient order) and
// prepare_for_forward(); after it prepare_for_backward({}) (all parameters used). The reducer's
// AccumulateGrad hooks copy gradients into buckets, all-reduce each complete bucket on the process
// group (sum, divided by the world size), and its end-of-backward callback writes the mean
// gradients back, so they are final when loss.backward() returns.
//
// c10d::Reducer talks to the c10d process group directly, not through fsdp::Communicator, so its
// traffic is accounted here: every bucket is all-reduced once per backward (no unused parameters),
// 2(N-1)/N of its bytes on the wire (ring), and the exposed communication is the time from the
// last gradient hook to the end of backward (the reducer's wait for the buckets still in flight).
// Thread-safety: hooks run on the backward thread; used by one training thread.
#pragma once

#include <fsdp/communicator.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <vector>

#include "compat/autograd.h"
#include "compat/reducer.h"

namespace fsdp::bench {

class DdpReducer {
 public:
  using Clock = std::chrono::steady_clock;

  // `lane` gives the reducer a process group of its own (its collectives, e.g. the bucket rebuild
  // broadcast, are ordered independently of the training communicator's).
  DdpReducer(std::vector<at::Tensor> params, const std::shared_ptr<Communicator>& lane,
             int64_t bucket_bytes)
      : params_(std::move(params)), world_(lane->size()) {
    std::vector<bool> sparse(params_.size(), false);
    auto [indices, limits] = c10d::compute_bucket_assignment_by_size(
        params_,
        {static_cast<size_t>(c10d::kDefaultFirstBucketBytes), static_cast<size_t>(bucket_bytes)},
        sparse);
    std::reverse(indices.begin(), indices.end());
    std::reverse(limits.begin(), limits.end());
    buckets_ = indices.size();
    reducer_ = compat::make_reducer(params_, indices, limits, lane->process_group(), bucket_bytes,
                                    c10d::kDefaultFirstBucketBytes);
    for (const auto& p : params_) {
      bytes_ += p.numel() * static_cast<int64_t>(p.element_size());
      auto acc = torch::autograd::impl::grad_accumulator(p);
      // Autograd keeps only a weak reference to the accumulator: hold it, or the hook is lost.
      hooks_.push_back({acc, acc->add_post_hook(std::make_unique<LastGrad>(this))});
    }
  }
  ~DdpReducer() {
    for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
  }
  DdpReducer(const DdpReducer&) = delete;
  DdpReducer& operator=(const DdpReducer&) = delete;

  void before_forward() {
    reducer_->rebuild_buckets();
    reducer_->prepare_for_forward();
  }
  void before_backward() {
    reducer_->prepare_for_backward({});
    last_grad_ = Clock::now();
  }
  // After loss.backward(): the seconds backward spent after the last gradient was produced.
  double after_backward() {
    return std::chrono::duration<double>(Clock::now() - last_grad_).count();
  }

  size_t bucket_count() const { return buckets_; }
  // Bytes this rank puts on the wire per backward (ring all-reduce of every bucket once).
  int64_t bytes_per_step() const { return world_ > 1 ? 2 * bytes_ * (world_ - 1) / world_ : 0; }

 private:
  struct LastGrad : torch::autograd::FunctionPostHook {
    explicit LastGrad(DdpReducer* r) : reducer(r) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      reducer->last_grad_ = Clock::now();
      return outputs;
    }
    DdpReducer* reducer;
  };

  std::vector<at::Tensor> params_;
  int world_;
  size_t buckets_ = 0;
  int64_t bytes_ = 0;
  std::shared_ptr<c10d::Reducer> reducer_;
  Clock::time_point last_grad_{};
  std::vector<std::pair<compat::NodePtr, uintptr_t>> hooks_;
};

}  // namespace fsdp::bench
