// Group (FSDP2's FSDPParamGroup): the parameters of one fully_shard call and their lifecycle.
//
// A Group owns one all-gather and at most one reduce-scatter per pass, over flat buffers. Its
// runtime methods appear in the order they run: unshard, wait_for_unshard, reshard; pre_forward,
// post_forward; begin_backward_use, post_backward, finalize_backward. Which backward a
// hook belongs to, and when a group may gather, reduce or reshard during it, is decided by that
// backward's BackwardPass ([Note: agreement on both lanes] in docs/design.md); the Group carries
// out the decision and keeps its own state (ShardState, TrainingState) with checked transitions.
//
// Ownership points down: handles and Sharded holders own Groups; Groups share their Context; the
// Context refers back to its groups by raw pointer (each group unregisters itself on destruction).
// No code outside Group writes a Group's fields.
// Thread-safety: hooks run on the engine's threads (the thread that called backward, on CPU);
// they enter the Context's BackwardPasses, which serialises them (core/backward_passes.h).
#pragma once

#include <fsdp/communicator.h>
#include <fsdp/custom_collectives.h>
#include <fsdp/options.h>
#include <fsdp/trace.h>

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/param.h"

namespace torch::nn {
class Module;
}

namespace fsdp::detail {

class BufferPool;
class Context;
class Group;

enum class ShardState {
  kSharded,    // only the shards hold data; full parameters have no storage (guarded)
  kGathering,  // all-gather issued, not yet copied out
  kUnsharded,  // full parameters allocated and filled
};
const char* to_string(ShardState s);

enum class TrainingState {
  kIdle,          // between passes
  kForward,       // inside a forward call of the module
  kPreBackward,   // this backward needs the gathered parameters (an output hook fired)
  kPostBackward,  // this backward is done with the group: gradients handed over, may reshard
};
const char* to_string(TrainingState s);

// An all-gather in flight: the flat send block and the (world, S) receive buffer. The send block
// is the group's flat shard block itself when the shards live there (Group::sends_in_place),
// else a pooled copy.
struct PendingGather {
  Work work;
  at::Tensor send, recv;  // recv: the flat (world, S) buffer; undefined when gathered into places
  bool send_pooled = false;
};

// A reduce-scatter in flight: waited and written to the shards' grads at the latest safe point.
// Under HSDP it has a second stage: the reduced block averaged across replicas (all-reduce).
// On one rank without replicas there is nothing to exchange: the gradients went straight to the
// shards when handed over (Group::hand_over_grad) and the reduction is empty.
struct PendingReduce {
  Group* group = nullptr;
  Work work;
  Work replicate_work;       // HSDP's all-reduce, once the reduce-scatter is done
  bool replicating = false;  // the reduce-scatter is done and the all-reduce issued
  at::Tensor output;         // this rank's reduced flat block (S elements); undefined: empty
  at::Tensor send;           // (world, S), returned to the pool once waited
  // Decided when issued (the settings may change before it is waited): HSDP's all-reduce follows
  // (else the block is kept aside, Group::set_requires_all_reduce), and the divisor is applied
  // once reduced (else the collectives took the mean).
  bool all_reduce = false;
  std::optional<double> divide_by;
};

class Group : public std::enable_shared_from_this<Group> {
 public:
  Group(torch::nn::Module* module, std::string type_name, std::vector<ParamState> params,
        std::shared_ptr<Communicator> comm, ShardOptions options);
  ~Group();
  // Installs the AccumulateGrad hooks and the resharded-parameter guard; called once the group
  // is owned by a shared_ptr.
  void attach_hooks();

