// fully_shard: FSDP2 semantics for torch::nn modules.
//
// Usage (see README): declare each module to shard as fsdp::Sharded<Holder> in place of Holder,
// call fully_shard bottom-up (blocks first, then the root), build the optimizer on the root
// handle's parameters(), and train as usual. Each parameter is sharded on dim 0 across ranks
// (torch.chunk rule; ShardOptions::shard_placement_fn picks another dim); it is all-gathered before
// its module's forward and again before its backward; its gradient is reduce-scattered (mean over
// ranks) once every participating gradient of its group is final. See docs/design.md, [Note: the
// post-backward guarantee].
//
// Thread-safety: a sharded model is used by one thread at a time, like any torch::nn module.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/communicator.h>
#include <fsdp/custom_collectives.h>
#include <fsdp/error.h>
#include <fsdp/mesh.h>
#include <fsdp/options.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::serialize {
class OutputArchive;
}

namespace fsdp {

namespace detail {
class Group;

template <class T>
struct IsVector : std::false_type {};
template <class T, class A>
struct IsVector<std::vector<T, A>> : std::true_type {};
template <class T>
struct IsTupleLike : std::false_type {};
template <class... T>
struct IsTupleLike<std::tuple<T...>> : std::true_type {};
template <class A, class B>
struct IsTupleLike<std::pair<A, B>> : std::true_type {};
// std::optional and c10::optional (distinct in LibTorch 1.13, one type in 2.x).
template <class T, class = void>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<T, std::void_t<typename T::value_type, decltype(std::declval<T>().has_value()),
                                 decltype(*std::declval<T>())>> : std::true_type {};
template <class>
inline constexpr bool kUnsupportedOutput = false;

// Visits the tensors in a forward's result (mixed precision casts them, then they get the
// pre-backward hooks). Supported: at::Tensor, std::vector, std::tuple, std::pair and std::optional
// of supported types (nested), and values holding no tensor (arithmetic, enums, std::string),
// which pass through untouched.
template <class T, class F>
void visit_output_tensors(T& v, F& f) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, at::Tensor>) {
    f(v);
  } else if constexpr (IsVector<D>::value) {
    for (auto& e : v) visit_output_tensors(e, f);
  } else if constexpr (IsTupleLike<D>::value) {
    std::apply([&](auto&... e) { (visit_output_tensors(e, f), ...); }, v);
  } else if constexpr (IsOptional<D>::value) {
    if (v) visit_output_tensors(*v, f);
  } else if constexpr (std::is_arithmetic_v<D> || std::is_enum_v<D> ||
                       std::is_same_v<D, std::string>) {
  } else {
    static_assert(kUnsupportedOutput<D>,
                  "fsdp::Sharded: this forward returns a type fsdp-cpp cannot look into for "
                  "tensors. Supported results: at::Tensor, std::vector, std::tuple, std::pair and "
                  "std::optional of supported types (nested), and values holding no tensor "
                  "(arithmetic, enums, std::string). Return one of these (e.g. a std::tuple of the "
                  "struct's tensors) from the sharded module's forward");
  }
}

// The tensors in `v` (visit_output_tensors' rules), in order.
template <class T>
void collect_output_tensors(const T& v, std::vector<at::Tensor>& out) {
  auto push = [&](const at::Tensor& t) { out.push_back(t); };
  visit_output_tensors(v, push);
}

// The forward interception, one object per call of a sharded module.
class ForwardScope {
 public:
  ForwardScope(Group* group);  // pre-forward: unshard (or wait for the prefetch)
  ~ForwardScope();  // when forward threw: reshards, drops prefetched gathers, restores state
  // post-forward: casts the result's tensors (mixed precision's output_dtype), registers
  // pre-backward hooks on them, reshards if configured.
  template <class T>
  std::decay_t<T> finish(T&& out) {
    std::decay_t<T> result(std::forward<T>(out));
    std::vector<at::Tensor> tensors;
    auto visit = [&](at::Tensor& t) {
      t = output(t);
      tensors.push_back(t);
    };
    visit_output_tensors(result, visit);
    finish_tensors(tensors);
    return result;
  }
  void finish_tensors(const std::vector<at::Tensor>& outs);
  at::Tensor output(const at::Tensor& y);  // the output_dtype cast (identity when unset)
  // Each tensor input is handed to forward through an input-side node that marks this call's
  // backward done (for resharding).
  at::Tensor input(const at::Tensor& x);

