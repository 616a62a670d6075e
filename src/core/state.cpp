// Context: forward order, backward bookkeeping, and the post-backward guarantee.
//
// [Note: the post-backward guarantee]
// A group's reduce-scatter is issued only when every trainable parameter of the group whose
// AccumulateGrad will run in this backward has run it (Final). The expected set is computed at the
// first pre-backward hook of the GraphTask from the engine's own plan (nodes_in_graph, and
// exec_info when backward was given inputs), so it does not depend on scheduling. Groups are issued
// in one fixed order per backward (reverse first-forward order, the root last), a ready group
// waiting for its turn (Agreed). Each group is issued at most once per backward (Once), and the
// final callback, which the engine runs after every node, issues whatever is left - parameters that
// got no gradient contribute zeros - and waits for every reduction before backward returns
// (Complete). A backward with explicit inputs (torch::autograd::grad, backward(inputs=)) reduces
// nothing: its gradients, if any accumulate, stay unsharded until the next plain synced backward.
#include <ATen/ATen.h>
#include <fsdp/error.h>
#include <fsdp/trace.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include "core/group.h"

namespace fsdp::detail {
namespace {

bool env_on(const char* k) {
  const char* v = std::getenv(k);
  return v && *v && std::string(v) != "0";
}

// Will `node` run in the current GraphTask? (graphtask113.md: needed_, not should_execute()).
bool will_run(const torch::autograd::Node* node) {
  auto* nig = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (!node || !nig || !nig->count(const_cast<torch::autograd::Node*>(node))) return false;
  auto* ei = torch::autograd::get_current_graph_task_exec_info();
  if (!ei || ei->empty()) return true;
  auto it = ei->find(const_cast<torch::autograd::Node*>(node));
  return it != ei->end() && it->second.needed_;
}

}  // namespace

Context::Context(std::shared_ptr<Communicator> comm, bool audit) : comm_(std::move(comm)) {
  gather_lane_ = comm_->lane("fsdp.all_gather");
  reduce_lane_ = comm_->lane("fsdp.reduce_scatter");
  debug_ = env_on("FSDP_DEBUG");
  audit_.enabled = audit || env_on("FSDP_AUDIT");
  if (audit_.enabled) audit_.lane = comm_->lane("fsdp.audit");
}

int Context::index_of(const Group* g) const {
  auto it = std::find(groups.begin(), groups.end(), g);
  return it == groups.end() ? -1 : static_cast<int>(it - groups.begin());
}

void Context::remove(Group* g) {
  groups.erase(std::remove(groups.begin(), groups.end(), g), groups.end());
  forward_order_.erase(std::remove(forward_order_.begin(), forward_order_.end(), g),
                       forward_order_.end());
}

void Context::log(const Group* g, const std::string& event) const {
  if (!debug_) return;
  std::cerr << "fsdp[rank " << comm_->rank() << "] group '" << (g ? g->name() : "-") << "' "
            << event << " | gathered " << unsharded_groups_ << " groups, " << unsharded_bytes_
            << " bytes\n";
}

void Context::on_unsharded(const Group* g) {
  unsharded_bytes_ += g->full_bytes();
  if (g != root()) ++unsharded_groups_;
  peak_unsharded_bytes_ = std::max(peak_unsharded_bytes_, unsharded_bytes_);
  peak_unsharded_groups_ = std::max(peak_unsharded_groups_, unsharded_groups_);
}

void Context::on_resharded(const Group* g) {
  unsharded_bytes_ -= g->full_bytes();
  if (g != root()) --unsharded_groups_;
}

void Context::reset_peaks() {
  peak_unsharded_bytes_ = unsharded_bytes_;
  peak_unsharded_groups_ = unsharded_groups_;
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
void Context::on_pre_forward(Group* g) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (backward_done_ && torch::autograd::get_current_graph_task_nodes_in_graph() == nullptr) {
    // First forward after a backward: a new iteration.
    backward_done_ = false;
    if (!forward_order_.empty()) last_forward_order_ = forward_order_;
    forward_order_.clear();
    for (Group* x : groups) {
      x->input_nodes.clear();
      x->forwarded_since_backward = false;
    }
  }
  if (!g->forwarded_since_backward) {
    g->forwarded_since_backward = true;
    forward_order_.push_back(g);
  }
  log(g, "pre_forward");
}

namespace {
bool may_prefetch(const Group* target) {
  return target && target->shard_state() == ShardState::kSharded &&
         target->options().max_unsharded_groups >= 2;
}
}  // namespace

void Context::prefetch_forward(Group* g) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::vector<Group*> targets;
  if (g->forward_prefetch_set) {
    targets = g->forward_prefetch;
  } else {
    auto it = std::find(last_forward_order_.begin(), last_forward_order_.end(), g);
    if (it != last_forward_order_.end() && it + 1 != last_forward_order_.end())
      targets.push_back(*(it + 1));
  }
  for (Group* t : targets)
    if (t != g && may_prefetch(t)) {
      log(t, detail::cat("forward prefetch from '", g->name(), "'"));
      t->unshard();
    }
}

