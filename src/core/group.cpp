#include "core/group.h"

#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>

#include <iostream>

#include "comm/communicator_impl.h"
#include "core/backward_pass.h"
#include "core/buffers.h"
#include "core/context.h"
#include "core/guard.h"

namespace fsdp::detail {

const char* to_string(ShardState s) {
  switch (s) {
    case ShardState::kSharded:
      return "SHARDED";
    case ShardState::kGathering:
      return "GATHERING";
    case ShardState::kUnsharded:
      return "UNSHARDED";
  }
  return "?";
}

const char* to_string(TrainingState s) {
  switch (s) {
    case TrainingState::kIdle:
      return "IDLE";
    case TrainingState::kForward:
      return "FORWARD";
    case TrainingState::kPreBackward:
      return "PRE_BACKWARD";
    case TrainingState::kPostBackward:
      return "POST_BACKWARD";
  }
  return "?";
}

namespace {

// AccumulateGrad post hook: the parameter's gradient for this backward is final.
struct GradReadyHook : torch::autograd::FunctionPostHook {
  GradReadyHook(std::weak_ptr<Group> g, size_t i) : group(std::move(g)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto g = group.lock()) g->on_grad_ready(index);
    return outputs;
  }
  std::weak_ptr<Group> group;
  size_t index;
};

// AccumulateGrad pre hook: a moved-gradient marker left by the previous reduction goes before
// autograd accumulates into the full parameter again (also for a second backward over a retained
// graph, with no forward in between).
struct ClearMarkerHook : torch::autograd::FunctionPreHook {
  ClearMarkerHook(std::weak_ptr<Group> g, size_t i) : group(std::move(g)), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    if (auto g = group.lock()) g->params()[index].clear_moved_grad();
    return grads;
  }
  std::weak_ptr<Group> group;
  size_t index;
};

// The input-side node of one forward call: identity in backward, run once everything between
// this call's outputs and this input has run. Marks the call's backward done (for resharding),
// never triggers reduction. The input it stands for is handed to the module as a new tensor that
// is not a view and shares the input's storage and version counter, so in-place modification of
// the input inside forward behaves exactly as without sharding.
struct InputBackward : torch::autograd::Node {
  explicit InputBackward(std::weak_ptr<Group> g) : group(std::move(g)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (auto g = group.lock()) g->on_input_backward();
    return std::move(grads);
  }
  std::string name() const override { return "fsdp::InputBackward"; }
  std::weak_ptr<Group> group;
};

// For inputs that are themselves views: the same signal through a custom Function (its output
// is a view of the input, so LibTorch rejects in-place modification of it inside forward rather
// than losing the view's history).
struct GroupRef : torch::CustomClassHolder {
  explicit GroupRef(std::weak_ptr<Group> g) : group(std::move(g)) {}
  std::weak_ptr<Group> group;
};
struct InputViewBackward : torch::autograd::Function<InputViewBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, c10::intrusive_ptr<GroupRef> g,
                            const at::Tensor& x) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(g));
    ctx->set_materialize_grads(false);
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* ref = static_cast<GroupRef*>(ctx->saved_data["group"].toCapsule().get());
    if (auto g = ref->group.lock()) g->on_input_backward();
    return {at::Tensor(), grads[0]};
  }
};

}  // namespace