 private:
  Group* group_;
  bool finished_ = false;
};

template <class T>
decltype(auto) wrap_input(ForwardScope& s, T&& x) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return s.input(x);
  } else {
    return std::forward<T>(x);
  }
}

// Calls a module's forward; the member-function pointer of Sharded::call stands for any other.
struct CallForward {
  template <class Impl, class... Args>
  decltype(auto) operator()(Impl& impl, Args&&... args) const {
    return impl.forward(std::forward<Args>(args)...);
  }
};

// activation_checkpoint.h (included at the end of this header).
bool activation_checkpointing(Group& group);
template <class Impl, class Method, class... Args>
std::decay_t<std::invoke_result_t<const Method&, Impl&, std::decay_t<Args>&...>> checkpointed_call(
    Group& group, const std::shared_ptr<Impl>& impl, const Method& method, Args&&... args);
}  // namespace detail

// A parameter's shard as the optimizer and checkpoints see it.
struct ShardInfo {
  std::string name;                   // original name, relative to the handle's module
  std::vector<int64_t> global_shape;  // the full parameter's shape (a 0-d parameter is [] here)
  // This rank's slice [row_offset, row_offset + shard.size(dim)) of dim `dim` (0 unless
  // ShardOptions::shard_placement_fn says otherwise), contiguous; the full shape elsewhere.
  at::Tensor shard;
  int64_t dim = 0;
  int64_t row_offset = 0;     // first global index of dim `dim` held by this rank
  int64_t rows_per_rank = 0;  // c = ceil(global_shape[dim] / world), the chunk size
  bool requires_grad = true;
  // ShardOptions::ignored_params: `shard` is the whole parameter (dim 0, row_offset 0,
  // rows_per_rank its rows), this rank's own, never gathered or reduced.
  bool ignored = false;
};

template <class Holder>
class Sharded;

namespace detail {
// fsdp-cpp's own access to the group behind a handle or a holder (not for users).
struct HandleAccess;
}  // namespace detail

// What FSDPModule::unshard(/*async_op=*/true) returns (FSDP2's UnshardHandle): the module's
// all-gather is in flight; wait() finishes it. The module's forward waits for it anyway, so wait()
// is needed only where the parameters are used before that. Waiting after the gather finished, or
// on the empty handle a blocking unshard() returns, does nothing. Until the gather is waited the
// shards are being sent: an optimizer step or any write to them in between is a data race.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(std::shared_ptr<detail::Group> g) : group_(std::move(g)) {}
  std::shared_ptr<detail::Group> group_;
};

// Handle returned by fully_shard. Copies share state.
class FSDPModule {
 public:
  FSDPModule() = default;

  // The local shards of every parameter managed at or below this module (for a root: the whole
  // model), in the module's parameter order, and the parameters fully_shard left whole
  // (ShardOptions::ignored_params). Pass these to any torch::optim optimizer.
  std::vector<at::Tensor> parameters() const;
  // The same under the original (unsharded) parameter names.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  // Full description of each (global shape, offsets, whether ignored), for checkpoints.
  std::vector<ShardInfo> shards() const;