void Context::prefetch_backward(Group* g) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::vector<Group*> targets;
  if (g->backward_prefetch_set) {
    targets = g->backward_prefetch;
  } else {
    // Backward runs the non-root groups in reverse forward order; the root's hook comes first.
    std::vector<Group*> seq;
    for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it)
      if (*it != root()) seq.push_back(*it);
    if (g == root()) {
      if (!seq.empty()) targets.push_back(seq.front());
    } else {
      auto it = std::find(seq.begin(), seq.end(), g);
      if (it != seq.end() && it + 1 != seq.end()) targets.push_back(*(it + 1));
    }
  }
  for (Group* t : targets)
    if (t != g && may_prefetch(t)) {
      log(t, detail::cat("backward prefetch from '", g->name(), "'"));
      t->unshard();
    }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------
TaskState* Context::current_task() {
  auto it = tasks_.find(torch::autograd::get_current_graph_task_nodes_in_graph());
  return it == tasks_.end() ? nullptr : &it->second;
}

TaskState& Context::begin_task(const void* key) {
  TaskState& t = tasks_[key];
  auto* ei = torch::autograd::get_current_graph_task_exec_info();
  t.reducing = ei == nullptr || ei->empty();
  // Issue order: reverse first-forward order, the root last; groups not forwarded after them.
  for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it)
    if (*it != root()) t.order.push_back(*it);
  for (auto it = groups.rbegin(); it != groups.rend(); ++it)
    if (*it != root() && std::find(t.order.begin(), t.order.end(), *it) == t.order.end())
      t.order.push_back(*it);
  if (root()) t.order.push_back(root());
  for (Group* g : groups) {
    int grads = 0, inputs = 0;
    auto& arrived = t.arrived[g];
    arrived.assign(g->params().size(), 0);
    for (size_t i = 0; i < g->params().size(); ++i) {
      const auto& acc = g->params()[i].accumulator();
      if (acc && will_run(acc.get())) {
        ++grads;
      } else {
        arrived[i] = 2;  // will not arrive in this backward: contributes zeros (or its old grad)
      }
    }
    for (auto& w : g->input_nodes)
      if (auto n = w.lock(); n && will_run(n.get())) ++inputs;
    t.pending_grads[g] = grads;
    t.pending_inputs[g] = inputs;
    log(g, detail::cat("backward begins: expects ", grads, " gradients, ", inputs,
                       " input-side nodes", t.reducing ? "" : " (explicit inputs: no reduction)"));
  }
  torch::autograd::Engine::get_default_engine().queue_callback([this, key] { finalize(key); });
  return t;
}

void Context::on_pre_backward(Group* g) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const void* key = torch::autograd::get_current_graph_task_nodes_in_graph();
  TaskState* t = current_task();
  if (!t) {
    t = &begin_task(key);
    for (Group* x : groups)
      if (t->pending_grads[x] == 0 && t->pending_inputs[x] == 0)
        maybe_reshard_after_backward(*t, x);
    try_issue(*t);
  }
  log(g, detail::cat("pre_backward (", to_string(g->shard_state()), ")"));
  if (g->backward_start_us >= 0) return;  // another output of the same group: already running
  g->unshard();
  prefetch_backward(g);
  g->wait_for_unshard();
  g->backward_start_us = trace::now_us();
}

