// fully_shard: FSDP2 semantics for torch::nn modules.
//
// Declare each module to shard as fsdp::Sharded<Holder> in place of Holder, call fully_shard
// bottom-up (blocks first, then the root), build the optimizer on the root handle's parameters(),
// and train as usual. Each parameter is sharded on dim 0 across ranks (torch.chunk rule;
// ShardOptions::shard_placement_fn picks another dim); it is all-gathered before its module's
// forward and again before its backward; its gradient is reduce-scattered (mean over ranks) once
// every participating gradient of its group is final ([Note: the post-backward guarantee] in
// docs/design.md). Every setting is described in docs/guide.md.
// Thread-safety: a sharded model is used by one thread at a time, like any torch::nn module.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/communicator.h>
#include <fsdp/custom_collectives.h>
#include <fsdp/detail/fully_shard_impl.h>
#include <fsdp/detail/sharded_call.h>
#include <fsdp/error.h>
#include <fsdp/mesh.h>
#include <fsdp/options.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace torch::serialize {
class OutputArchive;
}

namespace fsdp {

template <class Holder>
class Sharded;
class ShardedRef;

// ---- entry points ----
// Shards `module`'s parameters that no sharded descendant manages, over `comm` (or, HSDP, within
// mesh.shard and averaged across mesh.replicate). Apply bottom-up. The module must be declared as
// fsdp::Sharded<...> so that its calls can be intercepted.
template <class Holder>
FSDPModule fully_shard(Sharded<Holder>& module, std::shared_ptr<Communicator> comm,
                       const ShardOptions& options = {});
template <class Holder>
FSDPModule fully_shard(Sharded<Holder>& module, const DeviceMesh& mesh,
                       const ShardOptions& options = {});
// Several modules as one group (FSDP2's fully_shard([a, b])): one all-gather before the first of
// them runs in a forward, one reduce-scatter for all their gradients; resharded when the
// top-level forward ends. Apply before sharding their common parent (a list is never the root).
// The group's options see its parameters under the module's position in the list: "0.weight" for
// modules[0]'s weight (ShardOptions::shard_placement_fn, param_dtype_override_fn).
FSDPModule fully_shard(const std::vector<ShardedRef>& modules, std::shared_ptr<Communicator> comm,
                       const ShardOptions& options = {});
FSDPModule fully_shard(const std::vector<ShardedRef>& modules, const DeviceMesh& mesh,
                       const ShardOptions& options = {});

// A parameter's shard as the optimizer and checkpoints see it.
struct ShardInfo {
  std::string name;                   // original name, relative to the handle's module
  std::vector<int64_t> global_shape;  // the full parameter's shape (a 0-d parameter is [] here)
  // This rank's slice [row_offset, row_offset + shard.size(dim)) of dim `dim`, contiguous.
  at::Tensor shard;
  int64_t dim = 0;
  int64_t row_offset = 0;     // first global index of dim `dim` held by this rank
  int64_t rows_per_rank = 0;  // c = ceil(global_shape[dim] / world), the chunk size
  bool requires_grad = true;
  bool ignored = false;  // ShardOptions::ignored_params: the whole parameter, this rank's own
};

// What unshard(/*async_op=*/true) returns (FSDP2's UnshardHandle): wait() finishes the gather (the
// module's forward waits for it anyway). Until then the shards are being sent: an optimizer step
// or any write to them in between is a data race.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(std::shared_ptr<detail::Binding> b) : binding_(std::move(b)) {}
  std::shared_ptr<detail::Binding> binding_;
};

// The handle fully_shard returns (FSDP2's FSDPModule). Copies share state. "Recursive" settings
// apply to this module's group and every sharded group below it; the others to its group only.
class FSDPModule {
 public:
  FSDPModule() = default;
  // The local shards of every parameter managed at or below this module (for a root: the whole
  // model) and the ignored ones, in the module's parameter order: pass them to the optimizer.
  std::vector<at::Tensor> parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<ShardInfo> shards() const;  // with shapes and offsets, for checkpoints