  // Gathers this module's own group of parameters, or frees it again. unshard() blocks;
  // unshard(/*async_op=*/true) issues the all-gather and returns at once (a manual prefetch; every
  // rank must issue it at the same point, as any collective): see UnshardHandle.
  UnshardHandle unshard(bool async_op = false);
  void reshard();
  // Off: backward keeps unsharded gradients locally (accumulation); on: the next backward reduces
  // their sum. Applies to this module and every sharded module below it.
  void set_requires_gradient_sync(bool sync);
  void set_reshard_after_backward(bool reshard);
  // FSDP2's finalize_backward, called on the root: reduces now the gradients that backwards with
  // set_requires_gradient_sync(false) accumulated, without another backward (a pipeline
  // schedule's last micro-batch ran its backward unsynced, say). Turn sync back on first: every
  // group with sync on and trainable parameters reduce-scatters what its parameters hold (zeros
  // where nothing), the shards' gradients get the result, and the groups reshard (as
  // reshard_after_backward says). A collective: every rank, at the same point, with the same
  // sync settings (ranks that differ stop, naming it). Not inside a forward or a backward.
  void finalize_backward();
  void set_reshard_after_forward(bool reshard);
  // This module's group only (as FSDP2): a reduced gradient is the sum over the data-parallel
  // ranks (HSDP: shards times replicas) divided by `factor`, instead of their mean (e.g. the
  // number of tokens when the loss is a sum). Must be positive and finite; the same on every rank.
  void set_gradient_divide_factor(double factor);
  // HSDP, this module and every sharded module below it: off, a synced backward reduce-scatters
  // within the replica but skips the all-reduce across replicas, keeping the reduced block aside;
  // the next backward with it on adds it in before its all-reduce (gradient accumulation that
  // moves 1/R of the replica traffic). The shards' gradients change only at that backward.
  // Without replicas it changes nothing. The same on every rank.
  void set_requires_all_reduce(bool all_reduce);
  // FSDP2's set_reduce_scatter_unused_params. Off (the default), a parameter that got no
  // gradient on any rank in a backward keeps its shard's gradient as it was (none stays none, so
  // optimizers skip it, as they skip such a parameter of the unsharded model), and a group no
  // rank has any gradient for is not reduce-scattered at all; a parameter used on some ranks only
  // still gets the mean with zeros from the others. On, every trainable parameter gets the
  // reduction (zeros where no rank had a gradient). The ranks decide together, so it may differ
  // between ranks. This module and, with `recurse`, every sharded module below it.
  void set_reduce_scatter_unused_params(bool reduce_scatter_unused_params, bool recurse = true);
  // This module's group only (as FSDP2): false leaves its parameters resharded through backward,
  // saving the backward all-gather, for a module whose backward reads none of them (an embedding:
  // its weight's gradient needs only the indices). Where backward does read one, backward stops
  // with an fsdp::Error naming the parameter and this setting. The same on every rank.
  void set_unshard_in_backward(bool unshard);
  // This module's group only (FSDP2's set_all_reduce_hook): `hook` runs on the group's reduced
  // gradient block, flat, this rank's S elements in the reduction's dtype: the reduce-scatter's
  // output (under HSDP after the all-reduce across replicas), divided as configured, before it is
  // added to the shards' gradients; it may change it in place (all-reduce it across another
  // dimension, scale it, clip it). It runs on the thread of the backward, on every rank in the
  // same order (the reduce order), and only once this rank has issued every all-gather of the
  // backward, so it may issue collectives of its own; the same hook (or none) on every rank. An
  // empty function removes it. Under HSDP with set_requires_all_reduce(false) it runs at the
  // backward that all-reduces.
  void set_all_reduce_hook(std::function<void(at::Tensor&)> hook);
  // This module's group only (FSDP2's set_custom_all_gather / set_custom_reduce_scatter): its
  // all-gathers (also hpZ's within the post-forward ranks) or reduce-scatters run through `comm`
  // (fsdp/custom_collectives.h). The same kind on every rank, between steps; null restores the
  // communicator's.
  void set_custom_all_gather(std::shared_ptr<AllGather> comm);
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm);
  // This module's group only (FSDP2's set_keep_unsharded_storage): true keeps the storage of the
  // gathered parameters allocated when the group reshards, and every later gather fills the same
  // bytes, so each full parameter has the same address every time it is gathered (what a CUDA
  // graph captured over the forward needs). While resharded the parameters still read as
  // resharded (the guard), and the group holds its full size of memory all along
  // (memory_stats().buffer_bytes_in_use). false releases the storage at the next reshard.
  void set_keep_unsharded_storage(bool keep);
  // Prefetch overrides (see docs/performance.md): groups whose all-gather is issued when this
  // module's forward (backward) starts.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);

  // Gathered-parameter memory of this module's root context, counted from all-gather issue to
  // reshard: bytes of every group, and the number of groups other than the root (which stays
  // gathered from forward to the end of backward by default), now and peak.
  // Communication buffers (all-gather receive, full blocks, reduce-scatter send) of the context's
  // pool: in use now, kept idle for reuse, and the most ever in use at once (the pool keeps no
  // more than that in use and idle together; reset_memory_peaks leaves it).
  struct MemoryStats {
    int64_t unsharded_bytes = 0, peak_unsharded_bytes = 0;
    int unsharded_groups = 0, peak_unsharded_groups = 0;
    int64_t buffer_bytes_in_use = 0, buffer_bytes_idle = 0, peak_buffer_bytes_in_use = 0;
    // reshard_after_forward = k: the 1/k of the parameters kept from forward for backward.
    int64_t post_forward_bytes = 0, peak_post_forward_bytes = 0;
  };
  MemoryStats memory_stats() const;
  void reset_memory_peaks();

  const std::string& name() const;
  Communicator& communicator() const;  // the ranks sharding the model (HSDP: mesh.shard)
  // HSDP: the ranks holding the same shards (mesh.replicate); null for plain FSDP.
  const std::shared_ptr<Communicator>& replicate_communicator() const;
  bool defined() const { return group_ != nullptr; }

 private:
  friend struct detail::HandleAccess;
  explicit FSDPModule(std::shared_ptr<detail::Group> g) : group_(std::move(g)) {}
  std::shared_ptr<detail::Group> group_;
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
    // impl.forward directly: ModuleHolder::operator() cannot deduce overloaded forwards.
    return call_as_forward(detail::CallForward{}, std::forward<Args>(args)...);
  }

  // Another method of the module called as its forward is (FSDP2's
  // register_fsdp_forward_method): the parameters gathered first, backward arranged, resharded
  // after as configured, checkpointed if the module is. E.g. model.call(&NetImpl::generate, x).
  template <class Method, class... Args>
  decltype(auto) call(Method method, Args&&... args) {
    static_assert(std::is_member_function_pointer_v<Method>,
                  "Sharded::call takes a pointer to a member function of the module, e.g. "
                  "&BlockImpl::encode");
    return call_as_forward(method, std::forward<Args>(args)...);
  }

  // Whether fully_shard has sharded this module.
  bool is_sharded() const { return group_ != nullptr; }

 private:
  template <class Method, class... Args>
  decltype(auto) call_as_forward(const Method& method, Args&&... args) {
    auto& impl = *this->get();
    if (!group_) return std::invoke(method, impl, std::forward<Args>(args)...);
    detail::ForwardScope scope(group_.get());
    using Result = std::invoke_result_t<const Method&, decltype(impl), Args&&...>;
    if constexpr (!std::is_void_v<Result>) {
      // ShardOptions::activation_checkpointing: activation_checkpoint.h.
      if (detail::activation_checkpointing(*group_))
        return scope.finish(detail::checkpointed_call(
            *group_, this->ptr(), method, detail::wrap_input(scope, std::forward<Args>(args))...));
    }
    if constexpr (std::is_void_v<Result>) {
      std::invoke(method, impl, detail::wrap_input(scope, std::forward<Args>(args))...);
      scope.finish_tensors({});
    } else {
      return scope.finish(
          std::invoke(method, impl, detail::wrap_input(scope, std::forward<Args>(args))...));
    }
  }

  friend struct detail::HandleAccess;
  std::shared_ptr<detail::Group> group_;  // set by fully_shard
};

