// materialize: replays a deferred_init recording on real CPU tensors and hands each parameter and
// buffer its value. [Note: deferred initialisation] in docs/design.md.
//
// Plan (a backward pass over the steps): a value is live where a later step reads it or it is one
// of the model's tensors at the end. A step is useful when it writes or creates a live value;
// writing a value entirely without reading it (normal_, fill_, copy_, ...) ends its earlier life.
// Any other step is dead: it still runs, in order (it may draw from the generator, and how many
// draws can depend on the tensor's layout), but writes into scratch memory of the same layout,
// freed at once. Replay (forward) frees each value after its last use and delivers a model tensor's
// value right after its last step: so the GPT's kaiming_uniform_ runs on scratch, init_weights'
// normal_ fills the weight, and the weight goes to its shard before the next parameter is made.
#include <ATen/ATen.h>
#include <fsdp/deferred_init.h>
#include <fsdp/error.h>
#include <torch/nn/module.h>

#include <map>
#include <set>
#include <string>

#include "comm/rank_agreement.h"
#include "compat.h"
#include "compat/interception.h"
#include "core/binding.h"
#include "core/deferred_init.h"
#include "core/deferred_recording.h"
#include "core/group.h"
#include "core/registry.h"
#include "util/checksum.h"

namespace fsdp {
namespace detail::deferred {
namespace {

// A parameter or buffer of the model built by the recording.
struct Target {
  std::string name;
  at::Tensor tensor;
  TensorRef ref;
};

struct Plan {
  std::vector<bool> useful;       // per step
  std::vector<int64_t> last_use;  // per value: the last step that needs its real bytes
  std::vector<std::vector<size_t>> targets_of;  // per value: indices into the targets
};

Plan make_plan(const Recording& rec, const std::vector<Target>& targets) {
  Plan plan;
  const size_t nv = rec.values.size(), ns = rec.steps.size();
  plan.useful.assign(ns, false);
  plan.last_use.assign(nv, -1);
  plan.targets_of.resize(nv);
  std::vector<bool> live(nv, false);
  for (size_t i = 0; i < targets.size(); ++i) {
    plan.targets_of[targets[i].ref.value].push_back(i);
    live[targets[i].ref.value] = true;
  }
  for (size_t k = ns; k-- > 0;) {
    const Step& s = rec.steps[k];
    bool useful = false;
    for (const auto& f : s.fresh)
      for (int64_t v : f) useful = useful || live[v];
    for (const auto& r : s.refs) useful = useful || (r.written && live[r.value]);
    plan.useful[k] = useful;
    if (useful) {
      for (const auto& f : s.fresh)
        for (int64_t v : f) live[v] = false;
      for (int64_t v : s.overwritten) live[v] = false;
      for (const auto& r : s.refs)
        if (std::find(s.overwritten.begin(), s.overwritten.end(), r.value) == s.overwritten.end())
          live[r.value] = true;
    } else {
      for (const auto& r : s.refs)
        if (!s.writes(r.value)) live[r.value] = true;  // a dead step still reads its inputs
    }
  }
  for (size_t k = 0; k < ns; ++k) {
    const Step& s = rec.steps[k];
    for (const auto& r : s.refs)
      if (plan.useful[k] || !s.writes(r.value)) plan.last_use[r.value] = static_cast<int64_t>(k);
    if (plan.useful[k])
      for (const auto& f : s.fresh)
        for (int64_t v : f) plan.last_use[v] = static_cast<int64_t>(k);
  }
  return plan;
}

// A tensor looking into `base`'s storage with geometry g.
at::Tensor alias(const at::Tensor& base, const Geometry& g) {
  at::Tensor t = at::empty({0}, base.options().dtype(g.dtype));
  t.set_(base.storage(), g.offset, g.sizes, g.strides);
  return t;
}

at::Tensor allocate(const Value& v) {
  return at::empty_strided(v.geometry.sizes, v.geometry.strides,
                           at::TensorOptions().dtype(v.geometry.dtype));
}

class Replay {
 public:
  Replay(const Recording& rec, std::vector<Target> targets)
      : rec_(rec), targets_(std::move(targets)), plan_(make_plan(rec_, targets_)) {}
  MaterializeReport run();

 private:
  void run_step(size_t k);
  at::Tensor argument(const Step& s, const TensorRef& r, bool useful,
                      std::map<int64_t, at::Tensor>& scratch);
  void keep(int64_t v, at::Tensor t);
  void release(int64_t v);
  void deliver(int64_t v);
  void check_agreement();