Group::Group(torch::nn::Module* module, std::string type_name, std::vector<ParamState> params,
             std::shared_ptr<Communicator> comm, ShardOptions options)
    : module_(module),
      type_name_(std::move(type_name)),
      name_(type_name_),
      params_(std::move(params)),
      comm_(std::move(comm)),
      options_(options) {
  for (auto& p : params_) {
    offsets_.push_back(flat_numel_);
    flat_numel_ += p.padded_numel();
  }
  size_t bytes = 0;
  for (auto& p : params_) {
    bytes = (bytes + 63) / 64 * 64;
    full_offsets_.push_back(bytes);
    bytes += static_cast<size_t>(p.full_bytes());
  }
  const int64_t elem = params_.empty() ? 1 : params_[0].param().element_size();
  full_block_numel_ = static_cast<int64_t>((bytes + elem - 1) / elem);
  // One dtype per group (check_placement): the full parameters are already in param_dtype.
  if (!params_.empty()) {
    gather_dtype_ = params_[0].param().scalar_type();
    reduce_dtype_ = params_[0].shard().scalar_type();
  }
  bool same_dtype = !params_.empty();
  for (auto& p : params_) same_dtype = same_dtype && p.shard().scalar_type() == gather_dtype_;
  if (same_dtype) {
    flat_shard_ = at::zeros({flat_numel_}, at::TensorOptions().dtype(gather_dtype_));
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].place_shard_in(flat_shard_.narrow(0, offsets_[i], params_[i].padded_numel()));
  }
  const auto& mp = options_.mixed_precision;
  if (mp.reduce_dtype) {
    reduce_dtype_ = *mp.reduce_dtype;
  } else if (mp.param_dtype) {
    reduce_dtype_ = *mp.param_dtype;
  }
}

Group::~Group() {
  for (auto& p : params_) {
    if (p.accumulator() && p.hook_key()) p.accumulator()->del_post_hook(p.hook_key());
    guard::forget(p.param());
    if (p.moved_grad_marker().defined()) guard::forget_marker(p.moved_grad_marker());
  }
  if (context_) context_->remove(this);
}

void Group::attach_hooks() {
  std::weak_ptr<Group> self = weak_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    guard::watch(p.param(), self, i);
    p.free_full();
    if (!p.accumulator()) continue;
    p.set_moved_grad_marker(guard::moved_grad_marker(p.param(), self, i));
    p.accumulator()->add_pre_hook(std::make_unique<ClearMarkerHook>(self, i));
    p.set_hook_key(p.accumulator()->add_post_hook(std::make_unique<GradReadyHook>(self, i)));
  }
}

void Group::set_path(const std::string& path) {
  name_ = path.empty() ? "root" : path;
  prefix_ = path.empty() ? "" : path + ".";
}

bool Group::is_root() const { return context_ && context_->root() == this; }

bool Group::has_trainable() const {
  for (const auto& p : params_)
    if (p.trainable()) return true;
  return false;
}

int64_t Group::full_bytes() const {
  int64_t b = 0;
  for (const auto& p : params_) b += p.full_bytes();
  return b;
}

bool Group::resolved_reshard_after_forward() const {
  if (on_use_) return false;  // its forward's end is not observable (gathers_on_use)
  return options_.reshard_after_forward.value_or(!is_root());
}

void Group::set_reshard_after_forward(bool v) {
  FSDP_CHECK(!on_use_ || !v, "set_reshard_after_forward(true) on '", name_, "' (", type_name_,
             "): an element sharded by fully_shard_elements stays gathered from its first use in "
             "forward to the end of backward, because nothing marks the end of its forward. To "
             "reshard after forward, declare the block fsdp::Sharded<...> and call it through "
             "the holder");
  options_.reshard_after_forward = v;
}

void Group::set_forward_prefetch(std::vector<Group*> g) {
  forward_prefetch_ = std::move(g);
  forward_prefetch_set_ = true;
}

void Group::set_backward_prefetch(std::vector<Group*> g) {
  backward_prefetch_ = std::move(g);
  backward_prefetch_set_ = true;
}

void Group::transition(TrainingState to, std::initializer_list<TrainingState> allowed) {
  for (TrainingState a : allowed)
    if (a == training_state_) {
      training_state_ = to;
      return;
    }
  throw Error(detail::cat("sharded module '", name_, "' (", type_name_, ") cannot go from ",
                          to_string(training_state_), " to ", to_string(to),
                          ". A sharded module's forward must not call itself, and backward must "
                          "not run inside its forward"));
}

// ---------------------------------------------------------------------------------------------
// Storage
// ---------------------------------------------------------------------------------------------
void Group::materialize_param(size_t i, const at::Tensor& full) {
  FSDP_CHECK(shard_state_ == ShardState::kSharded, "materialize: sharded module '", name_,
             "' is gathered; materialize before the first forward");
  params_[i].materialize(full);
}

