// DDP baseline for fsdp-bench: bucketed gradient all-reduce overlapped with backward, the data
// parallelism a LibTorch user would otherwise write by hand (C++ has no DDP module).
// Thread-safety: hooks run on the backward thread; used by one training thread.
#pragma once

#include <fsdp/communicator.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

#include <memory>
#include <vector>

namespace fsdp::bench {

// ---------------------------------------------------------------------------------------------
// DDP baseline: bucketed all-reduce overlapped with backward, as c10d::Reducer does it.
// ---------------------------------------------------------------------------------------------

// Buckets hold parameters in reverse registration order (roughly the order backward produces
// their gradients). A parameter's AccumulateGrad post hook copies its final gradient into its
// bucket; a complete bucket is all-reduced at once, in bucket order on every rank (a complete
// bucket waits for the ones before it, so ranks issue the same collectives in the same order).
// finish() issues what is left (gradients that never arrived count as zeros), waits, and writes
// the mean gradients back.
class BucketReducer {
 public:
  BucketReducer(std::vector<at::Tensor> params, std::shared_ptr<Communicator> lane,
                int64_t bucket_bytes)
      : params_(std::move(params)), lane_(std::move(lane)) {
    for (size_t k = params_.size(); k-- > 0;) {
      const at::Tensor& p = params_[k];
      if (!p.requires_grad()) continue;
      const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
      if (buckets_.empty() || buckets_.back().bytes + bytes > bucket_bytes) buckets_.emplace_back();
      Bucket& b = buckets_.back();
      b.slots.push_back({k, b.numel});
      b.numel += p.numel();
      b.bytes += bytes;
    }
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      Bucket& b = buckets_[bi];
      b.flat = at::empty({b.numel}, params_[b.slots[0].param].options().requires_grad(false));
      for (size_t si = 0; si < b.slots.size(); ++si) {
        auto acc = torch::autograd::impl::grad_accumulator(params_[b.slots[si].param]);
        // Autograd keeps only a weak reference to the accumulator: hold it, or the hook is lost.
        hooks_.push_back({acc, acc->add_post_hook(std::make_unique<Hook>(this, bi, si))});
      }
    }
  }
  ~BucketReducer() {
    for (auto& [acc, key] : hooks_) acc->del_post_hook(key);
  }
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  size_t bucket_count() const { return buckets_.size(); }

  // Before backward: every slot expects its gradient.
  void prepare() {
    for (Bucket& b : buckets_) {
      b.pending = static_cast<int>(b.slots.size());
      for (Slot& s : b.slots) s.arrived = false;
      b.work = Work();
    }
    next_ = 0;
  }

  // After backward, before the optimizer step.
  void finish() {
    trace::Span span("ddp.finish", "wait");
    for (; next_ < buckets_.size(); ++next_) {
      Bucket& b = buckets_[next_];
      for (Slot& s : b.slots)
        if (!s.arrived) b.flat.narrow(0, s.offset, params_[s.param].numel()).zero_();
      b.work = lane_->all_reduce(b.flat, ReduceOp::kAvg);
    }
    for (Bucket& b : buckets_) {
      b.work.wait();
      for (const Slot& s : b.slots) {
        at::Tensor p = params_[s.param];
        auto mean = b.flat.narrow(0, s.offset, p.numel()).view(p.sizes());
        if (p.grad().defined()) {
          p.mutable_grad().copy_(mean);
        } else {
          p.mutable_grad() = mean.clone();
        }
      }
    }
  }

 private:
  struct Slot {
    size_t param;    // index into params_
    int64_t offset;  // element offset in the bucket's flat buffer
    bool arrived = false;
  };
  struct Bucket {
    std::vector<Slot> slots;
    int64_t numel = 0, bytes = 0;
    at::Tensor flat;  // (numel,) gradients in, mean gradients out
    int pending = 0;
    Work work;
  };
  // One-line adapter: the gradient of params_[slot] is final.
  struct Hook : torch::autograd::FunctionPostHook {
    Hook(BucketReducer* r, size_t b, size_t s) : reducer(r), bucket(b), slot(s) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      reducer->on_grad_ready(bucket, slot);
      return outputs;
    }
    BucketReducer* reducer;
    size_t bucket, slot;
  };

  void on_grad_ready(size_t bi, size_t si) {
    Bucket& b = buckets_[bi];
    Slot& s = b.slots[si];
    if (s.arrived || bi < next_) return;  // a second accumulation in one backward: too late
    const at::Tensor& p = params_[s.param];
    auto dst = b.flat.narrow(0, s.offset, p.numel());
    if (p.grad().defined()) {
      dst.copy_(p.grad().reshape({-1}));
    } else {
      dst.zero_();
    }
    s.arrived = true;
    --b.pending;
    while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
      buckets_[next_].work = lane_->all_reduce(buckets_[next_].flat, ReduceOp::kAvg);
      ++next_;
    }
  }

  std::vector<at::Tensor> params_;
  std::shared_ptr<Communicator> lane_;
  std::vector<Bucket> buckets_;
  size_t next_ = 0;  // first bucket not yet issued in this backward
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
};

}  // namespace fsdp::bench
