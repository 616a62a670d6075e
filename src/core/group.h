// Group (FSDP2's FSDPParamGroup): the parameters of one fully_shard call, their storage, layout and
// collectives. Passive: its root (core/root.h) decides when it gathers, reshards and reduces, and
// it carries that out, keeping its own state (ShardState, TrainingState) with checked transitions.
// It refers to no root and registers no hooks; what its groups share (lanes, buffer pool) comes
// down as a CommContext from the root that owns it. Methods appear in the order they run: unshard,
// wait_for_unshard, reshard; the forward's inputs and outputs; the backward; the reduction.
//
// Ownership points down: a root owns its groups; a group owns its parameters' states.
// Thread-safety: the root's training thread (hooks reach it through the root's mutex).
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

#include "core/comm_context.h"
#include "core/layout.h"
#include "core/param.h"

namespace torch::nn {
class Module;
}

namespace fsdp::detail {

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

// An all-gather in flight: the send block (the flat shard itself when the shards live there, else a
// pooled copy) and the (world, S) receive buffer (undefined when gathered into places).
struct PendingGather {
  Work work;
  at::Tensor send, recv;
  bool send_pooled = false;
  bool wire = false;  // recv holds every rank's wire (GatherTransforms), not its rows
};

// A reduce-scatter in flight: waited and written to the shards' grads at the latest safe point.
// Under HSDP it has a second stage: the reduced block averaged across replicas (all-reduce). On
// one rank without replicas nothing is exchanged: the reduction is empty (output undefined).
struct PendingReduce {
  Work work;
  Work replicate_work;       // HSDP's all-reduce, once the reduce-scatter is done
  bool replicating = false;  // the reduce-scatter is done and the all-reduce issued
  at::Tensor output;         // this rank's reduced flat block (S elements); undefined: empty
  at::Tensor send;           // (world, S), returned to the pool once waited
  // Decided when issued (the settings may change before it is waited).
  bool all_reduce = false;
  std::optional<double> divide_by;
};

class Group {
 public:
  // `transforms`: per parameter, its GatherTransform or null.
  Group(torch::nn::Module* module, std::string type_name, std::vector<ParamState> params,
        std::shared_ptr<Communicator> comm, ShardOptions options,
        std::vector<std::shared_ptr<GatherTransform>> transforms);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  // ---- identity ----
  const std::string& name() const { return name_; }      // path under the root ("root" for it)
  const std::string& prefix() const { return prefix_; }  // "h.0.": prepended to param names
  void set_path(const std::string& path);                // when a parent absorbs this group
  const std::string& type_name() const { return type_name_; }
  torch::nn::Module* module() const { return module_; }
  // A module list (fully_shard of several modules, FSDP2's fully_shard([a, b])): module() is a
  // container holding the members as "0", "1", ..., owned by the group; its parameters are named
  // by it until a parent absorbs the group (set_member_paths).
  void set_members(std::shared_ptr<torch::nn::Module> container,
                   std::vector<torch::nn::Module*> members);
  bool is_list() const { return container_ != nullptr; }
  const std::vector<torch::nn::Module*>& members() const {
    return members_;
  }                                                                      // whose calls reach it
  bool inside(const std::set<const torch::nn::Module*>& modules) const;  // a member is in them
  void set_member_paths(const std::vector<std::string>& paths);
  const std::vector<ParamState>& params() const { return params_; }
  std::vector<ParamState>& params() { return params_; }
  // ShardOptions::ignored_params: left whole and unmanaged; held so that their identity stays.
  const std::vector<at::Tensor>& ignored() const { return options_.ignored_params; }
  // Its modules hold parameters that get gradients and that it does not manage: ignored here or
  // by another group ([Note: resharding during backward]).
  bool holds_trainable_unmanaged() const;
  // Throws when a full parameter was written in place while gathered ([Note: writes to gathered
  // parameters]).
  void check_full_unwritten() const;
  Communicator& comm() const { return *comm_; }
  const ShardOptions& options() const { return options_; }
  const GroupLayout& layout() const { return layout_; }
  bool has_trainable() const;
  int64_t flat_numel() const { return layout_.flat_numel; }  // S: padded shard elements per rank
  int64_t full_bytes() const;                                // of the gathered parameters
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }

  // ---- its place in a root (the root that owns it sets these) ----
  void place(CommContext* ctx, int index, bool is_root, bool contains_groups);
  int index() const { return index_; }  // registration index: the same on every rank
  bool is_root() const { return is_root_; }
  // Its module contains other sharded modules (the root, a sharded parent): see post_backward.
  bool contains_groups() const { return contains_groups_; }
  // An element of a container (fully_shard_elements): no holder calls it; gathered when the
  // root's forward begins, kept until its backward ends ([Note: elements gathered on use]).
  bool gathers_on_use() const { return on_use_; }
  void set_gathers_on_use() { on_use_ = true; }