namespace detail {
struct HandleAccess {
  static FSDPModule make(std::shared_ptr<Group> g) { return FSDPModule(std::move(g)); }
  static const std::shared_ptr<Group>& group(const FSDPModule& m) { return m.group_; }
  template <class Holder>
  static const std::shared_ptr<Group>& group(const Sharded<Holder>& s) {
    return s.group_;
  }
  template <class Holder>
  static void attach(Sharded<Holder>& s, const FSDPModule& handle) {
    s.group_ = handle.group_;
  }
};

// Throws the error of torch::save on a sharded module (below).
[[noreturn]] void reject_torch_save(const Group& group);
}  // namespace detail

// torch::save(model) on a sharded module would write its full parameters, which hold no bytes
// while resharded (0-byte records, a crash when loaded). It throws fsdp::Error instead, naming the
// ways to save a sharded model. Before fully_shard the module saves as its holder does.
template <class Archive, class Holder,
          class = std::enable_if_t<std::is_same_v<Archive, torch::serialize::OutputArchive>>>
Archive& operator<<(Archive& archive, const Sharded<Holder>& module) {
  if (module.is_sharded()) detail::reject_torch_save(*detail::HandleAccess::group(module));
  return archive << static_cast<const Holder&>(module);
}

class ShardedRef;