bool Group::materialized() const {
  for (const auto& p : params_)
    if (!p.materialized()) return false;
  return true;
}

void Group::check_materialized() const {
  FSDP_CHECK(materialized(), "sharded module '", name_, "' (", type_name_,
             ") was built under fsdp::deferred_init and has no values yet. Fix: call "
             "fsdp::materialize(model) after fully_shard and before the first forward (or "
             "unshard, state dict or checkpoint save)");
}

bool Group::gathers_locally() const {
  if (context_->gather_lane().size() != 1) return false;
  for (const auto& p : params_)
    if (p.shard().scalar_type() != p.param().scalar_type()) return false;  // param_dtype's cast
  return true;
}

bool Group::sends_in_place() const {
  if (!flat_shard_.defined()) return false;
  for (size_t i = 0; i < params_.size(); ++i)
    if (!params_[i].shard_is_at(flat_shard_.narrow(0, offsets_[i], params_[i].padded_numel())))
      return false;
  return true;
}

void Group::release_gather(PendingGather& g) {
  context_->pool().release(std::move(g.recv));
  if (g.send_pooled) context_->pool().release(std::move(g.send));
  g = PendingGather();
}

bool Group::reduces_locally() const {
  return context_->reduce_lane().size() == 1 && !context_->replicate_lane();
}

void Group::unshard() {
  if (shard_state_ != ShardState::kSharded) return;
  check_materialized();
  if (gathers_locally()) {
    // Nothing to exchange: wait_for_unshard lends the shards' bytes. Still GATHERING until then,
    // so that a prefetch is cancelled like any other.
    shard_state_ = ShardState::kGathering;
    gathered_epoch_ = context_->epoch();
    fingerprinted_ = false;
    context_->on_gather_issued(this);
    context_->log(this, "unshard: one rank, no all-gather (SHARDED->GATHERING)");
    return;
  }
  auto& lane = context_->gather_lane();
  auto& pool = context_->pool();
  const auto dtype = gather_dtype_;
  if (sends_in_place()) {
    gather_.send = flat_shard_;
    for (auto& p : params_) p.note_sent_in_place();
  } else {
    gather_.send = pool.acquire(flat_numel_, dtype);
    gather_.send_pooled = true;
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].copy_in_shard(gather_.send.narrow(0, offsets_[i], params_[i].padded_numel()));
  }
  try {
    issue_gather(lane, pool);
  } catch (...) {
    // Nothing was issued: the buffers taken for it go back to the pool; still SHARDED.
    if (full_block_.defined()) pool.release(std::exchange(full_block_, at::Tensor()));
    release_gather(gather_);
    throw;
  }
  shard_state_ = ShardState::kGathering;
  gathered_epoch_ = context_->epoch();
  fingerprinted_ = false;
  context_->on_gather_issued(this);  // the gather buffer is as large as the gathered parameters
  context_->log(this, "unshard: all-gather issued (SHARDED->GATHERING)");
}

// The pieces land in the full block where the lane can put them there (point to point on CPU):
// no gather buffer and no copy-out. Otherwise (a collective backend) into a flat (world, S)
// buffer that wait_for_unshard copies out.
void Group::issue_gather(Communicator& lane, BufferPool& pool) {
  std::vector<at::Tensor> pieces;
  pieces.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i)
    pieces.push_back(params_[i].rows_to_send(gather_.send, offsets_[i]));
  if (detail::gathers_into_places(lane, pieces)) {
    full_block_ = pool.acquire(full_block_numel_, gather_dtype_);
    std::vector<std::vector<at::Tensor>> places(lane.size());
    for (int r = 0; r < lane.size(); ++r)
      for (size_t i = 0; i < params_.size(); ++i)
        places[r].push_back(params_[i].place_of_rows(full_block_, full_offsets_[i], r));
    gather_.work = all_gather_into(lane, std::move(places), std::move(pieces));
    return;
  }
  gather_.recv = pool.acquire(lane.size() * flat_numel_, gather_dtype_);
  gather_.work = lane.all_gather(gather_.recv, gather_.send);
}