  // ---- identity ----
  const std::string& name() const { return name_; }      // path under the root ("root" for it)
  const std::string& prefix() const { return prefix_; }  // "h.0." : prepended to param names
  void set_path(const std::string& path);                // when a parent absorbs this group
  const std::string& type_name() const { return type_name_; }
  torch::nn::Module* module() const { return module_; }
  // ---- a module list (fully_shard of several modules: FSDP2's fully_shard([a, b])) ----
  // module() is then a container holding the members as "0", "1", ..., owned by the group; the
  // parameters are named by it until a parent absorbs the group (set_member_paths).
  void set_members(std::shared_ptr<torch::nn::Module> container,
                   std::vector<torch::nn::Module*> members);
  bool is_list() const { return container_ != nullptr; }
  // The modules whose calls reach this group: its module, or the members of a list.
  const std::vector<torch::nn::Module*>& members() const { return members_; }
  // One of members() is in `modules`.
  bool inside(const std::set<const torch::nn::Module*>& modules) const;
  // A parent absorbs a list: each member's path under it; the group is named after them and its
  // parameters by their paths under the parent.
  void set_member_paths(const std::vector<std::string>& paths);
  const std::vector<ParamState>& params() const { return params_; }
  std::vector<ParamState>& params() { return params_; }
  Context& context() const { return *context_; }
  const std::shared_ptr<Context>& shared_context() const { return context_; }
  void set_context(std::shared_ptr<Context> c) { context_ = std::move(c); }
  Communicator& comm() const { return *comm_; }
  const ShardOptions& options() const { return options_; }
  bool is_root() const;
  bool has_trainable() const;
  int64_t flat_numel() const { return flat_numel_; }  // S: padded shard elements per rank
  // Dtypes on the wire (mixed precision): the all-gather's (= the full parameters') and the
  // reduce-scatter's.
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }
  at::Device device() const { return device_; }
  // ShardOptions::ignored_params: left whole and unmanaged; held so that their identity stays.
  const std::vector<at::Tensor>& ignored() const { return options_.ignored_params; }
  int64_t full_bytes() const;

  // Deferred initialisation: parameter i's values (full shape); its shard takes this rank's rows.
  void materialize_param(size_t i, const at::Tensor& full);
  bool materialized() const;
  void check_materialized() const;  // throws naming fsdp::materialize

  // ---- storage (FSDP2 order: unshard, wait_for_unshard, reshard) ----
  // Issues the all-gather unless gathered (with current shards) or in flight.
  void unshard();
  void wait_for_unshard();  // waits and copies out into the full parameters
  // Takes part in an all-gather of this group that another rank needs, keeping nothing
  // ([Note: calls that differ between ranks]); blocks until it completes.
  void serve_gather();
  // Frees the full parameters' storage (and a post-forward chunk); a gather in flight is waited
  // and discarded.
  void reshard();
  // ---- reshard_after_forward = k (hpZ): [Note: resharding to a smaller world after forward] ----
  // The lane of this rank's k consecutive ranks of the shard group (fully_shard creates it).
  void set_post_forward_lane(std::shared_ptr<Communicator> lane) {
    post_forward_lane_ = std::move(lane);
  }
  // This rank holds its 1/k of the full parameters, kept when its forward resharded.
  bool holds_chunk() const { return chunk_.defined(); }
  // Set by the backward's plan for each group: every rank of the shard group holds its chunk, so
  // the next gather runs within the post-forward lane (otherwise the chunk is dropped unused).
  void set_gather_from_chunk(bool v) { gather_from_chunk_ = v; }
  ShardState shard_state() const { return shard_state_; }
  // [Note: stale gathered parameters]: whether the full values might be older than the shards
  // is decided by the ranks together when a top-level forward begins (CallAgreement), from these.
  // Held (gathered or in flight) since before the current epoch.
  bool held_from_earlier_epoch() const;
  // This rank's shard changed since the gather (an optimizer step, any write), or cannot tell.
  bool changed_since_gather() const;
  void mark_current();  // found not stale: current in this epoch
  // The epoch of the gather ends with the group still gathered: remembers the shards' values
  // (once per gather), which stale() compares with later.
  void fingerprint_if_gathered();