namespace detail {
// How the calls of a module sharded by fully_shard_impl reach its group.
enum class CallPath : uint8_t {
  kHolder,  // through its fsdp::Sharded<T> holder, whose operator() runs the group's forward
  // Directly (a container element, fsdp/containers.h): the group gathers when an operator first
  // reads its parameters. Owned by the registry until a sharded ancestor absorbs it.
  kGatherOnUse,
};
// `members`: set for a module list (fully_shard_list), whose `module` is the container built
// around them.
FSDPModule fully_shard_impl(const std::shared_ptr<torch::nn::Module>& module,
                            std::shared_ptr<Communicator> comm,
                            std::shared_ptr<Communicator> replicate, const ShardOptions& options,
                            CallPath path, const std::vector<torch::nn::Module*>& members = {});
// Throws the error of a second fully_shard on one module.
[[noreturn]] void reject_second_fully_shard(const torch::nn::Module& module);
FSDPModule fully_shard_list(const std::vector<ShardedRef>& modules,
                            std::shared_ptr<Communicator> comm,
                            std::shared_ptr<Communicator> replicate, const ShardOptions& options);
}  // namespace detail

// Shards `module`'s parameters that no sharded descendant manages. Apply bottom-up. The module must
// be declared as fsdp::Sharded<...> so that its calls can be intercepted.
template <class Holder>
FSDPModule fully_shard(Sharded<Holder>& module, std::shared_ptr<Communicator> comm,
                       const ShardOptions& options = {}) {
  if (module.is_sharded()) detail::reject_second_fully_shard(*module.ptr());
  auto handle = detail::fully_shard_impl(module.ptr(), std::move(comm), nullptr, options,
                                         detail::CallPath::kHolder);
  detail::HandleAccess::attach(module, handle);
  return handle;
}

// HSDP: shards within mesh.shard (this rank's replica) and averages the reduced gradients across
// mesh.replicate. Every module of one model must be sharded over the same mesh.
template <class Holder>
FSDPModule fully_shard(Sharded<Holder>& module, const DeviceMesh& mesh,
                       const ShardOptions& options = {}) {
  FSDP_CHECK(mesh.shard != nullptr,
             "fully_shard: the DeviceMesh is empty (build it with init_mesh)");
  if (module.is_sharded()) detail::reject_second_fully_shard(*module.ptr());
  auto handle = detail::fully_shard_impl(module.ptr(), mesh.shard, mesh.replicate, options,
                                         detail::CallPath::kHolder);
  detail::HandleAccess::attach(module, handle);
  return handle;
}

// One of several modules sharded together as one group (FSDP2's fully_shard([a, b])): any
// fsdp::Sharded<T>, converted implicitly, so that the call reads
// fsdp::fully_shard({model->norm, model->output}, world, options).
class ShardedRef {
 public:
  template <class Holder>
  ShardedRef(Sharded<Holder>& module)  // NOLINT: implicit on purpose
      : module_(module.ptr()), attach_([&module](const FSDPModule& handle) {
          detail::HandleAccess::attach(module, handle);
        }) {}

 private:
  friend FSDPModule detail::fully_shard_list(const std::vector<ShardedRef>&,
                                             std::shared_ptr<Communicator>,
                                             std::shared_ptr<Communicator>, const ShardOptions&);
  std::shared_ptr<torch::nn::Module> module_;
  std::function<void(const FSDPModule&)> attach_;
};

// Shards the parameters of several modules (and of no sharded module below them) as one group,
// FSDP2's fully_shard([a, b]): one all-gather before the first of them runs in a forward, one
// reduce-scatter for all their gradients, e.g. the final norm and the output projection, or an
// embedding and an output layer that share their weight. The group is resharded (as
// reshard_after_forward says; default true) when the top-level forward ends, not between its
// modules. Apply before sharding their common parent, which must be sharded before the first
// forward (a module list is never the root). Every returned handle method applies to the group;
// each module's holder calls it.
FSDPModule fully_shard(const std::vector<ShardedRef>& modules, std::shared_ptr<Communicator> comm,
                       const ShardOptions& options = {});
FSDPModule fully_shard(const std::vector<ShardedRef>& modules, const DeviceMesh& mesh,
                       const ShardOptions& options = {});

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

#include <fsdp/activation_checkpoint.h>  // checkpointed_call, used by Sharded