void Group::wait_for_unshard() {
  if (shard_state_ == ShardState::kSharded) unshard();
  if (shard_state_ != ShardState::kGathering) return;
  if (gathers_locally()) {
    for (auto& p : params_) p.borrow_shard();
    shard_state_ = ShardState::kUnsharded;
    context_->log(this,
                  "wait_for_unshard: the full parameters borrow the shards (GATHERING->UNSHARDED)");
    return;
  }
  gather_.work.wait();
  if (gather_.recv.defined()) {
    auto rows = gather_.recv.view({context_->gather_lane().size(), flat_numel_});
    full_block_ = context_->pool().acquire(full_block_numel_, gather_dtype_);
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].copy_out(rows, offsets_[i], full_block_, full_offsets_[i]);
  } else {
    for (size_t i = 0; i < params_.size(); ++i) params_[i].bind_full(full_block_, full_offsets_[i]);
  }
  release_gather(gather_);
  shard_state_ = ShardState::kUnsharded;
  context_->log(this, "wait_for_unshard: GATHERING->UNSHARDED");
}

void Group::reshard() {
  if (shard_state_ == ShardState::kGathering) {
    // Cancel: the collective has every rank's part in flight, so it is waited, then dropped.
    PendingGather g = std::move(gather_);
    gather_ = PendingGather();
    shard_state_ = ShardState::kSharded;
    context_->on_resharded(this);
    g.work.wait();
    release_gather(g);
    context_->pool().release(std::move(full_block_));  // gathered into places: not bound yet
    full_block_ = at::Tensor();
    context_->log(this, "reshard: gather discarded (GATHERING->SHARDED)");
    return;
  }
  if (shard_state_ != ShardState::kUnsharded) return;
  for (auto& p : params_) p.free_full();
  // No parameter points into the block any more (free_full dropped their references). Borrowed
  // shards (gathers_locally) have no block.
  context_->pool().release(std::move(full_block_));
  full_block_ = at::Tensor();
  shard_state_ = ShardState::kSharded;
  context_->on_resharded(this);
  context_->log(this, "reshard: UNSHARDED->SHARDED");
}

void Group::fingerprint_if_gathered() {
  if (shard_state_ == ShardState::kSharded || fingerprinted_) return;
  for (auto& p : params_) p.take_fingerprint();
  fingerprinted_ = true;
}

