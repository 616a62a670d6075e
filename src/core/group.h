// Group (FSDP2's FSDPParamGroup) and Context (the root's shared state).
//
// A Group owns the parameters of one fully_shard call: one all-gather and at most one
// reduce-scatter per pass, over flat buffers. A Context is shared by every group under one root:
// the communication lanes, the forward order, and the per-backward bookkeeping that implements the
// post-backward guarantee ([Note: the post-backward guarantee] in docs/design.md).
//
// Ownership points down: handles and Sharded holders own Groups; Groups share their Context; the
// Context refers back to its groups by raw pointer (each group unregisters itself on destruction).
// Thread-safety: hooks run on the thread that called backward (CPU engine); the Context serialises
// its bookkeeping with a mutex anyway.
#pragma once

#include <fsdp/communicator.h>
#include <fsdp/options.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/audit.h"
#include "core/param.h"

namespace torch::nn {
class Module;
}

namespace fsdp::detail {

class Context;

enum class ShardState {
  kSharded,    // only the shards hold data; full parameters have no storage
  kGathering,  // all-gather issued, not yet copied out
  kUnsharded,  // full parameters allocated and filled
};
const char* to_string(ShardState s);

// A reduce-scatter in flight: waited and written to the shards' grads at the latest safe point.
struct PendingReduce {
  Group* group = nullptr;
  Work work;
  at::Tensor output;         // this rank's reduced flat block (S elements)
  at::Tensor send, scratch;  // (world, S) each, returned to the pool once waited
};

// Reuses the flat communication buffers across groups and iterations, as a caching allocator
// would: sharded blocks have equal sizes, and buffers freed per collective otherwise stay resident
// under glibc's default malloc policy (and page-fault again when touched). Keeps at most
// kPerSize idle buffers of each (elements, dtype).
class BufferPool {
 public:
  at::Tensor acquire(int64_t numel, at::ScalarType dtype);
  void release(at::Tensor t);  // REQUIRES: no collective still uses t

 private:
  static constexpr size_t kPerSize = 2;
  std::map<std::pair<int64_t, int>, std::vector<at::Tensor>> idle_;
};

class Group : public std::enable_shared_from_this<Group> {
 public:
  Group(torch::nn::Module* module, std::string type_name, std::vector<ParamState> params,
        std::shared_ptr<Communicator> comm, ShardOptions options);
  ~Group();

  // ---- identity ----
  const std::string& name() const { return name_; }  // path under the root ("<root>" for it)
  void set_name(std::string n) { name_ = std::move(n); }
  const std::string& prefix() const { return prefix_; }  // "h.0." : prepended to param names
  void set_prefix(std::string p) { prefix_ = std::move(p); }
  const std::string& type_name() const { return type_name_; }
  torch::nn::Module* module() const { return module_; }
  std::vector<ParamState>& params() { return params_; }
  const std::vector<ParamState>& params() const { return params_; }
  Context& context() const { return *context_; }
  const std::shared_ptr<Context>& shared_context() const { return context_; }
  void set_context(std::shared_ptr<Context> c) { context_ = std::move(c); }
  Communicator& comm() const { return *comm_; }
  const std::shared_ptr<Communicator>& shared_comm() const { return comm_; }
  const ShardOptions& options() const { return options_; }
  bool is_root() const;
  bool has_trainable() const;
  int64_t flat_numel() const { return flat_numel_; }  // S: padded shard elements per rank

  // ---- storage (FSDP2 order: unshard, wait_for_unshard, reshard) ----
  void unshard();           // issues the all-gather unless unsharded or in flight
  void wait_for_unshard();  // waits and copies out into the full parameters
  void reshard();           // frees the full parameters' storage
  ShardState shard_state() const { return state_; }
  int64_t full_bytes() const;

  // ---- forward ----
  void pre_forward();
  void post_forward(const std::vector<at::Tensor>& outs);
  at::Tensor wrap_input(const at::Tensor& x);

  // ---- backward: each hook is a one-line adapter onto one of these ----
  void pre_backward();                     // tensor hook on an output of this group's forward
  void on_grad_ready(size_t param_index);  // AccumulateGrad post hook of a parameter
  void on_input_backward();                // the input-side function of one forward call

  // ---- reduction ----
  PendingReduce issue_reduce_scatter();  // packs unsharded grads (zeros when missing)
  void finish_reduce(PendingReduce& p);  // waits and accumulates into the shards' grads