  // Gathers this module's group (a collective: every rank at the same point), or frees it again.
  UnshardHandle unshard(bool async_op = false);
  void reshard();
  void set_requires_gradient_sync(bool sync);     // recursive; off: micro-batches accumulate
  void set_reshard_after_backward(bool reshard);  // recursive
  void set_reshard_after_forward(bool reshard);
  void set_requires_all_reduce(bool all_reduce);  // recursive; HSDP only
  // Recursive with `recurse`: a parameter no rank gave a gradient keeps its gradient (off) or
  // gets zeros (on) ([Note: parameters that got no gradient]).
  void set_reduce_scatter_unused_params(bool reduce_scatter_unused_params, bool recurse = true);
  // Inside this module's forward the ranks may call different sharded modules
  // (RuntimeOptions::calls_may_differ); the same on every rank.
  void set_calls_may_differ(bool may_differ);
  // Reduces what backwards without gradient sync accumulated, without another backward; on the
  // root, between the last backward and the optimizer step, on every rank.
  void finalize_backward();
  void set_gradient_divide_factor(double factor);  // the sum over ranks divided by `factor`
  void set_unshard_in_backward(bool unshard);
  void set_all_reduce_hook(std::function<void(at::Tensor&)> hook);
  void set_custom_all_gather(std::shared_ptr<AllGather> comm);
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm);
  void set_keep_unsharded_storage(bool keep);
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);

  // Gathered-parameter memory of the model, counted from all-gather issue to reshard (bytes of
  // every group; groups other than the root), and the communication-buffer pool, now and peak.
  struct MemoryStats {
    int64_t unsharded_bytes = 0, peak_unsharded_bytes = 0;
    int unsharded_groups = 0, peak_unsharded_groups = 0;
    int64_t buffer_bytes_in_use = 0, buffer_bytes_idle = 0, peak_buffer_bytes_in_use = 0;
    int64_t post_forward_bytes = 0, peak_post_forward_bytes = 0;  // hpZ's kept 1/k
  };
  MemoryStats memory_stats() const;
  void reset_memory_peaks();

  const std::string& name() const;
  Communicator& communicator() const;  // the ranks sharding the model (HSDP: mesh.shard)
  const std::shared_ptr<Communicator>& replicate_communicator() const;  // HSDP; else null
  // HSDP: carries the all-reduces across replicas (and their checks) on `replicate` from now on,
  // for every group of this module's model: an elastic job's new membership (fsdp/elastic.h).
  // Collective over `replicate`'s ranks (it builds its lanes); between steps only.
  void set_replicate_communicator(std::shared_ptr<Communicator> replicate);
  bool defined() const { return binding_ != nullptr; }

 private:
  friend struct detail::HandleAccess;
  explicit FSDPModule(std::shared_ptr<detail::Binding> b) : binding_(std::move(b)) {}
  std::shared_ptr<detail::Binding> binding_;
};

// Declare a module to be sharded as Sharded<Holder> (e.g. Sharded<Block> for TORCH_MODULE(Block)):
// calls go through operator(), which gathers the parameters before forward and arranges backward.
template <class Holder>
class Sharded : public Holder {
 public:
  using Holder::Holder;
  Sharded(Holder h) : Holder(std::move(h)) {}  // NOLINT: implicit on purpose

  template <class... Args>
  decltype(auto) operator()(Args&&... args) {
    return call_as_forward(detail::CallForward{}, std::forward<Args>(args)...);
  }
  // Another method called as forward is (FSDP2's register_fsdp_forward_method), e.g.
  // model.call(&NetImpl::generate, x).
  template <class Method, class... Args>
  decltype(auto) call(Method method, Args&&... args) {
    static_assert(std::is_member_function_pointer_v<Method>,
                  "Sharded::call takes a pointer to a member function of the module, e.g. "
                  "&BlockImpl::encode");
    return call_as_forward(method, std::forward<Args>(args)...);
  }
  bool is_sharded() const { return binding_ != nullptr; }

 private:
  template <class Method, class... Args>
  decltype(auto) call_as_forward(const Method& method, Args&&... args) {
    if (!binding_) return std::invoke(method, *this->get(), std::forward<Args>(args)...);
    return detail::call_sharded(binding_, this->ptr(), method, std::forward<Args>(args)...);
  }
  friend struct detail::HandleAccess;
  std::shared_ptr<detail::Binding> binding_;  // set by fully_shard
};

// torch::save(model) on a sharded module would write empty full parameters: it throws
// fsdp::Error naming fsdp::full_state_dict and fsdp::checkpoint::save instead.
template <class Archive, class Holder,
          class = std::enable_if_t<std::is_same_v<Archive, torch::serialize::OutputArchive>>>
Archive& operator<<(Archive& archive, const Sharded<Holder>& module) {
  if (module.is_sharded()) detail::reject_torch_save(detail::HandleAccess::binding(module));
  return archive << static_cast<const Holder&>(module);
}

// Any fsdp::Sharded<T>, for fully_shard({model->norm, model->output}, world, options).
class ShardedRef {
 public:
  template <class Holder>
  ShardedRef(Sharded<Holder>& module)  // NOLINT: implicit on purpose
      : module_(module.ptr()),
        sharded_(module.is_sharded()),
        attach_([&module](const FSDPModule& h) { detail::HandleAccess::attach(module, h); }) {}

 private:
  friend struct detail::HandleAccess;
  std::shared_ptr<torch::nn::Module> module_;
  bool sharded_;
  std::function<void(const FSDPModule&)> attach_;
};

template <class Holder>
FSDPModule fully_shard(Sharded<Holder>& module, std::shared_ptr<Communicator> comm,
                       const ShardOptions& options) {
  return fully_shard(std::vector<ShardedRef>{module}, std::move(comm), options);
}

template <class Holder>
FSDPModule fully_shard(Sharded<Holder>& module, const DeviceMesh& mesh,
                       const ShardOptions& options) {
  return fully_shard(std::vector<ShardedRef>{module}, mesh, options);
}

template <class Holder,
          class = std::enable_if_t<!std::is_same_v<std::decay_t<Holder>, std::vector<ShardedRef>>>>
FSDPModule fully_shard(Holder&, std::shared_ptr<Communicator>, const ShardOptions& = {}) {
  static_assert(sizeof(Holder) == 0,
                "fsdp::fully_shard needs the module declared as fsdp::Sharded<T> (a one-word "
                "change in the model) so that its forward can be intercepted. For the elements "
                "of a torch::nn::Sequential or ModuleList, or the layers of a "
                "TransformerEncoder/Decoder, call fsdp::fully_shard_elements on the container "
                "(fsdp/containers.h)");
  return {};
}

}  // namespace fsdp