bool Group::stale() {
  if (shard_state_ == ShardState::kSharded || gathered_epoch_ == context_->epoch()) return false;
  bool changed = false;
  for (const auto& p : params_) changed = changed || p.shard_changed_since_gather();
  // One rank's shard may keep its values where another's change (no rows here, a zero update):
  // the ranks decide together, since the decision is whether to all-gather again.
  if (context_->on_any_rank(changed)) return true;
  gathered_epoch_ = context_->epoch();
  return false;
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
void Group::begin_iteration() {
  input_nodes_.clear();
  output_nodes_.clear();
  forwarded_with_grad_ = false;
}

void Group::pre_forward() {
  call_inputs_.clear();
  if (!context_->in_forward()) context_->advance_epoch();  // a top-level call
  check_materialized();  // before any state changes: the module stays usable after the error
  state_before_forward_ = training_state_;
  transition(TrainingState::kForward,
             {TrainingState::kIdle, TrainingState::kPreBackward, TrainingState::kPostBackward});
  context_->on_pre_forward(this);
  if (is_root() && options_.broadcast_buffers && state_before_forward_ == TrainingState::kIdle)
    broadcast_buffers_to_all();
  // Gathered values older than the shards (an optimizer step since the gather, e.g. after an
  // evaluation forward that kept the root gathered) are dropped and gathered again. Every rank
  // steps the same shards, so every rank takes the same decision.
  if (stale()) reshard();
  if (is_root()) reshard_stale_elements();
  unshard();
  context_->prefetch_forward(this);
  wait_for_unshard();
  if (at::GradMode::is_enabled()) forwarded_with_grad_ = true;
  forward_start_us_ = trace::enabled() ? trace::now_us() : -1;
}

void Group::post_forward(const std::vector<at::Tensor>& outs) {
  rebase_modified_inputs();
  if (forward_start_us_ >= 0)
    trace::complete("forward " + name_, "compute", forward_start_us_,
                    trace::now_us() - forward_start_us_);
  std::weak_ptr<Group> self = weak_from_this();
  for (const auto& out : outs) {
    if (!out.defined() || !out.requires_grad() || !out.grad_fn()) continue;
    // The TensorBase form: the hook also fires with an undefined gradient (an output that gets
    // none while its node runs for another output).
    const torch::autograd::Node* node = out.grad_fn().get();  // owns the hook: outlives it
    static_cast<const at::TensorBase&>(out).register_hook(
        [self, node](const at::TensorBase&) -> at::TensorBase {
          if (auto g = self.lock()) g->pre_backward(node);
          return at::TensorBase();
        });
    output_nodes_.push_back(out.grad_fn());
  }
  context_->on_post_forward(this);
  transition(state_before_forward_, {TrainingState::kForward});
  if (resolved_reshard_after_forward() && state_before_forward_ == TrainingState::kIdle) reshard();
  // Elements gathered on use in a forward without grad mode have no backward to wait for.
  if (is_root() && !at::GradMode::is_enabled())
    for (Group* g : context_->groups())
      if (g->gathers_on_use() && g->training_state() == TrainingState::kIdle) g->reshard();
  // Every forward of the root ends by checking that the ranks gathered the same groups, before a
  // backward could reduce into the wrong ones (core/agreement.h).
  if (is_root() && state_before_forward_ == TrainingState::kIdle) context_->check_agreement();
  // A top-level call ends its epoch: user code (an optimizer step) may follow.
  if (state_before_forward_ == TrainingState::kIdle && !context_->in_forward())
    context_->end_epoch();
}

void Group::reshard_stale_elements() {
  // An element kept gathered (set_reshard_after_backward(false), or a forward without backward)
  // is not gathered again on use, so its values must not be older than its shards: drop them
  // when an optimizer stepped since. Every rank steps the same shards: the same decision.
  for (Group* g : context_->groups())
    if (g->gathers_on_use() && g->stale()) g->reshard();
}

bool Group::gather_on_use() {
  if (!on_use_ || !context_->in_forward()) return false;
  // Inside the root's forward: the forward all-gathers follow the order of first use, which is
  // the call order of the elements (the same on every rank: the documented requirement).
  context_->on_pre_forward(this);
  unshard();
  context_->prefetch_forward(this);
  wait_for_unshard();
  if (at::GradMode::is_enabled()) forwarded_with_grad_ = true;
  context_->on_post_forward(this);
  return true;
}

void Group::abort_forward() noexcept {
  call_inputs_.clear();
  try {
    if (training_state_ == TrainingState::kForward) training_state_ = state_before_forward_;
    reshard();
    context_->cancel_forward_prefetches();
  } catch (const std::exception& e) {
    // The forward's own error is on its way out: this one is only reported.
    TORCH_WARN("fsdp: while unwinding the failed forward of '", name_, "': ", e.what());
  }
}

at::Tensor Group::wrap_input(const at::Tensor& input) {
  const auto& mp = options_.mixed_precision;
  const bool cast = mp.cast_forward_inputs && mp.param_dtype && input.defined() &&
                    input.is_floating_point() && input.scalar_type() != *mp.param_dtype;
  const at::Tensor x = cast ? input.to(*mp.param_dtype) : input;
  if (!x.defined() || !x.requires_grad() || !at::GradMode::is_enabled()) return x;
  // The same tensor passed twice is one tensor inside forward too: an in-place change through
  // one argument is seen through the other, with its history.
  for (const auto& w : call_inputs_)
    if (w.outer.unsafeGetTensorImpl() == x.unsafeGetTensorImpl()) return w.inner;
  if (x.is_view()) {
    auto out = InputViewBackward::apply(c10::make_intrusive<GroupRef>(weak_from_this()), x);
    input_nodes_.push_back(out.grad_fn());
    return out;
  }
  auto node = compat::make_node<InputBackward>(weak_from_this());
  node->set_next_edges({torch::autograd::impl::gradient_edge(x)});
  node->add_input_metadata(x);
  at::Tensor y = x.variable_data();
  torch::autograd::impl::set_version_counter(y, torch::autograd::impl::version_counter(x));
  torch::autograd::impl::set_gradient_edge(y, {node, 0});
  input_nodes_.push_back(node);
  call_inputs_.push_back(CallInput{x, y, node.get()});
  return y;
}

// [Note: inputs modified in place] An input handed to forward through the input-side node is a
// separate tensor that shares the caller's storage and version counter. When forward modifies it
// in place with grad mode on, autograd rebases the history of that tensor only: the caller's
// tensor holds the new values with its old history, and every later use of it would get the
// wrong gradient. Without sharding, the in-place op rebases the caller's tensor itself; so does
// this, once forward returns, by giving it the inner tensor's gradient edge (whose history leads
// back through the input-side node to the old one). A leaf that requires grad is refused, as
// LibTorch refuses in-place ops on such leaves without sharding.
void Group::rebase_modified_inputs() {
  for (size_t i = 0; i < call_inputs_.size(); ++i) {
    const CallInput& w = call_inputs_[i];
    if (w.inner.grad_fn().get() == w.node) continue;  // not modified in place under grad mode
    FSDP_CHECK(w.outer.grad_fn().get() != nullptr, "sharded module '", name_, "' (", type_name_,
               ") modified its tensor input #", i,
               " in place, but that input is a leaf that requires grad (LibTorch refuses in-place "
               "operations on such a leaf). Fix: pass a copy (x.clone()) or change the module to "
               "work out of place");
    torch::autograd::impl::set_gradient_edge(w.outer,
                                             torch::autograd::impl::gradient_edge(w.inner));
  }
  call_inputs_.clear();
}

void Group::broadcast_buffers_to_all() {
  // DDP's broadcast_buffers: rank 0's buffers (e.g. BatchNorm running statistics) on every rank,
  // before each forward of the root. Under HSDP, within the replica, then across replicas.
  broadcast_buffers(*module_, *comm_);
  if (context_->replicate()) broadcast_buffers(*module_, *context_->replicate());
}

at::Tensor Group::cast_output(const at::Tensor& y) const {
  const auto& to = options_.mixed_precision.output_dtype;
  if (!to || !y.defined() || !y.is_floating_point() || y.scalar_type() == *to) return y;
  return y.to(*to);
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------
void Group::pre_backward(const torch::autograd::Node* node) {
  std::lock_guard<std::recursive_mutex> lock(context_->mutex());
  context_->pass_for_hook(this, node).pre_backward(*this);
}

void Group::on_grad_ready(size_t i) {
  std::lock_guard<std::recursive_mutex> lock(context_->mutex());
  if (auto* pass = context_->current_pass()) {
    pass->on_grad_ready(*this, i);
  } else {
    context_->log(this, detail::cat("gradient of '", params_[i].name(),
                                    "' outside any sharded backward (kept unsharded)"));
  }
}

void Group::on_input_backward() {
  std::lock_guard<std::recursive_mutex> lock(context_->mutex());
  if (auto* pass = context_->current_pass()) pass->on_input_backward(*this);
}

void Group::begin_backward_use() {
  transition(TrainingState::kPreBackward,
             {TrainingState::kIdle, TrainingState::kPreBackward, TrainingState::kPostBackward});
  if (backward_start_us_ < 0 && trace::enabled()) backward_start_us_ = trace::now_us();
}

void Group::post_backward() {
  transition(TrainingState::kPostBackward,
             {TrainingState::kIdle, TrainingState::kPreBackward, TrainingState::kPostBackward});
  end_backward_span();
  // [Note: resharding during backward] Its own hooks, gradients and input-side nodes bound every
  // node that reads a group's parameters only when the nodes between its outputs and inputs are
  // its own. An element has no output hook or input-side node of its own. A group whose module
  // contains other sharded modules has nodes that read its parameters (a frozen weight applied
  // to a child's output, say) and lead to the children's gradients, not to its own inputs or
  // gradients: they may run after every event of its own. For both, only the final callback is
  // known to come after all such nodes.
  if (reshard_after_backward_ && !on_use_ && !contains_groups_) reshard();
}

void Group::finalize_backward() {
  end_backward_span();
  if (handed_send_.defined()) drop_handed_over();  // the backward failed before this reduction
  if (training_state_ != TrainingState::kForward) training_state_ = TrainingState::kIdle;
  if (reshard_after_backward_) reshard();
}

void Group::end_backward_span() {
  if (backward_start_us_ < 0) return;
  trace::complete("backward " + name_, "compute", backward_start_us_,
                  trace::now_us() - backward_start_us_);
  backward_start_us_ = -1;
}

// ---------------------------------------------------------------------------------------------
// Reduction
// ---------------------------------------------------------------------------------------------
namespace {
// A reduce-scatter's send buffer, (world, S), from the pool.
at::Tensor acquire_send(Context& ctx, int64_t flat_numel, at::ScalarType dtype) {
  const int64_t world = ctx.reduce_lane().size();
  return ctx.pool().acquire(world * flat_numel, dtype).view({world, flat_numel});
}
}  // namespace

void Group::hand_over_grad(size_t i) {
  if (reduces_locally()) {
    params_[i].move_grad_to_shard(reduce_dtype_);
    return;
  }
  if (!handed_send_.defined()) {
    handed_send_ = acquire_send(*context_, flat_numel_, reduce_dtype_);
    handed_.assign(params_.size(), false);
  }
  params_[i].pack_grad(handed_send_, offsets_[i]);
  handed_[i] = true;
}

PendingReduce Group::issue_reduce_scatter() {
  PendingReduce p;
  p.group = this;
  if (reduces_locally()) {
    for (auto& param : params_) param.move_grad_to_shard(reduce_dtype_);
    return p;
  }
  // The gradients handed over are packed already; the rest (zeros when missing) now.
  const bool handed = handed_send_.defined();
  p.send = handed ? std::move(handed_send_) : acquire_send(*context_, flat_numel_, reduce_dtype_);
  handed_send_ = at::Tensor();
  for (size_t i = 0; i < params_.size(); ++i)
    if (!handed || !handed_[i]) params_[i].pack_grad(p.send, offsets_[i]);
  handed_.clear();
  // In place: the reduced rows land in this rank's own row of the send buffer.
  auto& lane = context_->reduce_lane();
  p.output = p.send.view({-1}).narrow(0, lane.rank() * flat_numel_, flat_numel_);
  p.work = lane.reduce_scatter(p.output, p.send, ReduceOp::kAvg);
  return p;
}

void Group::drop_handed_over() {
  context_->pool().release(std::move(handed_send_));
  handed_send_ = at::Tensor();
  handed_.clear();
}

bool Group::poll_reduce(PendingReduce& p) {
  if (!p.output.defined()) return true;  // reduced locally
  if (!p.replicating) {
    if (!p.work.is_completed()) return false;
    if (!context_->replicate_lane()) return true;
    start_replicate(p);
  }
  return p.replicate_work.is_completed();
}

void Group::start_replicate(PendingReduce& p) {
  p.work.wait();
  p.work = Work();
  p.replicate_work = context_->replicate_lane()->all_reduce(p.output, ReduceOp::kAvg);
  p.replicating = true;
}

void Group::finish_reduce(PendingReduce& p) {
  if (!p.output.defined()) return;  // reduced locally (one rank): nothing was exchanged
  if (!p.replicating && context_->replicate_lane()) {
    start_replicate(p);
  } else if (!p.replicating) {
    p.work.wait();
    p.work = Work();
  }
  if (p.replicating) p.replicate_work.wait();
  p.replicate_work = Work();
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].trainable()) params_[i].add_shard_grad(p.output, offsets_[i]);
  context_->pool().release(p.send.view({-1}));
  p.output = p.send = at::Tensor();
}

}  // namespace fsdp::detail