  // ---- deferred initialisation ----
  bool materialized() const;
  void materialize_param(size_t index, const at::Tensor& full);
  void check_materialized() const;  // throws, naming fsdp::materialize

  // ---- storage, in run order ----
  // Issues this group's all-gather (from hpZ's chunks where the ranks agreed to) unless it is
  // gathered or in flight; `epoch` is the root's ([Note: stale gathered parameters]).
  void unshard(uint64_t epoch);
  void wait_for_unshard();  // unshard() if needed, then the gather's copy-out
  // [Note: calls that differ between ranks] Another rank needs this group gathered: a resharded
  // group is gathered and dropped; one held here sends its part through a gather of its own.
  void serve_gather();
  // Frees the full parameters' storage (and a post-forward chunk); a gather in flight is waited
  // and discarded.
  void reshard();
  // After a forward call, as configured: hpZ keeps this rank's chunk when `grad_mode` (a backward
  // will gather from it).
  void reshard_after_forward(bool grad_mode);
  ShardState shard_state() const { return shard_state_; }
  // [Note: resharding to a smaller world after forward]
  void set_post_forward_lane(std::shared_ptr<Communicator> lane) {
    post_forward_lane_ = std::move(lane);
  }
  bool holds_chunk() const { return chunk_.defined(); }
  void set_gather_from_chunk(bool v) { gather_from_chunk_ = v; }
  // [Note: stale gathered parameters]
  bool held_from_earlier_epoch(uint64_t epoch) const;  // gathered (or a chunk) before `epoch`
  bool changed_since_gather() const;  // this rank's shard changed since the gather, or unknown
  void mark_current(uint64_t epoch);  // found not stale in this epoch
  void fingerprint_if_gathered();     // its epoch ends still gathered: remember the shards
  // FSDP2's set_keep_unsharded_storage: the full block outlives a reshard, reused by every gather.
  void set_keep_unsharded_storage(bool keep);

  // ---- a forward call ----
  void begin_iteration();  // the first forward after a backward: forget the last one's records
  // Enters and leaves a forward call (the state transitions, checked); a call inside a backward
  // (a recomputation) keeps the state it found.
  void enter_forward();
  void leave_forward();
  void abort_forward() noexcept;  // the forward threw: back to the state it found
  bool in_forward() const { return training_state_ == TrainingState::kForward; }
  // The call was made under grad mode (a backward may follow).
  void note_call(bool grad_mode) { forwarded_with_grad_ = forwarded_with_grad_ || grad_mode; }
  bool forwarded_with_grad() const { return forwarded_with_grad_; }
  // Mixed precision's cast of a floating-point input (cast_forward_inputs) and of a result
  // tensor (output_dtype); identity when unset.
  at::Tensor cast_input(const at::Tensor& x) const;
  at::Tensor cast_output(const at::Tensor& y) const;
  // [Note: inputs modified in place] The input `x` handed to forward through the input-side node
  // `node` (made by the root's hooks, core/hooks.h): a tensor that is not a view and shares x's
  // storage and version counter. Returns what forward receives.
  at::Tensor hand_to_forward(const at::Tensor& x, const compat::NodePtr& node);
  // A view input goes through a custom Function instead: its node is only recorded.
  void record_input_node(const compat::NodePtr& node) { input_nodes_.push_back(node); }
  void record_output_node(const compat::NodePtr& node) { output_nodes_.push_back(node); }
  // Once forward returns: a caller's tensor that forward modified in place takes its history.
  void rebase_modified_inputs();
  // Autograd nodes recorded by this iteration's forward calls (weak: the graph owns them).
  const std::vector<compat::WeakNodePtr>& input_nodes() const { return input_nodes_; }
  const std::vector<compat::WeakNodePtr>& output_nodes() const { return output_nodes_; }

  // ---- backward (the root's Backward calls these) ----
  void begin_backward_use();  // the gathered parameters are needed now (-> kPreBackward)
  // This backward is done with the group (-> kPostBackward); reshards unless its parameters may
  // still be read ([Note: resharding during backward]).
  void post_backward();
  void finalize_backward();  // the backward's end (-> kIdle): keeps what was not reduced, reshards
  TrainingState training_state() const { return training_state_; }