  // ---- forward ----
  void begin_iteration();  // the first forward after a backward: clear per-iteration records
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outs);
  void abort_forward() noexcept;  // the forward threw: reshard, cancel prefetches, restore state
  // Casts a floating-point input to param_dtype (mixed precision) and hands it to the module
  // through the input-side node.
  at::Tensor wrap_input(const at::Tensor& x);
  // Mixed precision's output_dtype cast of one result tensor (identity when unset).
  at::Tensor cast_output(const at::Tensor& y) const;
  bool forwarded_with_grad() const { return forwarded_with_grad_; }
  // Autograd nodes recorded by this iteration's forward calls (weak: the graph owns them).
  const std::vector<compat::WeakNodePtr>& input_nodes() const { return input_nodes_; }
  const std::vector<compat::WeakNodePtr>& output_nodes() const { return output_nodes_; }

  // ---- elements gathered on first use (fully_shard_elements) ----
  // LibTorch's containers call their elements directly, so no holder can intercept an element's
  // forward. Such a group is gathered when an operator first reaches one of its resharded
  // parameters inside a forward of the root (the resharded-parameter guard calls
  // gather_on_use), and stays gathered until the end of that forward's backward (or of the
  // root's forward, without grad mode): nothing marks where its forward or backward ends.
  bool gathers_on_use() const { return on_use_; }
  // Keeps an element group below this one alive as long as this one (its owner: no holder is).
  void own(std::shared_ptr<Group> element) { owned_elements_.push_back(std::move(element)); }
  void set_gathers_on_use() { on_use_ = true; }
  // Its module contains other sharded modules (the root, a sharded parent): see post_backward.
  void set_contains_groups() { contains_groups_ = true; }
  // Gathers now and records the use as this group's forward call; false (doing nothing) unless
  // the group gathers on use and a forward of the root is running.
  bool gather_on_use();

  // ---- backward: the hooks enter context().backward(); its BackwardPass calls these ----
  void begin_backward_use();  // the gathered parameters are needed now (-> kPreBackward)
  void post_backward();       // this backward is done with the group (-> kPostBackward)
  void finalize_backward();   // end of the backward (-> kIdle), reshards if configured
  TrainingState training_state() const { return training_state_; }

  // ---- reduction ----
  // Hands parameter i's gradient, final for this backward, to the group's coming reduction: it is
  // packed into the reduction's send buffer (taken from the pool at the first) and dropped from
  // the parameter, so that a group's unsharded gradients and its send buffer are never both held.
  // On one rank (no replicas) it is added to the shard's gradient instead: there is no exchange.
  void hand_over_grad(size_t param_index);
  // Parameter i's gradient, final for a backward that does not reduce this group (gradient sync
  // off): kept for a later reduction, in reduce_dtype where that is wider than its compute dtype
  // (ParamState::keep_unsynced_grad).
  void keep_unsynced_grad(size_t param_index) {
    params_[param_index].keep_unsynced_grad(reduce_dtype_);
  }
  // A backward that does not reduce this group begins (ParamState::begin_unsynced_backward).
  void begin_unsynced_backward() {
    for (auto& p : params_) p.begin_unsynced_backward(reduce_dtype_);
  }
  bool has_handed_over() const { return handed_send_.defined(); }  // holds a send buffer
  // Packs the gradients not handed over (zeros when missing) and issues the reduce-scatter.
  PendingReduce issue_reduce_scatter();
  // Never blocks: true when finish_reduce would not wait. Under HSDP a finished reduce-scatter's
  // all-reduce across replicas is issued here (in reduction order, so every rank issues them in
  // the same order).
  bool poll_reduce(PendingReduce& p);
  void finish_reduce(PendingReduce& p);  // waits and accumulates into the shards' grads
  // A backward that failed before issuing this group's reduction: drops what was handed over.
  void drop_handed_over();
  // [Note: parameters that got no gradient] Something of this group's could be reduced even if
  // no gradient arrives in this backward: a parameter holds an unsharded or accumulated gradient,
  // HSDP set a reduced block aside, or set_reduce_scatter_unused_params is on.
  bool holds_gradients() const;
  // Whether a reduction wrote the shards' gradients since the last settle_shard_grads.
  bool wrote_shard_grads() const { return wrote_shard_grads_; }
  // Once every rank's contributions are known (`any_rank`, per parameter of this group): the
  // shards' gradients of parameters no rank contributed to go back to what they were
  // (ParamState::settle_shard_grad).
  void settle_shard_grads(const std::vector<bool>& any_rank);
  // FSDP2's set_reduce_scatter_unused_params: a parameter that got no gradient on any rank still
  // gets the reduction of zeros (a defined zero gradient, which optimizers step on).
  void set_reduce_scatter_unused_params(bool v) { reduce_scatter_unused_params_ = v; }
  bool reduce_scatter_unused_params() const { return reduce_scatter_unused_params_; }

  // ---- settings ----
  bool resolved_reshard_after_forward() const;
  void set_reshard_after_forward(bool v);
  void set_reshard_after_backward(bool v) { reshard_after_backward_ = v; }
  bool reshard_after_backward() const { return reshard_after_backward_; }
  bool requires_gradient_sync() const { return requires_gradient_sync_; }
  void set_requires_gradient_sync(bool v) { requires_gradient_sync_ = v; }
  // FSDP2's set_gradient_divide_factor: throws fsdp::Error unless positive and finite.
  void set_gradient_divide_factor(double factor);
  const std::optional<double>& gradient_divide_factor() const { return divide_factor_; }
  // FSDP2's set_unshard_in_backward: false leaves the group resharded through backward (its
  // backward reads none of its parameters: an embedding); throws with activation checkpointing.
  void set_unshard_in_backward(bool v);
  // FSDP2's set_all_reduce_hook: run on the reduced block before it reaches the shards' grads.
  void set_all_reduce_hook(std::function<void(at::Tensor&)> hook) { hook_ = std::move(hook); }
  bool has_all_reduce_hook() const { return static_cast<bool>(hook_); }
  // FSDP2's custom collectives: this group's all-gathers and reduce-scatters go through them.
  void set_custom_all_gather(std::shared_ptr<AllGather> c) { custom_gather_ = std::move(c); }
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> c) {
    custom_reduce_ = std::move(c);
  }
  // FSDP2's set_keep_unsharded_storage: the full block outlives a reshard, reused by every gather.
  void set_keep_unsharded_storage(bool keep);
  bool unshard_in_backward() const { return unshard_in_backward_; }
  // HSDP: whether a synced backward all-reduces across replicas (FSDP2's set_requires_all_reduce).
  void set_requires_all_reduce(bool v) { requires_all_reduce_ = v; }
  // What the reduction issued now will do under HSDP: all-reduce across replicas, or keep the
  // reduced block aside (recorded by the agreement check: every rank must decide alike).
  bool all_reduces() const;
  // HSDP: reduced blocks are set aside, waiting for the next all-reduce (not yet in the shards).
  bool holds_partial_reduce() const { return partial_reduce_.defined(); }
  const std::vector<Group*>& forward_prefetch() const { return forward_prefetch_; }
  const std::vector<Group*>& backward_prefetch() const { return backward_prefetch_; }
  bool forward_prefetch_set() const { return forward_prefetch_set_; }
  bool backward_prefetch_set() const { return backward_prefetch_set_; }
  void set_forward_prefetch(std::vector<Group*> g);
  void set_backward_prefetch(std::vector<Group*> g);

 private:
  void transition(TrainingState to, std::initializer_list<TrainingState> allowed);
  void start_replicate(PendingReduce& p);  // waits the reduce-scatter, issues the all-reduce
  void keep_partial(PendingReduce& p);     // requires_all_reduce off: sets the block aside
  void broadcast_buffers_to_all();         // ShardOptions::broadcast_buffers, on the root
  void end_backward_span();
  // A "copy" span named `what` + this group's name while tracing; nothing (no name built) when off.
  std::optional<trace::Span> copy_span(const char* what) const;
  // One rank, no replicas: the reduction of a gradient is the gradient itself.
  bool reduces_locally() const;
  // One rank and the shards' dtype on the wire: the full parameters borrow the shards' bytes.
  bool gathers_locally() const;
  // Every shard still lives in flat_shard_: the all-gather sends it without a copy.
  bool sends_in_place() const;
  void keep_chunk();        // post_forward (hpZ): this rank's 1/k of the full block, from it
  at::Tensor take_chunk();  // the chunk, no longer counted as held here
  void drop_chunk();        // returns the chunk's buffer to the pool
  void release_full();      // reshard() without dropping the chunk
  // The full block for this group's own gather: the kept one (set_keep_unsharded_storage), else
  // a pooled one; and its return when the group reshards.
  at::Tensor take_full_block();
  void give_back_full_block();
  // The communicator's all-gather, or set_custom_all_gather's.
  Work all_gather(Communicator& lane, const at::Tensor& recv, const at::Tensor& send);
  // Issues the all-gather of `g.send` into `block` (gathered into places) or `g.recv`; `own`:
  // the group's own gather (its full block), else one served for other ranks.
  void issue_gather(Communicator& lane, BufferPool& pool, PendingGather& g, at::Tensor& block,
                    bool own);
  void pack_send(PendingGather& g, bool own_gather);  // the all-gather's send block
  void gather_for_call();                             // pre_forward's gathers (CallAgreement)
  void rebase_modified_inputs();          // post_forward: [Note: inputs modified in place]
  void reshard_after_forward();           // post_forward, as configured (hpZ keeps a chunk)
  void release_gather(PendingGather& g);  // returns its pooled buffers

  torch::nn::Module* module_;
  std::vector<torch::nn::Module*> members_;
  std::shared_ptr<torch::nn::Module> container_;              // a module list's
  std::vector<std::pair<size_t, std::string>> member_names_;  // per parameter: member, name
  std::string type_name_;
  std::string name_;
  std::string prefix_;
  std::vector<ParamState> params_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Context> context_;
  ShardOptions options_;
  int64_t flat_numel_ = 0;
  std::vector<int64_t> offsets_;  // per parameter, into the flat block
  // Every parameter is sharded on dim 0 and gathered in its own dtype: each rank's rows are
  // contiguous bytes of the full parameter, where the all-gather can put them.
  bool gathers_into_places_ = true;
  // This rank's rows of every parameter at offsets_ (zero padding), the shards being tensors over
  // it: the all-gather's send block as it is. Undefined when the wire dtype differs from the
  // shards' (mixed precision's param_dtype), where unshard packs a cast copy.
  at::Tensor flat_shard_;
  // The full parameters' storage while gathered: one pooled block (BufferPool), each parameter at
  // its byte offset (64-byte aligned), so that gathering and resharding reuse the same memory
  // across groups of equal size and across iterations instead of going through malloc.
  at::Tensor full_block_;
  at::Tensor kept_block_;  // set_keep_unsharded_storage: the full block while resharded
  bool keep_storage_ = false;
  int64_t full_block_numel_ = 0;
  std::vector<size_t> full_offsets_;
  at::ScalarType gather_dtype_ = at::kFloat, reduce_dtype_ = at::kFloat;
  at::Device device_ = at::kCPU;  // the full parameters' (check_placement: one per group)
  // Gradients handed over before the reduction is issued (hand_over_grad): the send buffer they
  // were packed into, and which parameters it holds.
  at::Tensor handed_send_;
  std::vector<bool> handed_;

  ShardState shard_state_ = ShardState::kSharded;
  TrainingState training_state_ = TrainingState::kIdle;
  TrainingState state_before_forward_ = TrainingState::kIdle;
  PendingGather gather_;
  // hpZ: the post-forward lane, and this rank's chunk: (world / k) rows of S elements, the rows of
  // ranks [p * world / k, (p + 1) * world / k) of the gathered (world, S) layout, p this rank's
  // place in the lane.
  std::shared_ptr<Communicator> post_forward_lane_;
  at::Tensor chunk_;
  bool gather_from_chunk_ = false;
  uint64_t gathered_epoch_ = 0;  // Context::epoch() when gathered or last found current
  bool fingerprinted_ = false;   // fingerprint_if_gathered ran since the gather

  bool on_use_ = false;
  bool contains_groups_ = false;
  bool reshard_after_backward_ = true;
  bool requires_gradient_sync_ = true;
  bool requires_all_reduce_ = true;
  bool unshard_in_backward_ = true;
  bool reduce_scatter_unused_params_ = false;
  bool wrote_shard_grads_ = false;
  std::optional<double> divide_factor_;
  std::function<void(at::Tensor&)> hook_;  // set_all_reduce_hook
  std::shared_ptr<AllGather> custom_gather_;
  std::shared_ptr<ReduceScatter> custom_reduce_;
  // HSDP with requires_all_reduce off: the reduce-scattered blocks summed since the last
  // all-reduce (S elements in the reduction's dtype), added in before the next one.
  at::Tensor partial_reduce_;
  std::vector<Group*> forward_prefetch_, backward_prefetch_;
  bool forward_prefetch_set_ = false, backward_prefetch_set_ = false;

  // The current forward call's tensor inputs handed over through an input-side node: the caller's
  // tensor, the one forward received, and the node (rebase_modified_inputs).
  struct CallInput {
    at::Tensor outer, inner;
    const torch::autograd::Node* node;
  };
  std::vector<CallInput> call_inputs_;

  // Per iteration (cleared by begin_iteration).
  std::vector<compat::WeakNodePtr> input_nodes_, output_nodes_;
  bool forwarded_with_grad_ = false;
  int64_t forward_start_us_ = -1, backward_start_us_ = -1;  // open timeline spans

  // Last: destroyed first, while this group's context is still held.
  std::vector<std::shared_ptr<Group>> owned_elements_;
};

}  // namespace fsdp::detail