  const Recording& rec_;
  std::vector<Target> targets_;
  Plan plan_;
  std::map<int64_t, at::Tensor> real_;
  int64_t live_bytes_ = 0;
  MaterializeReport report_;
  // Checksums of delivered values, compared across the ranks that shard them.
  struct Sum {
    std::string name;
    int64_t checksum;
    Communicator* comm;
  };
  std::vector<Sum> sums_;
};

void Replay::keep(int64_t v, at::Tensor t) {
  live_bytes_ += static_cast<int64_t>(t.storage().nbytes());
  real_[v] = std::move(t);
}

void Replay::release(int64_t v) {
  auto it = real_.find(v);
  if (it == real_.end()) return;
  live_bytes_ -= static_cast<int64_t>(it->second.storage().nbytes());
  real_.erase(it);
}

at::Tensor Replay::argument(const Step& s, const TensorRef& r, bool useful,
                            std::map<int64_t, at::Tensor>& scratch) {
  at::Tensor base;
  if (!useful && s.writes(r.value)) {
    auto& sc = scratch[r.value];
    if (!sc.defined()) sc = allocate(rec_.values[r.value]);
    base = sc;
  } else {
    auto it = real_.find(r.value);
    if (it == real_.end()) {
      FSDP_CHECK(
          std::find(s.overwritten.begin(), s.overwritten.end(), r.value) != s.overwritten.end(),
          "materialize: internal error: ", s.op.schema().name(),
          " needs a value that the replay did not keep");
      keep(r.value, allocate(rec_.values[r.value]));
      it = real_.find(r.value);
    }
    base = it->second;
  }
  if (r.whole && !r.wrapped) return base;
  at::Tensor t = alias(base, r.geometry);
  if (r.wrapped) t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

void Replay::run_step(size_t k) {
  const Step& s = rec_.steps[k];
  const bool useful = plan_.useful[k];
  std::vector<c10::IValue> stack = s.args;
  std::map<int64_t, at::Tensor> scratch;
  for (const auto& r : s.refs) {
    at::Tensor t = argument(s, r, useful, scratch);
    if (r.element < 0) {
      stack[r.position] = t;
    } else if (stack[r.position].isTensorList()) {
      auto l = stack[r.position].toTensorList().copy();
      l.set(r.element, t);
      stack[r.position] = l;
    } else {
      auto l = stack[r.position].toList().copy();
      l.set(r.element, t);
      stack[r.position] = l;
    }
  }
  s.op.callBoxed(&stack);
  int64_t transient = 0;
  for (const auto& [v, t] : scratch) transient += static_cast<int64_t>(t.storage().nbytes());
  for (size_t i = 0; i < s.fresh.size(); ++i) {
    if (s.fresh[i].empty()) continue;
    std::vector<at::Tensor> outs = stack[i].isTensor()
                                       ? std::vector<at::Tensor>{stack[i].toTensor()}
                                       : stack[i].toTensorList().vec();
    for (size_t j = 0; j < s.fresh[i].size(); ++j) {
      const int64_t v = s.fresh[i][j];
      if (!useful || plan_.last_use[v] < static_cast<int64_t>(k)) {
        transient += static_cast<int64_t>(outs[j].storage().nbytes());
        continue;
      }
      FSDP_CHECK(Geometry::of(outs[j]) == rec_.values[v].geometry,
                 "materialize: internal error: ", s.op.schema().name(), " produced sizes ",
                 outs[j].sizes(), " strides ", outs[j].strides(),
                 " on the CPU, but its meta kernel predicted strides ",
                 c10::IntArrayRef(rec_.values[v].geometry.strides));
      keep(v, outs[j]);
    }
  }
  report_.peak_live_bytes = std::max(report_.peak_live_bytes, live_bytes_ + transient);
  report_.operators += 1;
  report_.operators_on_scratch += useful ? 0 : 1;
  // Values whose last use this was: deliver the model's, free the rest.
  std::set<int64_t> touched;
  for (const auto& r : s.refs) touched.insert(r.value);
  for (const auto& f : s.fresh) touched.insert(f.begin(), f.end());
  for (int64_t v : touched) {
    if (plan_.last_use[v] != static_cast<int64_t>(k)) continue;
    if (!plan_.targets_of[v].empty() && real_.count(v)) deliver(v);
    release(v);
  }
}

void Replay::deliver(int64_t v) {
  const at::Tensor& base = real_.at(v);
  std::vector<const Target*> in_place;
  for (size_t i : plan_.targets_of[v]) {
    const Target& t = targets_[i];
    const at::Tensor full = t.ref.whole ? base : alias(base, t.ref.geometry);
    report_.largest_tensor_bytes =
        std::max(report_.largest_tensor_bytes, static_cast<int64_t>(full.nbytes()));
    report_.tensors += 1;
    sums_.push_back(Sum{t.name, value_checksum(full), nullptr});
    if (Communicator* comm = deliver_to_shard(t.tensor, full)) {
      sums_.back().comm = comm;
      report_.sharded += 1;
      remove_pending(t.tensor);
    } else {
      in_place.push_back(&t);
    }
  }
  bool shared_filled = false;
  for (const Target* t : in_place) {
    compat::interception::mark(t->tensor, false);
    if (rec_.value_of(t->tensor) == v) {
      // The value's own storage, which its views share: fill it once, as the base.
      if (!shared_filled) {
        at::Tensor whole = alias(t->tensor, rec_.values[v].geometry);
        compat::alloc_storage(whole);
        whole.copy_(base);
        shared_filled = true;
      }
    } else {
      compat::alloc_storage(t->tensor);  // given a storage of its own after the build
      t->tensor.variable_data().copy_(t->ref.whole ? base : alias(base, t->ref.geometry));
    }
    remove_pending(t->tensor);
  }
}

void Replay::check_agreement() {
  // Buffers and unsharded parameters of a sharded model are compared over the model's ranks.
  Communicator* model_comm = nullptr;
  for (const auto& s : sums_)
    if (s.comm && !model_comm) model_comm = s.comm;
  if (!model_comm) return;
  std::vector<Communicator*> comms;
  for (auto& s : sums_) {
    if (!s.comm) s.comm = model_comm;
    if (std::find(comms.begin(), comms.end(), s.comm) == comms.end()) comms.push_back(s.comm);
  }
  for (Communicator* c : comms) {
    std::vector<int64_t> sums;
    std::vector<const std::string*> names;
    for (const auto& s : sums_)
      if (s.comm == c) {
        sums.push_back(s.checksum);
        names.push_back(&s.name);
      }
    if (c->size() == 1) continue;
    if (auto diff = first_difference_from_rank0(all_gather_values(*c, sums)))
      throw Error(
          detail::cat("materialize: parameter '", *names[diff->index],
                      "' has different initial values on rank ", diff->rank,
                      " than on rank 0 (this is rank ", c->rank(),
                      "). Every rank must start from the same weights: seed the random generator "
                      "identically on every rank before building the model (torch::manual_seed)"));
  }
}

MaterializeReport Replay::run() {
  compat::interception::Bypass no_python;
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  set_generator_state(rec_.generator_state);
  for (size_t k = 0; k < rec_.steps.size(); ++k) run_step(k);
  check_agreement();
  return report_;
}

}  // namespace

Communicator* deliver_to_shard(const at::Tensor& param, const at::Tensor& full) {
  auto b = Registry::instance().binding_of(param);
  if (!b) return nullptr;
  Group* g = b->group.get();
  for (size_t i = 0; i < g->params().size(); ++i)
    if (g->params()[i].param().unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) {
      g->materialize_param(i, full);
      return &g->comm();
    }
  return nullptr;
}
}  // namespace detail::deferred

MaterializeReport materialize(torch::nn::Module& model) {
  using namespace detail::deferred;
  std::vector<Target> targets;
  std::shared_ptr<Recording> rec;
  std::set<const c10::TensorImpl*> seen;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    TensorRef ref;
    auto r = find_recording(t, &ref);
    if (!r) return;
    FSDP_CHECK(!rec || rec == r, "materialize(", model.name(), "): '", name,
               "' was built by a different deferred_init call than the model's other tensors. "
               "Fix: build the whole model inside one deferred_init");
    rec = r;
    targets.push_back(Target{name, t, ref});
  };
  for (const auto& p : model.named_parameters(/*recurse=*/true)) add(p.key(), p.value());
  for (const auto& b : model.named_buffers(/*recurse=*/true)) add(b.key(), b.value());
  FSDP_CHECK(rec != nullptr, "materialize(", model.name(),
             "): no parameter or buffer of this module waits for values from fsdp::deferred_init "
             "(it was built eagerly, or materialised already)");
  for (const auto& k : rec->known) {
    const auto t = k.tensor.lock();
    FSDP_CHECK(!t || seen.count(t.get()) || !is_pending(at::Tensor(t)), "materialize(",
               model.name(),
               "): the deferred_init that built this module also built tensors outside it (",
               rec->known.size(),
               " parameters and buffers in all), which would never get their "
               "values. Fix: call materialize on the module deferred_init returned");
  }
  forget_recording(*rec);  // once: a second call finds nothing to do and says so
  return Replay(*rec, std::move(targets)).run();
}

}  // namespace fsdp