  // ---- reduction ----
  // Hands parameter i's gradient, final for this backward, to the group's coming reduction: packed
  // into its send buffer (taken from the pool at the first) and dropped from the parameter. On one
  // rank (no replicas) it goes to the shard's gradient instead: there is no exchange.
  void hand_over_grad(size_t param_index);
  // Parameter i's gradient, final for a backward that does not reduce this group: kept for a later
  // reduction ([Note: accumulating without gradient sync]).
  void keep_unsynced_grad(size_t param_index) {
    params_[param_index].keep_unsynced_grad(reduce_dtype_);
  }
  void begin_unsynced_backward() {
    for (auto& p : params_) p.begin_unsynced_backward(reduce_dtype_);
  }
  bool has_handed_over() const { return handed_send_.defined(); }
  // Packs the gradients not handed over (zeros when missing) and issues the reduce-scatter.
  PendingReduce issue_reduce_scatter();
  // Never blocks: true when finish_reduce would not wait. Under HSDP a finished reduce-scatter's
  // all-reduce across replicas is issued here (in reduction order: every rank issues them alike).
  bool poll_reduce(PendingReduce& p);
  void finish_reduce(PendingReduce& p);  // waits and accumulates into the shards' gradients
  void drop_handed_over();  // a backward that failed before this reduction: drop what was handed
  // [Note: parameters that got no gradient] Something of this group's could be reduced even if
  // no gradient arrives in this backward: a parameter holds an unsharded or accumulated gradient,
  // HSDP set a reduced block aside, or set_reduce_scatter_unused_params is on.
  bool holds_gradients() const;
  bool wrote_shard_grads() const { return wrote_shard_grads_; }
  // Once every rank's contributions are known (`any_rank`, per parameter): the shards' gradients
  // of parameters no rank contributed to go back to what they were.
  void settle_shard_grads(const std::vector<bool>& any_rank);
  // What the reduction issued now does under HSDP: all-reduce across replicas, or keep the reduced
  // block aside (every rank must decide alike: the Agreed log records it).
  bool all_reduces() const;
  bool holds_partial_reduce() const { return partial_reduce_.defined(); }
  bool reduces_locally() const;  // one rank, no replicas, no hook: nothing exchanged

