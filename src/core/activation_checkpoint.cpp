// Activation checkpointing: the recomputing autograd node ([Note: activation checkpointing] in
// docs/design.md) and the fully_shard option's checks.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fsdp/activation_checkpoint.h>
#include <fsdp/error.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <mutex>
#include <set>

#include "compat/autograd.h"

namespace fsdp {

namespace {

at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The backward of one checkpointed call. Next edges: the call's tensor inputs, then the
// parameters; one input (gradient) per output of the call.
class RecomputeBackward : public torch::autograd::Node {
 public:
  RecomputeBackward(TensorFunction fn, std::vector<at::Tensor> inputs, at::Tensor rng_state,
                    std::vector<at::Tensor> params)
      : fn_(std::move(fn)), rng_state_(std::move(rng_state)), params_(std::move(params)) {
    for (const auto& x : inputs) {
      versions_.push_back(x.defined() ? x._version() : 0);
      needs_grad_.push_back(x.defined() && x.requires_grad());
      inputs_.push_back(x.defined() ? x.detach() : x);
    }
  }

  std::string name() const override { return "fsdp::RecomputeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    FSDP_CHECK(fn_,
               "activation checkpointing: backward ran a second time through a checkpointed "
               "call whose saved inputs were freed by the first; pass retain_graph=true to "
               "the first backward");
    for (size_t i = 0; i < inputs_.size(); ++i)
      FSDP_CHECK(!inputs_[i].defined() || inputs_[i]._version() == versions_[i],
                 "activation checkpointing: input #", i,
                 " of a checkpointed call was modified in place after the call (version ",
                 versions_[i], " -> ", inputs_[i]._version(),
                 "); the recomputation would see other values. Do not change a checkpointed "
                 "call's inputs in place before backward (clone them first)");
    std::vector<at::Tensor> ins, outs;
    {
      const at::Tensor saved_now = cpu_rng_state();
      set_cpu_rng_state(rng_state_);
      try {
        at::AutoGradMode grad_on(true);
        for (size_t i = 0; i < inputs_.size(); ++i) {
          at::Tensor x = inputs_[i].defined() ? inputs_[i].detach() : inputs_[i];
          if (needs_grad_[i]) x.requires_grad_(true);
          ins.push_back(x);
        }
        outs = fn_(ins);
      } catch (...) {
        set_cpu_rng_state(saved_now);
        throw;
      }
      set_cpu_rng_state(saved_now);
    }
    FSDP_CHECK(outs.size() == grads.size(), "activation checkpointing: the recomputation returned ",
               outs.size(), " tensors, the first run ", grads.size(),
               "; a checkpointed forward must be deterministic in its structure");
    std::vector<at::Tensor> roots, root_grads, wrt;
    for (size_t i = 0; i < outs.size(); ++i)
      if (grads[i].defined() && outs[i].requires_grad()) {
        roots.push_back(outs[i]);
        root_grads.push_back(grads[i]);
      }
    std::vector<size_t> slot;  // position in the result of each entry of wrt
    for (size_t i = 0; i < ins.size(); ++i)
      if (needs_grad_[i] && task_should_compute_output(i)) {
        wrt.push_back(ins[i]);
        slot.push_back(i);
      }
    for (size_t j = 0; j < params_.size(); ++j)
      if (task_should_compute_output(ins.size() + j)) {
        wrt.push_back(params_[j]);
        slot.push_back(ins.size() + j);
      }
    torch::autograd::variable_list result(num_outputs());
    if (roots.empty() || wrt.empty()) return result;
    auto g = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                   /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < g.size(); ++k) result[slot[k]] = g[k];
    return unaliased(std::move(result), grads);
  }

  // [Note: gradients that share storage] One reentrant backward computes all of the call's
  // gradients, and some of them can be views of one tensor: for `w.sum(0) + b`, b's gradient is
  // a tensor G and w's is G viewed as w's shape. Returned from one node, where nothing else holds
  // them, AccumulateGrad steals both as the parameters' .grad; the next accumulation (a second
  // micro-batch) adds w's gradient in place and so into b's too. The unsharded graph never hands
  // out such aliases (its AccumulateGrad runs while the node that made G still holds it, and
  // clones), so neither may this node: a gradient sharing storage with another one, or with an
  // incoming gradient (which the engine may have passed on elsewhere), is returned as a copy.
  static torch::autograd::variable_list unaliased(torch::autograd::variable_list result,
                                                  const torch::autograd::variable_list& incoming) {
    std::set<const c10::StorageImpl*> seen;
    for (const auto& t : incoming)
      if (t.defined() && t.has_storage()) seen.insert(t.storage().unsafeGetStorageImpl());
    for (auto& t : result) {
      if (!t.defined() || !t.has_storage()) continue;
      if (!seen.insert(t.storage().unsafeGetStorageImpl()).second)
        t = t.clone(at::MemoryFormat::Contiguous);
    }
    return result;
  }

  void release_variables() override {
    fn_ = nullptr;
    inputs_.clear();
    params_.clear();
  }

 private:
  TensorFunction fn_;
  std::vector<at::Tensor> inputs_;  // detached: the call's graph is not kept
  std::vector<int64_t> versions_;
  std::vector<bool> needs_grad_;
  at::Tensor rng_state_;
  std::vector<at::Tensor> params_;
};

}  // namespace

std::vector<at::Tensor> checkpoint_activations(const TensorFunction& fn,
                                               const std::vector<at::Tensor>& inputs,
                                               const std::vector<at::Tensor>& params) {
  bool any_grad = false;
  for (const auto& t : inputs) any_grad |= t.defined() && t.requires_grad();
  for (const auto& t : params) any_grad |= t.requires_grad();
  if (!at::GradMode::is_enabled() || !any_grad) return fn(inputs);

  std::vector<at::Tensor> trainable;
  for (const auto& p : params)
    if (p.requires_grad()) trainable.push_back(p);
  at::Tensor rng = cpu_rng_state();
  std::vector<int64_t> versions;
  for (const auto& x : inputs) versions.push_back(x.defined() ? x._version() : 0);
  std::vector<at::Tensor> outs;
  {
    at::NoGradGuard no_grad;
    outs = fn(inputs);
  }
  // The recomputation would start from the inputs as this call left them, not as it found them.
  for (size_t i = 0; i < inputs.size(); ++i)
    FSDP_CHECK(!inputs[i].defined() || inputs[i]._version() == versions[i],
               "activation checkpointing: the checkpointed forward modified its tensor input #", i,
               " in place, so recomputing it in backward would start from other values. Fix: "
               "work on a copy inside forward (x = x.clone()), or switch activation_checkpointing "
               "off for this module");
  auto node = compat::make_node<RecomputeBackward>(fn, inputs, rng, trainable);
  std::vector<at::Tensor> edges_of;
  for (const auto& x : inputs) edges_of.push_back(x.defined() ? x : at::Tensor());
  edges_of.insert(edges_of.end(), trainable.begin(), trainable.end());
  node->set_next_edges(torch::autograd::collect_next_edges(edges_of));
  for (auto& o : outs) {
    if (!o.defined()) {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
      continue;
    }
    o = o.detach();  // a fresh tensor (shares storage) that may take a grad_fn
    if (at::isFloatingType(o.scalar_type()) || at::isComplexType(o.scalar_type())) {
      torch::autograd::create_gradient_edge(o, node);
    } else {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    }
  }
  return outs;
}

}  // namespace fsdp
