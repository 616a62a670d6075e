#include "checkpoint/optim_state.h"

#include <ATen/ATen.h>
#include <fsdp/checkpoint.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <map>

#include "checkpoint/checkpoint_common.h"
#include "checkpoint/reader.h"
#include "compat/optim.h"

namespace fsdp::checkpoint::internal {

namespace st = fsdp::safetensors;
using fsdp::detail::cat;

namespace {

template <class State>
void adam_state_out(const State& s, std::vector<std::pair<std::string, at::Tensor>>* rows,
                    std::optional<int64_t>* step) {
  rows->emplace_back("exp_avg", s.exp_avg());
  rows->emplace_back("exp_avg_sq", s.exp_avg_sq());
  if (s.max_exp_avg_sq().defined()) rows->emplace_back("max_exp_avg_sq", s.max_exp_avg_sq());
  *step = s.step();
}

template <class State, class Options>
void adam_state_in(torch::optim::Optimizer* opt, const compat::OptimStateKey& key,
                   const at::Tensor& shard, const ShardInfo& info, CheckpointReader& rd,
                   bool amsgrad, const std::string& where) {
  const Index& idx = rd.index();
  const IndexEntry* step = idx.find(info.name + "::step");
  const IndexEntry* m = idx.find(info.name + "::exp_avg");
  const IndexEntry* v = idx.find(info.name + "::exp_avg_sq");
  const IndexEntry* vmax = idx.find(info.name + "::max_exp_avg_sq");
  if (!step && !m && !v) {  // never stepped when saved
    opt->state().erase(key);
    return;
  }
  std::vector<std::string> missing;
  if (!step) missing.push_back(info.name + "::step");
  if (!m) missing.push_back(info.name + "::exp_avg");
  if (!v) missing.push_back(info.name + "::exp_avg_sq");
  if (amsgrad && !vmax) missing.push_back(info.name + "::max_exp_avg_sq");
  if (!missing.empty()) {
    throw Error(cat(where, ": missing optimizer state ", join(missing),
                    amsgrad && !vmax ? " (the optimizer uses amsgrad; was it saved without?)" : "",
                    "; the checkpoint is incomplete or from another optimizer configuration"));
  }
  auto read_like = [&](const IndexEntry& e) {
    FSDP_CHECK(
        e.dtype == st::dtype_name(shard.scalar_type()) && e.global_shape == info.global_shape,
        where, ": optimizer state '", e.name, "' is ", e.dtype, " ", shape_str(e.global_shape),
        ", its parameter is ", st::dtype_name(shard.scalar_type()), " ",
        shape_str(info.global_shape), "; the checkpoint is inconsistent");
    at::Tensor t = at::zeros_like(shard, at::MemoryFormat::Preserve);
    rd.fill(e, t, info.dim, info.row_offset);
    return t;
  };
  FSDP_CHECK(step->dtype == "I64" && step->global_shape.empty(), where, ": '", step->name, "' is ",
             step->dtype, " ", shape_str(step->global_shape), ", expected I64 []");
  auto s = std::make_unique<State>();
  s->step(rd.read_replicated(*step).item<int64_t>());
  s->exp_avg(read_like(*m));
  s->exp_avg_sq(read_like(*v));
  if (vmax) s->max_exp_avg_sq(read_like(*vmax));
  opt->state()[key] = std::move(s);
}

bool group_amsgrad(const torch::optim::OptimizerParamGroup& g, OptKind kind) {
  if (kind == OptKind::kAdamW)
    return static_cast<const torch::optim::AdamWOptions&>(g.options()).amsgrad();
  if (kind == OptKind::kAdam)
    return static_cast<const torch::optim::AdamOptions&>(g.options()).amsgrad();
  return false;
}

}  // namespace

OptKind kind_of(torch::optim::Optimizer* opt) {
  if (!opt) return OptKind::kNone;
  if (dynamic_cast<torch::optim::AdamW*>(opt)) return OptKind::kAdamW;
  if (dynamic_cast<torch::optim::Adam*>(opt)) return OptKind::kAdam;
  if (dynamic_cast<torch::optim::SGD*>(opt)) return OptKind::kSGD;
  throw Error(
      "checkpoint: the optimizer is not torch::optim AdamW, Adam or SGD (or fsdp::optim AdamW or "
      "SGD, which keep their state), whose state layout this checkpoint format knows; pass "
      "nullptr to save parameters only");
}

const char* kind_name(OptKind k) {
  switch (k) {
    case OptKind::kAdamW:
      return "adamw";
    case OptKind::kAdam:
      return "adam";
    case OptKind::kSGD:
      return "sgd";
    case OptKind::kNone:
      break;
  }
  return "none";
}

// The state of one parameter shard: row-sharded tensors by suffix, and the step count.
void state_of(torch::optim::Optimizer* opt, OptKind kind, const at::Tensor& shard,
              std::vector<std::pair<std::string, at::Tensor>>* rows, std::optional<int64_t>* step) {
  if (kind == OptKind::kNone) return;
  auto it = opt->state().find(compat::optim_state_key(shard));
  if (it == opt->state().end()) return;
  auto* base = it->second.get();
  if (kind == OptKind::kAdamW) {
    adam_state_out(static_cast<torch::optim::AdamWParamState&>(*base), rows, step);
  } else if (kind == OptKind::kAdam) {
    adam_state_out(static_cast<torch::optim::AdamParamState&>(*base), rows, step);
  } else {
    auto& s = static_cast<torch::optim::SGDParamState&>(*base);
    if (s.momentum_buffer().defined()) rows->emplace_back("momentum_buffer", s.momentum_buffer());
  }
}

void load_optimizer(torch::optim::Optimizer* opt, OptKind kind,
                    const std::vector<ShardInfo>& shards, CheckpointReader& rd,
                    const std::string& where) {
  const Index& idx = rd.index();
  if (idx.optimizer == "none") return;  // parameters-only checkpoint: the optimizer is untouched
  if (idx.optimizer != kind_name(kind)) {
    throw Error(cat(where, ": the checkpoint holds ", idx.optimizer, " state, the optimizer is ",
                    kind_name(kind),
                    "; build the optimizer the run was saved with, or pass "
                    "nullptr to load parameters only"));
  }
  std::map<compat::OptimStateKey, bool> in_opt;  // state key -> amsgrad of its group
  for (const auto& g : opt->param_groups()) {
    for (const auto& p : g.params()) in_opt[compat::optim_state_key(p)] = group_amsgrad(g, kind);
  }
  for (const auto& info : shards) {
    auto key = compat::optim_state_key(info.shard);
    auto it = in_opt.find(key);
    if (it == in_opt.end()) continue;  // not optimized (e.g. frozen)
    if (kind == OptKind::kSGD) {
      const IndexEntry* e = idx.find(info.name + "::momentum_buffer");
      if (!e) {
        opt->state().erase(key);
        continue;
      }
      FSDP_CHECK(e->global_shape == info.global_shape &&
                     e->dtype == st::dtype_name(info.shard.scalar_type()),
                 where, ": optimizer state '", e->name, "' does not match its parameter");
      at::Tensor buf = at::zeros_like(info.shard, at::MemoryFormat::Preserve);
      rd.fill(*e, buf, info.dim, info.row_offset);
      auto s = std::make_unique<torch::optim::SGDParamState>();
      s->momentum_buffer(buf);
      opt->state()[key] = std::move(s);
    } else if (kind == OptKind::kAdamW) {
      adam_state_in<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(
          opt, key, info.shard, info, rd, it->second, where);
    } else {
      adam_state_in<torch::optim::AdamParamState, torch::optim::AdamOptions>(
          opt, key, info.shard, info, rd, it->second, where);
    }
  }
}

}  // namespace fsdp::checkpoint::internal