  // ---- settings (FSDPModule's, each documented in fsdp/fully_shard.h) ----
  bool resolved_reshard_after_forward() const;
  void set_reshard_after_forward(bool v);
  void set_reshard_after_backward(bool v) { reshard_after_backward_ = v; }
  bool reshard_after_backward() const { return reshard_after_backward_; }
  bool requires_gradient_sync() const { return requires_gradient_sync_; }
  void set_requires_gradient_sync(bool v) { requires_gradient_sync_ = v; }
  void set_gradient_divide_factor(double factor);  // throws unless positive and finite
  const std::optional<double>& gradient_divide_factor() const { return divide_factor_; }
  void set_unshard_in_backward(bool v);
  bool unshard_in_backward() const { return unshard_in_backward_; }
  void set_all_reduce_hook(std::function<void(at::Tensor&)> hook) { hook_ = std::move(hook); }
  bool has_all_reduce_hook() const { return static_cast<bool>(hook_); }
  void set_custom_all_gather(std::shared_ptr<AllGather> c) { custom_gather_ = std::move(c); }
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> c) {
    custom_reduce_ = std::move(c);
  }
  void set_requires_all_reduce(bool v) { requires_all_reduce_ = v; }
  void set_reduce_scatter_unused_params(bool v) { reduce_scatter_unused_params_ = v; }
  bool reduce_scatter_unused_params() const { return reduce_scatter_unused_params_; }
  // [Note: calls that differ between ranks] Inside this module's forward the ranks may call
  // different sharded modules (RuntimeOptions::calls_may_differ, set_calls_may_differ).
  void set_calls_may_differ(bool v) { calls_may_differ_ = v; }
  bool calls_may_differ() const { return calls_may_differ_; }
  const std::vector<Group*>& forward_prefetch() const { return forward_prefetch_; }
  const std::vector<Group*>& backward_prefetch() const { return backward_prefetch_; }
  bool forward_prefetch_set() const { return forward_prefetch_set_; }
  bool backward_prefetch_set() const { return backward_prefetch_set_; }
  void set_forward_prefetch(std::vector<Group*> g);
  void set_backward_prefetch(std::vector<Group*> g);
  // Another group is going away: drop it from the prefetch overrides.
  void forget(const Group* g);

 private:
  void transition(TrainingState to, std::initializer_list<TrainingState> allowed);
  void start_replicate(PendingReduce& p);  // waits the reduce-scatter, issues the all-reduce
  void keep_partial(PendingReduce& p);     // requires_all_reduce off: sets the block aside
  void end_backward_span();
  // A "copy" span named `what` + this group's name while tracing; nothing when off.
  std::optional<trace::Span> copy_span(const char* what) const;
  bool gathers_locally() const;  // one rank, the shards' dtype: the parameters borrow the shards
  bool sends_in_place() const;   // every shard still lives in flat_shard_: sent without a copy
  void gathered(uint64_t epoch, const char* how);  // the state and accounting of an issued gather
  // The all-gather of the flat (or wire) send into a (world, S) buffer, or into places.
  void issue_gather(Lane& lane, PendingGather& g, at::Tensor& block, bool own);
  void pack_send(PendingGather& g, bool own_gather);  // the all-gather's send side
  void keep_chunk();        // hpZ: this rank's rows of the post-forward lane, from the full block
  at::Tensor take_chunk();  // the chunk, no longer counted as held
  void drop_chunk();
  void release_full();  // reshard() without dropping the chunk
  // The full block for this group's own gather (the kept one, else pooled), and its return.
  at::Tensor take_full_block();
  void give_back_full_block();
  void release_gather(PendingGather& g);  // returns its pooled buffers
  at::Tensor acquire_send();              // a reduce-scatter's (world, S) send buffer
  void log(const std::string& event) const;

  torch::nn::Module* module_;
  std::vector<torch::nn::Module*> members_;
  std::shared_ptr<torch::nn::Module> container_;              // a module list's
  std::vector<std::pair<size_t, std::string>> member_names_;  // per parameter: member, name
  std::string type_name_, name_, prefix_;
  std::vector<ParamState> params_;
  std::vector<at::Tensor> unmanaged_;  // parameters of its modules not in params_; set by place()
  std::shared_ptr<Communicator> comm_;
  ShardOptions options_;
  GroupLayout layout_;
  at::ScalarType reduce_dtype_ = at::kFloat;
  CommContext* ctx_ = nullptr;  // the root's; set by place()
  int index_ = -1;
  bool is_root_ = false, contains_groups_ = false, on_use_ = false;

  // Storage. flat_shard_: this rank's rows of every parameter at their offsets (zero padding), the
  // shards being tensors over it: the all-gather's send block as it is; undefined when the wire
  // dtype differs from the shards'. full_block_: the full parameters' storage while gathered, one
  // pooled block; kept_block_: set_keep_unsharded_storage's, while resharded.
  at::Tensor flat_shard_, full_block_, kept_block_;
  bool keep_storage_ = false;
  ShardState shard_state_ = ShardState::kSharded;
  TrainingState training_state_ = TrainingState::kIdle;
  TrainingState state_before_forward_ = TrainingState::kIdle;
  PendingGather gather_;
  // hpZ: the post-forward lane and this rank's chunk, the rows of its lane's ranks of the
  // gathered (world, S) layout.
  std::shared_ptr<Communicator> post_forward_lane_;
  at::Tensor chunk_;
  bool gather_from_chunk_ = false;
  uint64_t gathered_epoch_ = 0;  // the root's epoch when gathered or last found current
  bool fingerprinted_ = false;   // fingerprint_if_gathered ran since the gather

  // Reduction: gradients handed over before the reduction is issued, and which; HSDP without the
  // all-reduce: the reduced blocks summed since the last all-reduce.
  at::Tensor handed_send_;
  std::vector<bool> handed_;
  at::Tensor partial_reduce_;
  bool wrote_shard_grads_ = false;

  // Settings.
  bool reshard_after_backward_ = true;
  bool requires_gradient_sync_ = true;
  bool requires_all_reduce_ = true;
  bool unshard_in_backward_ = true;
  bool reduce_scatter_unused_params_ = false;
  bool calls_may_differ_ = false;
  std::optional<double> divide_factor_;
  std::function<void(at::Tensor&)> hook_;
  std::shared_ptr<AllGather> custom_gather_;
  std::shared_ptr<ReduceScatter> custom_reduce_;
  std::vector<Group*> forward_prefetch_, backward_prefetch_;
  bool forward_prefetch_set_ = false, backward_prefetch_set_ = false;

  // The current forward call's tensor inputs handed over through an input-side node.
  struct CallInput {
    at::Tensor outer, inner;
    const torch::autograd::Node* node;
  };
  std::vector<CallInput> call_inputs_;
  // Per iteration (cleared by begin_iteration).
  std::vector<compat::WeakNodePtr> input_nodes_, output_nodes_;
  bool forwarded_with_grad_ = false;
  int64_t forward_start_us_ = -1, backward_start_us_ = -1;  // open timeline spans
};

}  // namespace fsdp::detail