  // ---- settings ----
  bool resolved_reshard_after_forward() const;
  void set_reshard_after_forward(bool v) { options_.reshard_after_forward = v; }
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  std::vector<Group*> forward_prefetch;  // explicit overrides (set_modules_to_*_prefetch)
  std::vector<Group*> backward_prefetch;
  bool backward_prefetch_set = false, forward_prefetch_set = false;

  // Input-side autograd nodes of forward calls since the last backward (weak: the graph owns them).
  std::vector<std::weak_ptr<torch::autograd::Node>> input_nodes;
  bool forwarded_since_backward = false;
  int64_t forward_start_us = -1, backward_start_us = -1;  // open timeline spans

 private:
  torch::nn::Module* module_;
  std::string type_name_;
  std::string name_;
  std::string prefix_;
  std::vector<ParamState> params_;
  std::shared_ptr<Communicator> comm_;
  std::shared_ptr<Context> context_;
  ShardOptions options_;
  ShardState state_ = ShardState::kSharded;
  int64_t flat_numel_ = 0;
  std::vector<int64_t> offsets_;  // per parameter, into the flat block
  Work gather_work_;
  at::Tensor gather_in_, gather_out_;
};

// Per-backward bookkeeping (one GraphTask).
struct TaskState {
  bool reducing = false;      // a plain backward() (AccumulateGrad runs, gradients synced)
  std::vector<Group*> order;  // the fixed issue order of this backward
  std::map<Group*, int> pending_grads;          // expected AccumulateGrad post hooks not yet seen
  std::map<Group*, int> pending_inputs;         // expected input-side nodes not yet run
  std::map<Group*, std::vector<char>> arrived;  // per parameter
  std::map<Group*, int> issued;                 // reductions issued per group
  size_t cursor = 0;                            // next position in `order` to issue
  std::vector<PendingReduce> in_flight;
  std::vector<std::pair<int, int64_t>> issue_log;  // (group index, numel) in issue order
};

class Context {
 public:
  Context(std::shared_ptr<Communicator> comm, bool audit);

  // Registration order: children first, the root last. The root is the last group added.
  std::vector<Group*> groups;
  Group* root() const { return groups.empty() ? nullptr : groups.back(); }
  int index_of(const Group* g) const;
  void remove(Group* g);

  Communicator& gather_lane() const { return *gather_lane_; }
  Communicator& reduce_lane() const { return *reduce_lane_; }

  // ---- forward ----
  void on_pre_forward(Group* g);
  // Issues the all-gather of the group expected to run next (forward: the order recorded in the
  // previous iteration; backward: reverse forward order), or of the explicit override list.
  // Decisions depend only on the model's call order and settings, never on timing, so every rank
  // issues the same all-gathers in the same order.
  void prefetch_forward(Group* g);
  void prefetch_backward(Group* g);

  // ---- backward ----
  void on_pre_backward(Group* g);
  void on_grad_ready(Group* g, size_t param_index);
  void on_input_backward(Group* g);

  // ---- memory accounting of gathered parameters, from all-gather issue to reshard ----
  // Bytes count every group; groups count all but the root, which by default stays gathered
  // from forward to the end of backward (the quantity max_unsharded_groups bounds).
  void on_unsharded(const Group* g);
  void on_resharded(const Group* g);
  int64_t unsharded_bytes() const { return unsharded_bytes_; }
  int64_t peak_unsharded_bytes() const { return peak_unsharded_bytes_; }
  int unsharded_groups() const { return unsharded_groups_; }
  int peak_unsharded_groups() const { return peak_unsharded_groups_; }
  void reset_peaks();

  BufferPool& pool() { return pool_; }
  bool debug() const { return debug_; }
  void log(const Group* g, const std::string& event) const;
  Audit& audit() { return audit_; }

 private:
  TaskState* current_task();
  TaskState& begin_task(const void* key);
  void try_issue(TaskState& t);
  void issue(TaskState& t, Group* g);
  void maybe_reshard_after_backward(TaskState& t, Group* g);
  void end_backward_span(Group* g);
  void finalize(const void* key);

  std::shared_ptr<Communicator> comm_, gather_lane_, reduce_lane_;
  std::recursive_mutex mu_;
  std::map<const void*, TaskState> tasks_;
  std::vector<Group*> forward_order_;       // groups in first pre-forward order, this iteration
  std::vector<Group*> last_forward_order_;  // the previous iteration's
  bool backward_done_ = true;               // a forward after this starts a new iteration
  int64_t unsharded_bytes_ = 0, peak_unsharded_bytes_ = 0;
  int unsharded_groups_ = 0, peak_unsharded_groups_ = 0;
  bool debug_ = false;
  Audit audit_;
  BufferPool pool_;
};

}  // namespace fsdp::detail