void Context::on_grad_ready(Group* g, size_t i) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  TaskState* t = current_task();
  if (!t) {
    log(g, detail::cat("gradient of '", g->params()[i].name(),
                       "' outside any sharded backward (kept unsharded)"));
    return;
  }
  if (t->issued[g] > 0) {
    if (audit_.enabled) audit_.late_gradient(*g, i);
    log(g, detail::cat("LATE gradient of '", g->params()[i].name(), "'"));
    return;
  }
  auto& a = t->arrived[g][i];
  if (a == 0) {
    a = 1;
    --t->pending_grads[g];
  }
  log(g, detail::cat("gradient final: '", g->params()[i].name(), "' (", t->pending_grads[g],
                     " to go)"));
  if (t->pending_grads[g] == 0) {
    end_backward_span(g);
    try_issue(*t);
    maybe_reshard_after_backward(*t, g);
  }
}

void Context::on_input_backward(Group* g) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  TaskState* t = current_task();
  if (!t) return;
  if (t->pending_inputs[g] > 0) --t->pending_inputs[g];
  log(g, detail::cat("input-side backward (", t->pending_inputs[g], " to go)"));
  maybe_reshard_after_backward(*t, g);
}

void Context::end_backward_span(Group* g) {
  if (g->backward_start_us < 0) return;
  trace::complete("backward " + g->name(), "compute", g->backward_start_us,
                  trace::now_us() - g->backward_start_us);
  g->backward_start_us = -1;
}

void Context::maybe_reshard_after_backward(TaskState& t, Group* g) {
  if (t.pending_grads[g] == 0 && t.pending_inputs[g] == 0 && g->reshard_after_backward)
    g->reshard();
}

void Context::try_issue(TaskState& t) {
  // Fault injection for the audit's own test (FSDP_FAULT=issue_early): ignore readiness.
  static const bool issue_early = [] {
    const char* f = std::getenv("FSDP_FAULT");
    return f && std::string(f) == "issue_early";
  }();
  while (t.cursor < t.order.size() && (issue_early || t.pending_grads[t.order[t.cursor]] == 0))
    issue(t, t.order[t.cursor++]);
}

void Context::issue(TaskState& t, Group* g) {
  if (t.issued[g] > 0) {
    if (audit_.enabled) audit_.issued_twice(*g);
    return;
  }
  if (!t.reducing || !g->requires_gradient_sync || !g->has_trainable()) {
    t.issued[g] = 0;
    return;
  }
  t.issued[g] = 1;
  t.issue_log.emplace_back(index_of(g), g->flat_numel());
  // Bound memory: a reduce-scatter in flight holds its group's gradients twice (send and receive
  // buffers). Keep at most two in flight; the older one has had a whole group's backward to finish.
  while (t.in_flight.size() > 1) {
    t.in_flight.front().group->finish_reduce(t.in_flight.front());
    t.in_flight.erase(t.in_flight.begin());
  }
  t.in_flight.push_back(g->issue_reduce_scatter());
  log(g, "reduce-scatter issued");
}

void Context::finalize(const void* key) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  auto it = tasks_.find(key);
  if (it == tasks_.end()) return;
  TaskState& t = it->second;
  // Whatever did not arrive will not: issue the rest in order (their missing grads are zeros).
  for (; t.cursor < t.order.size(); ++t.cursor) {
    Group* g = t.order[t.cursor];
    t.pending_grads[g] = 0;
    issue(t, g);
  }
  std::exception_ptr error;
  for (auto& p : t.in_flight) {
    try {
      p.group->finish_reduce(p);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  t.in_flight.clear();
  for (Group* g : groups) {
    end_backward_span(g);
    if (g->reshard_after_backward) g->reshard();
  }
  backward_done_ = true;
  log(root(), "backward complete");
  TaskState done = std::move(t);
  tasks_.erase(it);
  if (error) std::rethrow_exception(error);
  if (audit_.enabled) audit_.check(done, groups);
}

}  // namespace fsdp::detail
