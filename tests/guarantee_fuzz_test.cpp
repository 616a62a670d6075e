// The guarantee fuzzer: random training programs (tests/fuzz_graph.h) on N ranks against the
// unsharded model in fp64 at 1e-9, over a drawn transport (shared memory, Gloo point-to-point or
// Gloo's own collectives). Every loss (training, evaluation and grad-mode forwards alike),
// every shard gradient after each synced backward, the clip norm, and every shard after each
// optimizer step must equal the reference, which runs every rank's micro-batches on one
// unsharded model, takes the mean over ranks, clips and steps with the same optimizer; ranks may
// call different blocks.
//
// Many seeds run in one launch of N ranks. A failing seed prints itself ("FUZZ FAILED: seed S
// world N ..."); rerun just it with FSDP_FUZZ_FIRST_SEED=S FSDP_FUZZ_SEEDS=1. For long runs set
// FSDP_FUZZ_SEEDS (seeds per launch) and FSDP_FUZZ_FIRST_SEED.
#include <fsdp/checkpoint.h>
#include <fsdp/gather_transform.h>
#include <fsdp/optim.h>
#include <fsdp/quantized.h>
#include <fsdp/safetensors_torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>
#include <string>

#include "fsdp_test_util.h"
#include "fuzz_graph.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::guarantee_fuzz_test {
namespace {

using namespace fuzz;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

constexpr double kRtol = 1e-9, kAtol = 1e-12;

void expect_close(const Program& p, double got, double want, const std::string& what) {
  EXPECT_NEAR(got, want, p.rtol() * (1 + std::abs(want)) + p.atol()) << what;
}

// LibTorch's optimizer of the program, or (`fused`: the sharded side of Program::fused) the fused
// one of fsdp::optim with the same options.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Program& p,
                                                        std::vector<torch::Tensor> params,
                                                        bool fused = false) {
  if (p.optim == Optim::kSGD) {
    auto o = torch::optim::SGDOptions(p.lr).momentum(p.momentum).weight_decay(p.weight_decay);
    if (fused) return std::make_unique<fsdp::optim::SGD>(params, o);
    return std::make_unique<torch::optim::SGD>(params, o);
  }
  if (p.optim == Optim::kAdam)
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(p.lr).weight_decay(p.weight_decay));
  auto o = torch::optim::AdamWOptions(p.lr).weight_decay(p.weight_decay);
  if (fused) return std::make_unique<fsdp::optim::AdamW>(params, o);
  return std::make_unique<torch::optim::AdamW>(params, o);
}

// What a gather on quantized wire `q` delivers of parameter `t` at world size `world`: each
// rank's rows, padded to ceil(rows / world), encoded and decoded as one part of the wire, cast
// back to the parameter's dtype.
at::Tensor gathered_through_wire(const at::Tensor& t, int world, Quantization q) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const at::Tensor full = t.reshape({rows, -1});
  const int64_t chunk = (rows + world - 1) / world, cols = full.size(1);
  auto padded = torch::zeros({world * chunk, cols}, t.options());
  padded.narrow(0, 0, rows).copy_(full);
  auto out = torch::empty({world * chunk, cols}, torch::kFloat);
  for (int r = 0; r < world; ++r)
    out.narrow(0, r * chunk, chunk)
        .copy_(quantize_round_trip(padded.narrow(0, r * chunk, chunk), q).view({chunk, cols}));
  return out.narrow(0, 0, rows).to(t.scalar_type()).reshape(t.sizes());
}

// What the quantized reduce-scatter's wire makes of one rank's gradients of a group (`grads` in
// the group's order, undefined: zeros): the group's send buffer (each parameter's rows padded to
// ceil(rows / world), one block per destination rank, the parameters in order within a block),
// every block encoded and decoded as a whole, back in each parameter's shape and dtype.
std::vector<at::Tensor> reduced_through_wire(const std::vector<at::Tensor>& params,
                                             const std::vector<at::Tensor>& grads, int world,
                                             Quantization q) {
  std::vector<at::Tensor> padded, decoded;
  std::vector<int64_t> chunks, sizes;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t rows = params[i].dim() == 0 ? 1 : params[i].size(0);
    const int64_t chunk = (rows + world - 1) / world;
    auto g = torch::zeros({world * chunk, params[i].numel() / std::max<int64_t>(rows, 1)},
                          params[i].options());
    if (grads[i].defined()) g.narrow(0, 0, rows).copy_(grads[i].reshape({rows, -1}));
    chunks.push_back(chunk);
    sizes.push_back(chunk * g.size(1));
    decoded.push_back(torch::empty(g.sizes(), torch::kFloat));
    padded.push_back(std::move(g));
  }
  for (int j = 0; j < world; ++j) {
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < params.size(); ++i)
      parts.push_back(padded[i].narrow(0, j * chunks[i], chunks[i]).reshape({-1}));
    const auto block = quantize_round_trip(torch::cat(parts), q).split_with_sizes(sizes);
    for (size_t i = 0; i < params.size(); ++i)
      decoded[i].narrow(0, j * chunks[i], chunks[i]).view({-1}).copy_(block[i]);
  }
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t rows = params[i].dim() == 0 ? 1 : params[i].size(0);
    out.push_back(
        decoded[i].narrow(0, 0, rows).to(params[i].scalar_type()).reshape(params[i].sizes()));
  }
  return out;
}

// The unsharded side: one model that runs every rank's micro-batches. With ignored parameters or
// quantized reductions, one model per rank instead, each running its rank's micro-batches: the
// ignored parameters are each rank's own (its own gradient, its own steps), a quantized wire
// rounds each rank's gradient on its own; the other parameters stay equal across the models.
struct Reference {
  std::vector<Net> nets;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> opts;
  std::vector<std::vector<at::Tensor>> master;  // the weights, while the wire's are in the models

  explicit Reference(const Program& p) {
    const int copies = p.ignore || p.quant_reduce != Quantization::kNone ? p.world : 1;
    for (int k = 0; k < copies; ++k) {
      nets.push_back(Net(p));
      if (k > 0) {
        torch::NoGradGuard no_grad;
        auto first = nets[0]->parameters();
        auto mine = nets[k]->parameters();
        for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_(first[i]);
      }
      opts.push_back(make_optimizer(p, nets[k]->parameters()));
    }
  }
  Net& net(int rank) { return nets[nets.size() == 1 ? 0 : rank]; }

  double loss(const Program& p, const Pass& pass, int rank, int it, int which, bool grad) {
    torch::AutoGradMode mode(grad);
    return net(rank)->forward(input_for(p, rank, it, which), pass, rank).item<double>();
  }
  // Accumulates every rank's gradients of `pass` (sum over ranks; divided by world in mean_grads).
  void backward_all(const Program& p, const Pass& pass, int it, int which) {
    for (int k = 0; k < p.world; ++k)
      net(k)->forward(input_for(p, k, it, which), pass, k).backward();
  }
  // The mean over ranks (or the sum divided by the group's set_gradient_divide_factor), in every
  // model; a trainable parameter no rank gave a gradient keeps what it had (none stays none, a
  // gradient zeroed in place stays zero) and has no entry unless it had one; for an ignored
  // parameter `rank`'s own gradient, absent where that rank never used it.
  GradMap mean_grads(const Program& p, int rank) {
    GradMap out;
    std::vector<torch::OrderedDict<std::string, torch::Tensor>> named;
    for (auto& n : nets) named.push_back(n->named_parameters());
    const auto wired = through_reduce_wire(p, named);
    for (size_t i = 0; i < named[0].size(); ++i) {
      const std::string& name = named[0][i].key();
      if (!named[0][i].value().requires_grad()) continue;
      if (p.ignores(name)) {
        const auto& g = named[nets.size() == 1 ? 0 : rank][i].value().grad();
        if (g.defined()) out[name] = g;
        continue;
      }
      auto sum = torch::zeros_like(named[0][i].value());
      bool any = false;
      for (size_t k = 0; k < named.size(); ++k)
        if (named[k][i].value().grad().defined()) {
          sum.add_(wired.count(name) ? wired.at(name)[k] : named[k][i].value().grad());
          any = true;
        }
      // set_reduce_scatter_unused_params: the reduction of zeros, a defined gradient.
      if (!any && !p.reduce_unused) continue;
      sum.div_(p.divisor(name)).mul_(p.hook_scale(name));
      for (auto& d : named) d[i].value().mutable_grad() = sum.clone();
      out[name] = sum;
    }
    return out;
  }
  // Program::quant_reduce: per parameter of a group with the quantized reduce-scatter (holders
  // and the root), what each model's (rank's) gradient is after the wire; empty without.
  std::map<std::string, std::vector<at::Tensor>> through_reduce_wire(
      const Program& p, const std::vector<torch::OrderedDict<std::string, torch::Tensor>>& named) {
    std::map<std::string, std::vector<at::Tensor>> out;
    if (p.quant_reduce == Quantization::kNone) return out;
    std::map<std::string, std::vector<size_t>> groups;  // group -> its parameters, in order
    std::set<const void*> seen;  // a tensor registered twice is one parameter of its group
    for (size_t i = 0; i < named[0].size(); ++i) {
      const std::string& name = named[0][i].key();
      const std::string g = p.group_of(name);
      if (!p.ignores(name) && g.rfind("on", 0) != 0 &&
          seen.insert(named[0][i].value().unsafeGetTensorImpl()).second)
        groups[g].push_back(i);
    }
    for (const auto& [group, members] : groups) {
      std::vector<at::Tensor> params;
      for (size_t i : members) params.push_back(named[0][i].value());
      for (const auto& model : named) {
        std::vector<at::Tensor> grads;
        for (size_t i : members) grads.push_back(model[i].value().grad());
        const auto wired = reduced_through_wire(params, grads, p.world, p.quant_reduce);
        for (size_t m = 0; m < members.size(); ++m)
          out[named[0][members[m]].key()].push_back(wired[m]);
      }
    }
    return out;
  }
  // Program::quant_gather: the models compute with what the gathers' wire delivers (every
  // parameter but the ignored ones) from here to use_master_weights, which puts the weights
  // back for the optimizer.
  void use_wire_weights(const Program& p) {
    if (p.quant_gather == Quantization::kNone) return;
    torch::NoGradGuard no_grad;
    master.clear();
    for (auto& n : nets) {
      master.emplace_back();
      std::set<const void*> seen;  // a tensor registered twice goes through the wire once
      for (auto& item : n->named_parameters()) {
        master.back().push_back(item.value().detach().clone());
        if (!p.ignores(item.key()) && seen.insert(item.value().unsafeGetTensorImpl()).second)
          item.value().copy_(gathered_through_wire(master.back().back(), p.world, p.quant_gather));
      }
    }
  }
  void use_master_weights() {
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < master.size(); ++k) {
      auto params = nets[k]->parameters();
      for (size_t i = params.size(); i-- > 0;) params[i].copy_(master[k][i]);  // first copy last
    }
    master.clear();
  }
  // As fsdp::clip_grad_norm_: the norm of the reduced gradients, the ignored ones left out.
  double clip(const Program& p, double max_norm) {
    double norm = 0;
    for (auto& n : nets) {
      std::vector<torch::Tensor> ps;
      for (auto& item : n->named_parameters())
        if (item.value().grad().defined() && !p.ignores(item.key())) ps.push_back(item.value());
      norm = torch::nn::utils::clip_grad_norm_(ps, max_norm);
    }
    return norm;
  }
  // Steps every model, then clears the gradients as the sharded side's zero_grad clears the
  // shards' (the optimizer's zero_grad: none on LibTorch 2.x, zeros in place on 1.13), so that a
  // parameter no rank gives a gradient next time keeps exactly what the shard keeps.
  void step(const Program&, ZeroGrad how) {
    for (size_t k = 0; k < nets.size(); ++k) {
      opts[k]->step();
      if (how == ZeroGrad::kOptimizer) opts[k]->zero_grad();
      for (auto& item : nets[k]->named_parameters()) {
        auto& g = item.value().mutable_grad();
        if (how == ZeroGrad::kSetToNone)
          g = torch::Tensor();
        else if (how == ZeroGrad::kZeroInPlace && g.defined())
          g.zero_();
      }
    }
  }
};

// An exact GatherTransform: the shard's own bytes on the wire, decoded into the full parameter's
// dtype (the cast the plain gather makes when it packs). Counts its calls.
struct BytesTransform : GatherTransform {
  explicit BytesTransform(at::ScalarType shard_dtype) : dtype(shard_dtype) {}
  int64_t wire_bytes(int64_t padded_numel) const override {
    return padded_numel * static_cast<int64_t>(c10::elementSize(dtype));
  }
  void pre_all_gather(const at::Tensor& padded_shard, const at::Tensor& wire) override {
    ++encoded;
    wire.view(dtype).copy_(padded_shard);
  }
  void post_all_gather(const at::Tensor& wires, const at::Tensor& padded_rows) override {
    ++decoded;
    padded_rows.copy_(wires.contiguous().view(dtype).view(padded_rows.sizes()));
  }
  at::ScalarType dtype;
  int encoded = 0, decoded = 0;
};

// The communicator over the program's transport: one per transport and rank process, shared by
// the seeds of one launch (a split per seed would connect again each time).
std::shared_ptr<Communicator> communicator(Rank& r, const std::string& transport) {
  if (transport.empty()) return r.world();
  static std::map<std::string, std::shared_ptr<Communicator>> lanes;
  auto& c = lanes[transport];
  if (!c) c = r.lane_over(transport);
  return c;
}

// The sharded side of one rank.
struct ShardedSide {
  fsdp::Sharded<Net> model;
  FSDPModule root;
  std::vector<FSDPModule> blocks;  // per block: its handle (holders only)
  std::unique_ptr<torch::optim::Optimizer> opt;

  // The model's parameter names by tensor, for the mixed-precision override.
  std::shared_ptr<std::map<const void*, std::string>> model_names =
      std::make_shared<std::map<const void*, std::string>>();

  // Over `over` when given (a subgroup: the program must then be plain FSDP over its ranks),
  // else over the program's transport.
  ShardedSide(const Program& p, Rank& r, std::shared_ptr<Communicator> over = nullptr)
      : model(p.deferred ? fsdp::deferred_init([&] { return fsdp::Sharded<Net>{Net(p)}; })
                         : fsdp::Sharded<Net>{Net(p)}) {
    for (auto& item : model->named_parameters())
      (*model_names)[item.value().unsafeGetTensorImpl()] = item.key();
    auto comm = over ? over : communicator(r, p.transport);
    ScopedTransport transport(p.transport);  // the mesh's subgroups use it too
    DeviceMesh mesh = p.replicas > 1 ? init_mesh(comm, p.replicas) : DeviceMesh{};
    auto shard = [&](auto& holder, int reshard, bool checkpointed, std::vector<at::Tensor> ignored,
                     bool root = false) {
      ShardOptions o = options(p, reshard);
      if (root && p.mixed_output) o.mixed_precision.output_dtype = torch::kDouble;
      if (root) o.runtime.broadcast_buffers = p.broadcast_buffers;
      if (root) o.runtime.calls_may_differ = p.declares();
      o.runtime.activation_checkpointing = checkpointed;
      o.ignored_params = std::move(ignored);
      return p.replicas > 1 ? fully_shard(holder, mesh, o) : fully_shard(holder, comm, o);
    };
    auto shard_list = [&](size_t b) {  // blocks b and b + 1 as one group
      ShardOptions o = options(p, p.child_reshard[b]);
      o.runtime.activation_checkpointing = p.checkpointed[b];
      o.ignored_params = ignored_in(p, b);
      for (auto& t : ignored_in(p, b + 1)) o.ignored_params.push_back(t);
      std::vector<ShardedRef> both = {model->blocks[b], model->blocks[b + 1]};
      return p.replicas > 1 ? fully_shard(both, mesh, o) : fully_shard(both, comm, o);
    };
    blocks.resize(model->blocks.size());
    for (size_t b = 0; b < model->blocks.size(); ++b) {
      if (p.modes[b] == BlockMode::kOnUse) {
        // What fully_shard_elements does to each element: the holder stays unattached, so its
        // calls reach forward directly, and the group gathers on first use.
        ShardOptions o = options(p, -1);
        o.ignored_params = ignored_in(p, b);
        detail::fully_shard_impl(model->blocks[b].ptr(), p.replicas > 1 ? mesh.shard : comm,
                                 p.replicas > 1 ? mesh.replicate : nullptr, o,
                                 detail::CallPath::kGatherOnUse);
      } else if (b > 0 && b - 1 < p.listed.size() && p.listed[b - 1]) {
        blocks[b] = blocks[b - 1];  // sharded with the block before, its settings applied
      } else if (p.modes[b] == BlockMode::kHolder) {
        blocks[b] = b < p.listed.size() && p.listed[b] ? shard_list(b)
                                                       : shard(model->blocks[b], p.child_reshard[b],
                                                               p.checkpointed[b], ignored_in(p, b));
        if (!p.divide.empty() && p.divide[b] > 0) blocks[b].set_gradient_divide_factor(p.divide[b]);
        if (b < p.no_backward_unshard.size() && p.no_backward_unshard[b])
          blocks[b].set_unshard_in_backward(false);
        if (!p.hook.empty() && p.hook[b] > 0) blocks[b].set_all_reduce_hook(hook(comm, p.hook[b]));
        if (b < p.keep_storage.size() && p.keep_storage[b])
          blocks[b].set_keep_unsharded_storage(true);
        if (b < p.custom.size()) set_custom(blocks[b], p.custom[b]);
      }
    }
    std::vector<at::Tensor> root_ignored;
    for (auto& item : model->named_parameters(/*recurse=*/false))
      if (p.ignores(item.key())) root_ignored.push_back(item.value());
    for (size_t b = 0; b < model->blocks.size(); ++b)
      if (p.modes[b] == BlockMode::kInRoot)
        for (auto& t : ignored_in(p, b)) root_ignored.push_back(t);
    root = shard(model, p.root_reshard, false, std::move(root_ignored), /*root=*/true);
    if (!p.divide.empty() && p.divide.back() > 0) root.set_gradient_divide_factor(p.divide.back());
    if (!p.hook.empty() && p.hook.back() > 0) root.set_all_reduce_hook(hook(comm, p.hook.back()));
    if (!p.keep_storage.empty() && p.keep_storage.back()) root.set_keep_unsharded_storage(true);
    if (p.custom.size() > p.kinds.size()) set_custom(root, p.custom.back());
    if (p.reduce_unused) root.set_reduce_scatter_unused_params(true);
    if (p.quant_reduce != Quantization::kNone) {
      std::vector<FSDPModule> groups;
      for (size_t b = 0; b < model->blocks.size(); ++b)
        if (p.modes[b] == BlockMode::kHolder) groups.push_back(blocks[b]);
      groups.push_back(root);
      set_quantized_reduce_scatter(groups, p.quant_reduce);
    }
    if (p.deferred) fsdp::materialize(model);
    opt = make_optimizer(p, root.parameters(), p.fused);
  }
  // The parameters of block b that the program ignores.
  std::vector<at::Tensor> ignored_in(const Program& p, size_t b) {
    std::vector<at::Tensor> out;
    for (auto& item : model->blocks[b]->named_parameters())
      if (p.ignores("b" + std::to_string(b) + "." + item.key())) out.push_back(item.value());
    return out;
  }
  // Custom collectives, exact and asynchronous (they issue and return, as the contract asks): an
  // all-gather as an all-reduce of the output (fsdp_test_util.h), and a reduce-scatter as an
  // all-reduce of the whole input in place (this rank's block, the output, is reduced with the
  // others). Each counts its calls.
  struct AllReduceReduceScatter : ReduceScatter {
    int calls = 0;
    Work operator()(const at::Tensor& out, const at::Tensor& in, ReduceOp op,
                    Communicator& g) override {
      ++calls;
      EXPECT_EQ(out.data_ptr(), in.narrow(0, g.rank() * out.numel(), out.numel()).data_ptr());
      return g.all_reduce(in, op);
    }
  };
  std::vector<std::shared_ptr<AllReduceAllGather>> custom_gathers;
  std::vector<std::shared_ptr<AllReduceReduceScatter>> custom_reduces;
  void set_custom(FSDPModule& m, int which) {
    if (which & 1) {
      custom_gathers.push_back(std::make_shared<AllReduceAllGather>());
      m.set_custom_all_gather(custom_gathers.back());
    }
    if (which & 2) {
      custom_reduces.push_back(std::make_shared<AllReduceReduceScatter>());
      m.set_custom_reduce_scatter(custom_reduces.back());
    }
  }
  // An all-reduce hook that issues a collective of its own (every rank's 1, summed) and scales.
  static std::function<void(at::Tensor&)> hook(std::shared_ptr<Communicator> comm, double scale) {
    return [comm, scale](at::Tensor& block) {
      auto ones = torch::ones({1}, torch::kDouble);
      comm->all_reduce(ones, ReduceOp::kSum).wait();
      block.mul_(scale * ones.item<double>() / comm->size());
    };
  }
  ShardOptions options(const Program& p, int reshard) const {
    ShardOptions o;
    o.debug.audit = p.audit;
    o.runtime.max_unsharded_groups = p.max_unsharded_groups;
    o.runtime.verify_collectives = p.verify_period > 0;
    o.runtime.verify_period = std::max(p.verify_period, 1);
    if (p.mixed) {
      o.mixed_precision.param_dtype = torch::kFloat;
      o.mixed_precision.reduce_dtype = p.mixed == 1 ? torch::kFloat : torch::kDouble;
    }
    if (p.keep)  // the names it gets are relative to the module sharded: look up the model's
      o.mixed_precision.param_dtype_override_fn =
          [&p, names = model_names](const std::string&,
                                    const at::Tensor& t) -> std::optional<at::ScalarType> {
        if (p.keeps(names->at(t.unsafeGetTensorImpl()))) return t.scalar_type();
        return std::nullopt;
      };
    if (p.offload) o.offload_policy = CPUOffloadPolicy{p.offload == 1};
    if (p.placement)
      o.shard_placement_fn = [placement = p.placement](const std::string& n, const at::Tensor& t) {
        return shard_dim(placement, n, t);
      };
    if (p.quant_gather != Quantization::kNone)
      o.gather_transform_fn = quantized_gather(p.quant_gather);
    else if (p.transform)  // names relative to the module: look up the model's
      o.gather_transform_fn = [&p, names = model_names](
                                  const std::string&,
                                  const at::Tensor& t) -> std::shared_ptr<GatherTransform> {
        if (!p.transforms(names->at(t.unsafeGetTensorImpl()))) return nullptr;
        return std::make_shared<BytesTransform>(t.scalar_type());
      };
    if (reshard >= 2)
      o.reshard_after_forward = reshard;  // hpZ: a world of `reshard` ranks
    else if (reshard >= 0)
      o.reshard_after_forward = reshard == 1;
    return o;
  }
  void zero_grad(ZeroGrad how) {
    switch (how) {
      case ZeroGrad::kSetToNone:
        for (auto& s : root.parameters()) s.mutable_grad() = torch::Tensor();
        break;
      case ZeroGrad::kZeroInPlace:
        for (auto& s : root.parameters())
          if (s.grad().defined()) s.mutable_grad().zero_();
        break;
      case ZeroGrad::kOptimizer:
        opt->zero_grad();
        break;
    }
  }
};

// w.a * t + w.b in place, outside autograd, as the write asks.
void write_to(const at::Tensor& t, const Write& w) {
  if (w.kind == WriteKind::kData) {
    t.data().mul_(w.a).add_(w.b);
  } else {
    torch::NoGradGuard no_grad;
    t.mul_(w.a).add_(w.b);
  }
}

// The user's writes of iteration `it` at position `at`: each shard of a parameter the program
// writes to, and that parameter's full tensor in every reference model (an elementwise map: the
// shard's rows of the written full tensor are the written shard). The reference writes its
// weights, not what a quantized wire made of them.
void run_writes(const Program& p, ShardedSide& s, Reference& ref, int it, int at) {
  bool any = false;
  for (const auto& w : p.iterations[it].writes) any = any || w.at == at;
  if (!any) return;
  const bool wired = !ref.master.empty();
  ref.use_master_weights();
  for (const auto& w : p.iterations[it].writes) {
    if (w.at != at) continue;
    for (const auto& shard : s.root.shards())
      if (p.writes_to(shard.name)) write_to(shard.shard, w);
    for (auto& n : ref.nets) {
      auto named = n->named_parameters();
      for (const auto& shard : s.root.shards())
        if (p.writes_to(shard.name)) write_to(named[shard.name], w);
    }
  }
  if (wired) ref.use_wire_weights(p);
}

// The extra forwards of iteration `it` at position `at`, on both sides.
void run_extras(const Program& p, Rank& r, ShardedSide& s, Reference& ref, int it, int at) {
  const auto& extras = p.iterations[it].extras;
  for (size_t e = 0; e < extras.size(); ++e) {
    if (extras[e].at != at) continue;
    const bool grad = extras[e].kind == Extra::kGrad;
    const int which = 100 + static_cast<int>(e);
    double got;
    {
      torch::AutoGradMode mode(grad);
      got = s.model(input_for(p, r.rank, it, which), extras[e].pass, r.rank).item<double>();
    }
    expect_close(p, got, ref.loss(p, extras[e].pass, r.rank, it, which, grad),
                 std::string(grad ? "grad-mode" : "evaluation") + " forward at " +
                     std::to_string(at) + " of iteration " + std::to_string(it));
  }
}

void run_iteration(const Program& p, Rank& r, ShardedSide& s, Reference& ref, int it) {
  const Iteration& iter = p.iterations[it];
  const int micro = static_cast<int>(iter.micro.size());
  ref.use_wire_weights(p);
  for (int m = 0; m < micro; ++m) {
    SCOPED_TRACE("iteration " + std::to_string(it) + " micro-batch " + std::to_string(m));
    run_writes(p, s, ref, it, m);
    run_extras(p, r, s, ref, it, m);
    const bool last = m == micro - 1;
    const bool sync = p.accumulate == Accumulate::kSyncLast   ? last
                      : p.accumulate == Accumulate::kFinalize ? false
                                                              : true;
    s.root.set_requires_gradient_sync(sync);
    s.root.set_requires_all_reduce(p.accumulate != Accumulate::kAllReduceLast || last);
    if (m == 0 && iter.async_unshard >= 0) {
      auto handle = s.blocks[iter.async_unshard].unshard(/*async_op=*/true);
      if (iter.async_wait) handle.wait();
    }
    auto loss = s.model(input_for(p, r.rank, it, m), iter.micro[m], r.rank);
    expect_close(p, loss.item<double>(), ref.loss(p, iter.micro[m], r.rank, it, m, false), "loss");
    loss.backward();
    ref.backward_all(p, iter.micro[m], it, m);
  }
  if (p.accumulate == Accumulate::kFinalize) {
    s.root.set_requires_gradient_sync(true);
    s.root.finalize_backward();
  }
  EXPECT_EQ(s.root.memory_stats().unsharded_bytes, 0) << "gathered after backward";
  run_writes(p, s, ref, it, micro);
  run_extras(p, r, s, ref, it, micro);
  SCOPED_TRACE("iteration " + std::to_string(it) + " after its micro-batches");
  auto mean = ref.mean_grads(p, r.rank);
  EXPECT_GT(expect_shard_grads(s.root, mean, p.rtol(), p.atol(), p.mixed != 0,
                               /*absent_means_none=*/true),
            0);
  if (iter.clip > 0)
    expect_close(p, fsdp::clip_grad_norm_(s.root, iter.clip), ref.clip(p, iter.clip),
                 "clip_grad_norm_'s total norm");
  s.opt->step();
  ref.use_master_weights();
  ref.step(p, iter.zero);
  s.zero_grad(iter.zero);
  run_writes(p, s, ref, it, micro + 1);
  expect_shards_equal(s.root, *ref.net(r.rank), p.rtol(), p.atol(), p.mixed != 0);
  ref.use_wire_weights(p);
  run_extras(p, r, s, ref, it, micro + 1);
  ref.use_master_weights();
}

// The reference and this rank's sharded side, each built right after seeding torch with `seed`
// (members are built in declaration order), so both start from the same weights.
struct Sides {
  struct Seed {
    explicit Seed(uint64_t s) { torch::manual_seed(static_cast<int64_t>(s)); }
  };
  Seed seed_reference;
  Reference ref;
  Seed seed_sharded;
  ShardedSide sharded;
  Sides(const Program& p, Rank& r, uint64_t seed)
      : seed_reference(seed), ref(p), seed_sharded(seed), sharded(p, r) {}
};

// Program::checkpoint, after the last step: a checkpoint of every shard and the optimizer state,
// consolidated by rank 0 into one file whose tensors equal the reference's (an ignored parameter:
// rank 0's copy, which the checkpoint keeps), then loaded by the first world - 1 ranks into a
// fresh model sharded over them alone: its shards equal the reference's. Ignored parameters of
// every shape (the 0-d root_bias, 1-d biases, views into one buffer) go through all of it.
void checkpoint_round_trip(const Program& p, Rank& r, ShardedSide& s, Reference& ref) {
  const std::string dir =
      "/tmp/fsdp_fuzz_ckpt_" + std::to_string(::getppid()) + "_" + std::to_string(p.seed);
  auto world = communicator(r, p.transport);
  if (r.rank == 0) std::filesystem::remove_all(dir);
  world->barrier().wait();
  const std::string saved =
      fsdp::checkpoint::save(dir, s.root, s.opt.get(), fsdp::checkpoint::TrainState{}, *world);
  if (r.rank == 0) {
    const std::string file = dir + "/full.safetensors";
    fsdp::checkpoint::consolidate(saved, file);
    auto f = safetensors::File::open(file);
    for (const auto& item : ref.net(0)->named_parameters())
      EXPECT_TRUE(
          torch::allclose(safetensors::read_tensor(*f, item.key()), item.value(), kRtol, kAtol))
          << "consolidated " << item.key();
    for (const auto& item : ref.net(0)->named_buffers())
      EXPECT_TRUE(torch::equal(safetensors::read_tensor(*f, item.key()), item.value()))
          << "consolidated buffer " << item.key();
  }
  // Another world size: plain FSDP over the first world - 1 ranks (hpZ's worlds cleared).
  Program q = p;
  q.world = p.world - 1;
  q.replicas = 1;
  q.root_reshard = std::min(q.root_reshard, 1);
  for (auto& k : q.child_reshard) k = std::min(k, 1);
  std::vector<int> first(q.world);
  for (int i = 0; i < q.world; ++i) first[i] = i;
  if (r.rank < q.world) {
    static std::map<std::pair<std::string, int>, std::shared_ptr<Communicator>> smaller;
    auto& sub = smaller[{p.transport, q.world}];
    if (!sub) {
      ScopedTransport transport(p.transport);
      sub = world->subgroup("fuzz.smaller" + std::to_string(q.world), first);
    }
    torch::manual_seed(static_cast<int64_t>(p.seed) + 7);  // other initial values
    ShardedSide fresh(q, r, sub);
    fsdp::checkpoint::load(saved, fresh.root, fresh.opt.get(), *sub);
    SCOPED_TRACE("loaded at world size " + std::to_string(q.world));
    expect_shards_equal(fresh.root, *ref.net(0), kRtol, kAtol);
  }
  world->barrier().wait();
  if (r.rank == 0) std::filesystem::remove_all(dir);
}

// One program on this rank: returns false when it failed (the caller stops: collectives may be
// out of step after a failure).
bool run_program(Rank& r, const Program& p) {
  const uint64_t seed = p.seed;
  SCOPED_TRACE(p.describe());
  const bool had_failure = ::testing::Test::HasFailure();
  try {
    Sides both(p, r, seed);
    auto& ref = both.ref;
    auto& s = both.sharded;
    for (int it = 0; it < static_cast<int>(p.iterations.size()); ++it)
      run_iteration(p, r, s, ref, it);
    if (p.checkpoint) checkpoint_round_trip(p, r, s, ref);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  if (::testing::Test::HasFailure() && !had_failure) {
    std::cerr << "FUZZ FAILED: " << p.describe() << " (rank " << r.rank << ")\n";
    return false;
  }
  return true;
}

struct FuzzRange {
  int world;
  uint64_t first_seed;
  int64_t seeds;
};

class GuaranteeFuzz : public ::testing::TestWithParam<FuzzRange> {};

TEST_P(GuaranteeFuzz, RandomProgramsMatchTheUnshardedModel) {
  const FuzzRange range = GetParam();
  const uint64_t first = static_cast<uint64_t>(
      env_int("FSDP_FUZZ_FIRST_SEED", static_cast<int64_t>(range.first_seed)));
  const int64_t seeds = env_int("FSDP_FUZZ_SEEDS", range.seeds);
  RunOptions opts;
  opts.timeout = std::chrono::seconds(120 + 3 * seeds);
  opts.collective_timeout_s = 30;
  run_ranks(
      range.world,
      [&](Rank& r) {
        int64_t done = 0;
        for (int64_t i = 0; i < seeds; ++i, ++done)
          if (!run_program(r, make_program(first + static_cast<uint64_t>(i), r.size))) break;
        if (r.rank == 0) std::cout << "fuzz: " << done << " seeds passed\n";
      },
      opts);
}

// 310 seeds in the suite: 150 at world size 2, 100 at 3, 60 at 4 (four ranks on this machine's
// two cores: slower launches), in launches of 50 or 30.
INSTANTIATE_TEST_SUITE_P(Seeds, GuaranteeFuzz,
                         ::testing::Values(FuzzRange{2, 0, 50}, FuzzRange{2, 50, 50},
                                           FuzzRange{2, 100, 50}, FuzzRange{3, 1000, 50},
                                           FuzzRange{3, 1050, 50}, FuzzRange{4, 2000, 30},
                                           FuzzRange{4, 2030, 30}),
                         [](const auto& info) {
                           return "world" + std::to_string(info.param.world) + "_seeds" +
                                  std::to_string(info.param.first_seed);
                         });

// ---------------------------------------------------------------------------------------------
// One hand-written program per hole the fuzzer's earlier generator missed, each by its outcome
// against the unsharded model (or by its message). Each fails with its fix reverted.
// ---------------------------------------------------------------------------------------------
Program base_program(int world, std::vector<BlockKind> kinds) {
  Program p;
  p.seed = 77;
  p.world = world;
  p.audit = false;
  for (auto k : kinds) {
    p.kinds.push_back(k);
    p.rows.push_back(3);
    p.modes.push_back(BlockMode::kHolder);
    p.child_reshard.push_back(-1);
    p.checkpointed.push_back(false);
  }
  return p;
}

// Every rank: the same calls and loss terms, nothing detached.
Pass same_pass(int world, std::vector<Call> calls, std::vector<int> terms) {
  Pass pass;
  for (int r = 0; r < world; ++r) {
    pass.calls.push_back(calls);
    RankChoice rc;
    rc.detach.assign(calls.size(), 0);
    rc.loss_terms = terms;
    pass.ranks.push_back(rc);
  }
  return pass;
}

void expect_program_passes(const Program& p) {
  run_ranks(p.world, [&](Rank& r) { EXPECT_TRUE(run_program(r, p)); });
}

// Finding 1: an evaluation forward before optimizer.step() left the root gathered; SGD writes the
// shards through .data() on LibTorch 1.13 (no version bump), so the next forward ran on the
// values from before the step. Staleness is now decided from the shards' values.
TEST(GuaranteeFindings, AForwardBeforeTheStepNeverLeavesStaleValuesForSGD) {
  Program p = base_program(2, {BlockKind::kTied});
  p.optim = Optim::kSGD;
  for (int it = 0; it < 3; ++it) {
    Iteration iter;
    iter.micro.push_back(same_pass(2, {{0, 0}}, {1, 2}));
    iter.extras.push_back(ExtraForward{1, Extra::kEval, same_pass(2, {{0, 0}}, {2})});
    iter.extras.push_back(ExtraForward{1, Extra::kGrad, same_pass(2, {{0, 0}}, {1})});
    p.iterations.push_back(iter);
  }
  expect_program_passes(p);
}

// Finding 2: a checkpointed block called twice, whose outputs ignore its input, the first call
// reaching the loss only through the second call's input, after a no-sync micro-batch.
TEST(GuaranteeFindings, CheckpointedRepeatedCallsWithAccumulationCountEachMicroBatchOnce) {
  Program p = base_program(2, {BlockKind::kIgnoresInput, BlockKind::kTied});
  p.checkpointed = {true, false};
  p.anchor_loss = false;
  for (int it = 0; it < 2; ++it) {
    Iteration iter;
    for (int m = 0; m < 2; ++m)
      iter.micro.push_back(same_pass(2, {{0, 0}, {0, 1}, {1, 4}}, {4, 7}));
    p.iterations.push_back(iter);
  }
  expect_program_passes(p);
}

// Finding 3: `h = a(x) + 1; y = ip(h); loss(y, h)` with ip modifying its input in place: the
// caller's tensor now takes the in-place op's history, as without sharding.
TEST(GuaranteeFindings, AModuleThatModifiesItsInputInPlaceGivesExactGradients) {
  for (int world : {2, 3}) {
    Program p = base_program(world, {BlockKind::kTied, BlockKind::kInPlace});
    Iteration iter;
    // Call 1 (in place) takes call 0's output + 1 (the net's own value); values 4, 5 are its
    // outputs and 6 its input as it left it, which the loss uses again.
    iter.micro.push_back(same_pass(world, {{0, 0}, {1, 1}}, {4, 6}));
    p.iterations = {iter, iter};
    expect_program_passes(p);
  }
}

// A leaf that requires grad, modified in place inside a sharded module's forward, is refused as
// LibTorch refuses it without sharding, naming the module.
TEST(GuaranteeFindings, AnInPlaceChangeOfALeafInputIsRefusedByName) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Block> b{Block(BlockKind::kInPlace, 3)};
    fully_shard(b, r.world());
    auto x = torch::randn({3, kWidth}, torch::kDouble).requires_grad_(true);
    expect_error([&] { b(x); }, {"modified its tensor input #0 in place", "leaf", "x.clone()"});
  });
}

// The same module under activation checkpointing: the recomputation would start from the changed
// input, so the first run's in-place change is refused by name (never a silent wrong gradient).
TEST(GuaranteeFindings, ACheckpointedModuleThatModifiesItsInputIsRefusedByName) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Block> b{Block(BlockKind::kInPlace, 3)};
    ShardOptions o;
    o.runtime.activation_checkpointing = true;
    fully_shard(b, r.world(), o);
    auto x = torch::randn({3, kWidth}, torch::kDouble).requires_grad_(true) + 1;
    expect_error([&] { b(x); }, {"checkpointed forward modified its tensor input #0 in place",
                                 "x.clone()", "activation_checkpointing off"});
  });
}

// Finding 4: a block left in the root's group whose frozen weight reads a child's output (so the
// node reading it runs after every gradient of the root's own), with activation checkpointing
// on the child: the root was resharded too early (a raw "setStorage ... out of bounds" or the
// guard's error). Groups containing other sharded modules now reshard in the final callback.
TEST(GuaranteeFindings, AGroupSpanningChildrenStaysGatheredUntilItsLastNodeRan) {
  Program p = base_program(2, {BlockKind::kBranch, BlockKind::kFrozenTied});
  p.checkpointed = {true, false};
  p.modes = {BlockMode::kHolder, BlockMode::kInRoot};
  Iteration iter;
  // The loss reads only b1's frozen branch: the node that needs b1.wb runs after root_scale's
  // gradient, the root's only one, and leads to b0's gradients.
  Pass pass = same_pass(2, {{0, 0}, {1, 1}}, {5});
  for (auto& rc : pass.ranks) rc.use_root_w = false;  // the root's own gradient comes first
  iter.micro.push_back(pass);
  p.iterations = {iter, iter};
  expect_program_passes(p);
}

// Found by fuzz seed 500994 (N = 2): the same for a group whose module holds trainable ignored
// parameters. b1, left in the root's group, is called twice; its second call's frozen branch reads
// b1.wb and leads only to the ignored b1.wa and b1.ba (through the first call's output): that node
// runs after every gradient the root's group tracks, and the group was resharded before it (the
// guard's "whose full storage is freed"). Such groups now reshard in the final callback too.
TEST(GuaranteeFindings, AGroupWithTrainableIgnoredParametersStaysGatheredUntilItsLastNodeRan) {
  Program p = base_program(2, {BlockKind::kTied, BlockKind::kFrozenTied});
  p.modes = {BlockMode::kInRoot, BlockMode::kInRoot};
  for (p.ignore = 1; !(p.ignores("b1.wa") && p.ignores("b1.ba") && !p.ignores("b1.wb") &&
                       !p.ignores("root_scale") && !p.ignores("root_bias"));)
    ++p.ignore;
  Iteration iter;
  // Value 1 is b1's first output (from the ignored weights), value 5 its second call's frozen
  // branch on it; the root's input projection is not used, so no input-side node bounds the pass.
  Pass pass = same_pass(2, {{1, 0}, {1, 1}}, {5});
  for (auto& rc : pass.ranks) rc.use_root_w = false;
  iter.micro.push_back(pass);
  p.iterations = {iter, iter};
  expect_program_passes(p);
}

// Finding 5: ranks calling different blocks of equal size, audit off, exchanged the wrong groups'
// bytes (relative error 2-4); then every rank stopped with an error. Now they train exactly.
TEST(GuaranteeFindings, RanksCallingDifferentModulesTrainExactlyWithTheAuditOff) {
  Program p = base_program(2, {BlockKind::kTied, BlockKind::kTied});
  Iteration iter;
  Pass pass = same_pass(2, {{0, 0}, {1, 1}}, {1, 4});
  pass.calls[1] = {{1, 0}, {0, 1}};  // rank 1 calls them in the other order
  iter.micro.push_back(pass);
  p.iterations = {iter, iter};
  expect_program_passes(p);
}

// Finding 6: a module that no rank called in a step got a zero gradient (its group reduced
// zeros), so Adam, AdamW and SGD with momentum or weight decay moved its parameters where the
// unsharded model, whose parameters keep no gradient, leaves them. Three blocks, the middle one
// called by no rank in the second iteration, each optimizer, zero_grad every way (the optimizer's:
// none on LibTorch 2.x); and that group's reduce-scatter is skipped (a counting custom one).
Program three_blocks_skipping_the_middle(int world, Optim optim, ZeroGrad zero) {
  Program p = base_program(world, {BlockKind::kTied, BlockKind::kTied, BlockKind::kBranch});
  p.optim = optim;
  p.lr = optim == Optim::kSGD ? 0.1 : 0.01;
  p.momentum = optim == Optim::kSGD ? 0.9 : 0;
  p.weight_decay = 0.05;
  for (int it = 0; it < 3; ++it) {
    Iteration iter;
    iter.micro.push_back(it == 1 ? same_pass(world, {{0, 0}, {2, 1}}, {4, 5})
                                 : same_pass(world, {{0, 0}, {1, 1}, {2, 4}}, {7, 8}));
    iter.zero = zero;
    p.iterations.push_back(iter);
  }
  return p;
}

TEST(GuaranteeFindings, AModuleNoRankCalledIsNotSteppedByTheOptimizer) {
  for (int world : {2, 3})
    for (Optim optim : {Optim::kAdam, Optim::kAdamW, Optim::kSGD})
      for (ZeroGrad zero : {ZeroGrad::kOptimizer, ZeroGrad::kZeroInPlace, ZeroGrad::kSetToNone}) {
        SCOPED_TRACE(detail::cat("world ", world, " optimizer ", static_cast<int>(optim),
                                 " zero_grad ", static_cast<int>(zero)));
        Program p = three_blocks_skipping_the_middle(world, optim, zero);
        p.custom = {0, 2, 0, 0};  // block 1's reduce-scatters, counted
        run_ranks(world, [&](Rank& r) {
          Sides both(p, r, p.seed);
          for (int it = 0; it < 3; ++it) run_iteration(p, r, both.sharded, both.ref, it);
          ASSERT_EQ(both.sharded.custom_reduces.size(), 1u);
          EXPECT_EQ(both.sharded.custom_reduces[0]->calls, 2) << "the unused step reduced it";
        });
      }
}

// FSDP2's set_reduce_scatter_unused_params(true): every trainable parameter gets the reduction,
// zeros where no rank had a gradient (the reference zero-fills them).
TEST(GuaranteeFindings, ReduceScatterUnusedParamsGivesZerosAndReducesEveryGroup) {
  Program p = three_blocks_skipping_the_middle(2, Optim::kAdamW, ZeroGrad::kOptimizer);
  p.reduce_unused = true;
  p.custom = {0, 2, 0, 0};
  run_ranks(2, [&](Rank& r) {
    Sides both(p, r, p.seed);
    for (int it = 0; it < 3; ++it) run_iteration(p, r, both.sharded, both.ref, it);
    EXPECT_EQ(both.sharded.custom_reduces[0]->calls, 3);
  });
}

// Finding 7: a 0-d parameter among ignored_params made every checkpoint unusable (the file held
// it as shape [], the index as one row). Ignored parameters of every shape: the 0-d root_bias,
// 1-d biases, views into one buffer, through a checkpoint saved, consolidated and loaded at another
// world size, against the reference.
TEST(GuaranteeFindings, IgnoredParametersOfEveryShapeRoundTripThroughCheckpoints) {
  Program p = base_program(3, {BlockKind::kTied, BlockKind::kIgnoresInput});
  p.layout = {Layout::kSharedBuffer, Layout::kOwn};
  p.optim = Optim::kAdam;
  p.lr = 0.01;
  p.checkpoint = true;
  for (p.ignore = 1; !(p.ignores("root_bias") && p.ignores("b0.ba") && p.ignores("b0.wa"));)
    ++p.ignore;  // the first salt that ignores the 0-d one and both views
  for (int it = 0; it < 2; ++it) {
    Iteration iter;
    iter.micro.push_back(same_pass(3, {{0, 0}, {1, 1}}, {1, 4}));
    p.iterations.push_back(iter);
  }
  expect_program_passes(p);
}

// ---------------------------------------------------------------------------------------------
// Ranks that call different sharded modules ([Note: calls that differ between ranks]): every
// pattern against the unsharded model (mean over ranks, zeros where a rank did not call).
// ---------------------------------------------------------------------------------------------
// A pass in which rank r makes calls[r] (each on the previous call's first output) and puts every
// call's first output in its loss.
Pass per_rank_pass(const std::vector<std::vector<int>>& blocks) {
  Pass pass;
  for (const auto& bs : blocks) {
    std::vector<Call> calls;
    RankChoice rc;
    for (size_t c = 0; c < bs.size(); ++c) {
      calls.push_back(Call{bs[c], c == 0 ? 0 : 1 + 3 * static_cast<int>(c - 1)});
      rc.loss_terms.push_back(1 + 3 * static_cast<int>(c));
    }
    rc.detach.assign(bs.size(), 0);
    pass.calls.push_back(calls);
    pass.ranks.push_back(rc);
  }
  return pass;
}

Program different_calls_program(int world, int blocks, std::vector<Pass> micro) {
  Program p = base_program(world, std::vector<BlockKind>(blocks, BlockKind::kTied));
  p.optim = Optim::kAdamW;
  p.lr = 0.01;
  Iteration iter;
  iter.micro = std::move(micro);
  p.iterations = {iter, iter};
  return p;
}

// The same decision with accumulation (used in one micro-batch only, or in none),
// finalize_backward, HSDP (every micro-batch reduce-scatters, the last all-reduces), hpZ and ranks
// calling different modules (used on rank 0 only: the mean with the others' zeros; then on no
// rank).
TEST(GuaranteeFindings, AModuleNoRankCalledKeepsItsGradientInEveryMode) {
  auto program = [](int world, Accumulate accumulate) {
    Program p = three_blocks_skipping_the_middle(world, Optim::kAdam, ZeroGrad::kOptimizer);
    p.accumulate = accumulate;
    for (auto& iter : p.iterations) iter.micro.push_back(iter.micro[0]);
    p.iterations[0].micro[1] = same_pass(world, {{0, 0}, {2, 1}}, {4, 5});  // b1 in micro 0 only
    return p;
  };
  expect_program_passes(program(2, Accumulate::kSyncLast));
  expect_program_passes(program(3, Accumulate::kFinalize));
  Program hsdp = program(4, Accumulate::kAllReduceLast);
  hsdp.replicas = 2;
  hsdp.audit = true;
  expect_program_passes(hsdp);
  Program hpz = program(4, Accumulate::kSyncLast);
  hpz.child_reshard = {2, 2, 2};
  hpz.root_reshard = 2;
  expect_program_passes(hpz);
  Program differ = program(2, Accumulate::kSyncEvery);
  differ.iterations[0].micro[0] = per_rank_pass({{0, 1, 2}, {0, 2}});
  differ.iterations[0].micro[1] = per_rank_pass({{0, 2}, {2, 0}});
  differ.audit = true;
  expect_program_passes(differ);
}

// An expert layer: rank 0 calls a1, a2 and rank 1 b1, b2 (all of equal size); the next
// iteration the other way round within each pair.
TEST(DifferentCalls, DisjointBranchesPerRank) {
  Program p = different_calls_program(2, 4, {per_rank_pass({{0, 1}, {2, 3}})});
  p.iterations[1].micro = {per_rank_pass({{1, 0}, {3, 2}})};
  expect_program_passes(p);
}

// Different repeat counts, modules called on some ranks only, a rank calling one block alone.
TEST(DifferentCalls, RepeatCountsAndModulesOnSomeRanksOnly) {
  Program p = different_calls_program(3, 3, {per_rank_pass({{0, 0, 0}, {0, 1}, {2}})});
  p.kinds = {BlockKind::kTied, BlockKind::kBranch, BlockKind::kIgnoresInput};
  p.rows = {3, 5, 2};
  expect_program_passes(p);
}

// Blocks kept gathered after forward and micro-batches whose calls differ: groups held on some
// ranks only, gathered again where needed and served where held.
TEST(DifferentCalls, KeptGatheredBlocksAcrossMicroBatches) {
  Program p = different_calls_program(
      2, 3,
      {per_rank_pass({{0, 1}, {2}}), per_rank_pass({{2, 2}, {1, 0}}), per_rank_pass({{1}, {1}})});
  p.child_reshard = {0, 0, 1};
  p.root_reshard = 0;
  p.max_unsharded_groups = 2;
  for (auto& it : p.iterations)
    it.extras.push_back(ExtraForward{1, Extra::kEval, per_rank_pass({{0}, {2, 1}})});
  expect_program_passes(p);
  p.accumulate = Accumulate::kSyncEvery;
  p.optim = Optim::kSGD;
  expect_program_passes(p);
}

// HSDP (2 replicas of 2): each replica's ranks call their own blocks; the all-reduces still agree.
TEST(DifferentCalls, UnderHsdp) {
  Program p = different_calls_program(
      4, 4, {per_rank_pass({{0, 1}, {2}, {3, 3}, {1, 2, 0}}), per_rank_pass({{3}, {0}, {1}, {2}})});
  p.replicas = 2;
  p.accumulate = Accumulate::kAllReduceLast;
  expect_program_passes(p);
}

// Elements gathered on use and activation checkpointing, with calls that differ.
TEST(DifferentCalls, ElementsAndCheckpointedBlocks) {
  Program p = different_calls_program(
      2, 3, {per_rank_pass({{0, 2}, {1}}), per_rank_pass({{1, 1}, {2, 0}})});
  p.modes = {BlockMode::kOnUse, BlockMode::kHolder, BlockMode::kHolder};
  p.checkpointed = {false, true, false};
  p.iterations[0].clip = 0.5;
  expect_program_passes(p);
}

// A state dict and a checkpoint after calls that differ, with blocks left gathered on some ranks
// only (an evaluation forward): the full parameters equal the unsharded model's, and a fresh model
// loaded from the checkpoint trains on exactly.
TEST(DifferentCalls, StateDictAndCheckpointAfterDifferentCalls) {
  Program p = different_calls_program(2, 3, {per_rank_pass({{0, 1}, {2}})});
  p.child_reshard = {0, 0, 0};
  p.root_reshard = 0;
  const Pass eval = per_rank_pass({{0}, {2, 1}});
  const char* kDir = "FSDP_DIFFERENT_CALLS_DIR";
  std::string dir;
  if (const char* d = std::getenv(kDir)) {
    dir = d;
  } else {
    dir = (std::filesystem::temp_directory_path() /
           ("fsdp_different_calls_" + std::to_string(::getpid())))
              .string();
    std::filesystem::remove_all(dir);
  }
  RunOptions o;
  o.env[kDir] = dir;
  run_ranks(
      2,
      [&](Rank& r) {
        Sides both(p, r, p.seed);
        auto& ref = both.ref;
        auto& s = both.sharded;
        run_iteration(p, r, s, ref, 0);
        {
          torch::NoGradGuard no_grad;
          s.model(input_for(p, r.rank, 0, 50), eval, r.rank);
        }
        const auto sd = fsdp::full_state_dict(s.root);
        for (const auto& item : ref.net(r.rank)->named_parameters()) {
          ASSERT_TRUE(sd.contains(item.key())) << item.key();
          EXPECT_TRUE(torch::allclose(sd[item.key()], item.value(), kRtol, kAtol)) << item.key();
        }
        const auto saved = fsdp::checkpoint::save(
            dir, s.root, s.opt.get(), fsdp::checkpoint::TrainState{}, s.root.communicator());
        torch::manual_seed(static_cast<int64_t>(p.seed) + 1);  // other initial values
        ShardedSide fresh(p, r);
        fsdp::checkpoint::load(saved, fresh.root, fresh.opt.get(), fresh.root.communicator());
        expect_shards_equal(fresh.root, *ref.net(r.rank), kRtol, kAtol);
        run_iteration(p, r, fresh, ref, 1);
      },
      o);
  if (!in_rank_process()) std::filesystem::remove_all(dir);
}

// Runs `body` on every rank of p's world with a fresh sharded side, under a 30 s collective
// timeout: an error expected at once that instead waits the timeout out fails with the timeout's
// message, not the one expected.
void on_each_rank_within_seconds(const Program& p,
                                 const std::function<void(Rank&, ShardedSide&)>& body) {
  RunOptions o;
  o.collective_timeout_s = 30;
  run_ranks(
      p.world,
      [&](Rank& r) {
        torch::manual_seed(1);
        ShardedSide s(p, r);
        body(r, s);
      },
      o);
}

// [Note: calls that differ between ranks] Without the declaration the ranks' calls must match;
// calls that differ are never a silent wrong result: every rank stops, on every transport, naming
// set_calls_may_differ: groups of one size by the Agreed check at the end of the root's forward
// (before any backward), groups of other sizes by the transport or that check.
TEST(DifferentCalls, UndeclaredCallsThatDifferFailByNameOnEveryRank) {
  for (const std::string transport : {"", "tcp", "collective"})
    for (bool equal_sizes : {true, false}) {
      // The collective transport moves sizes unchecked, as NCCL does (docs/design.md, calls that
      // differ): other sizes abort inside Gloo there.
      if (transport == "collective" && !equal_sizes) continue;
      SCOPED_TRACE("transport '" + transport + (equal_sizes ? "', equal sizes" : "', other sizes"));
      Program p = different_calls_program(2, 2, {per_rank_pass({{0}, {1}})});
      p.undeclared = true;
      p.transport = transport;
      if (!equal_sizes) p.rows = {3, 6};
      const Pass& pass = p.iterations[0].micro[0];
      on_each_rank_within_seconds(p, [&](Rank& r, ShardedSide& s) {
        const std::string e =
            error_of([&] { s.model(input_for(p, r.rank, 0, 0), pass, r.rank).backward(); });
        EXPECT_TRUE(e.find("set_calls_may_differ") != std::string::npos ||
                    e.find("issued different collectives") != std::string::npos)
            << e;
        EXPECT_EQ(e.find("timed out"), std::string::npos) << e;
      });
    }
}

// What must still match is each rank's sequence of top-level calls and backward calls: a rank
// with an extra forward of the root before the backward stops every rank by name.
// With buffers broadcast before every forward of the root (ShardOptions::broadcast_buffers) too:
// the call's opening round comes before that broadcast, so the ranks stop there by name instead of
// meeting in the broadcast and waiting out the timeout.
TEST(DifferentCalls, DifferentTopLevelCallsFailByName) {
  for (bool broadcast : {false, true}) {
    SCOPED_TRACE(broadcast ? "broadcast_buffers" : "no buffer broadcast");
    Program p = different_calls_program(2, 2, {per_rank_pass({{0}, {1}})});
    p.broadcast_buffers = broadcast;
    const Pass& pass = p.iterations[0].micro[0];
    on_each_rank_within_seconds(p, [&](Rank& r, ShardedSide& s) {
      expect_error(
          [&] {
            if (r.rank == 0) {
              torch::NoGradGuard no_grad;
              s.model(input_for(p, r.rank, 0, 9), pass, r.rank);
            }
            s.model(input_for(p, r.rank, 0, 0), pass, r.rank).backward();
          },
          {"top-level calls differ", "rank 0 began a top-level forward", "rank 1 began a backward",
           "same top-level calls"});
    });
  }
}

// Under HSDP the same, over the whole mesh, within seconds: a rank whose call differs stops every
// rank, in its own shard group and in the other replicas, by name (2 replicas of 2 ranks, and 4
// replicas of 1, where the shard groups exchange nothing). An explicit collective called on one
// rank only (unshard(), clip_grad_norm_, a state dict) stops every rank the same way.
TEST(DifferentCalls, DifferentTopLevelCallsFailOnEveryRankUnderHsdp) {
  Program p = different_calls_program(4, 2, {same_pass(4, {{0, 0}, {1, 1}}, {0, 1})});
  const Pass& pass = p.iterations[0].micro[0];
  enum Case { kExtraForward, kUnshard, kClip, kStateDict };
  for (int replicas : {2, 4}) {
    for (Case c : {kExtraForward, kUnshard, kClip, kStateDict}) {
      SCOPED_TRACE(detail::cat("replicas ", replicas, ", case ", static_cast<int>(c)));
      p.replicas = replicas;
      p.broadcast_buffers = c == kExtraForward;  // the root's forward broadcasts buffers first
      on_each_rank_within_seconds(p, [&](Rank& r, ShardedSide& s) {
        const char* what[] = {"began a top-level forward of", "called unshard() of 'root'",
                              "called clip_grad_norm_", "called full_state_dict"};
        const int odd = c == kExtraForward ? 3 : c == kClip ? 2 : 0;
        expect_error(
            [&] {
              for (int step = 0; step < 2; ++step) {
                if (step == 1 && r.rank == odd) {
                  if (c == kExtraForward) {
                    torch::NoGradGuard no_grad;
                    s.model(input_for(p, r.rank, 0, 9), pass, r.rank);
                  }
                  if (c == kUnshard) s.root.unshard();
                  if (c == kClip) fsdp::clip_grad_norm_(s.root, 1.0);
                  if (c == kStateDict) fsdp::full_state_dict(s.root);
                }
                s.model(input_for(p, r.rank, 0, step), pass, r.rank).backward();
                s.opt->step();
                s.opt->zero_grad();
              }
            },
            {"top-level calls differ", detail::cat("rank ", odd, " ", what[c]),
             "same explicit collectives"});
      });
    }
  }
}

// ---------------------------------------------------------------------------------------------
// FSDP2's FSDPModule settings, each in a hand-written program against the unsharded model (the
// fuzzer draws them too).
// ---------------------------------------------------------------------------------------------
Program settings_program(int world, int replicas, Accumulate accumulate) {
  Program p = base_program(world, {BlockKind::kTied, BlockKind::kBranch, BlockKind::kTied});
  p.replicas = replicas;
  p.accumulate = accumulate;
  p.optim = Optim::kAdamW;
  p.lr = 0.01;
  for (int it = 0; it < 2; ++it) {
    Iteration iter;
    for (int m = 0; m < 3; ++m)
      iter.micro.push_back(same_pass(world, {{0, 0}, {1, 1}, {2, 4}}, {2, 7}));
    p.iterations.push_back(iter);
  }
  return p;
}

// The sum over ranks divided by each group's factor (FSDP2's set_gradient_divide_factor), with
// accumulation, in a group of its own, in the root, and the mean where none is set.
TEST(Fsdp2Settings, GradientDivideFactorDividesTheSumPerGroup) {
  Program p = settings_program(2, 1, Accumulate::kSyncLast);
  p.divide = {4.0, 0, 0.5, 3.0};  // b0, b1 (the mean), b2, the root
  expect_program_passes(p);
  p.accumulate = Accumulate::kSyncEvery;
  p.divide = {0, 1.0, 0, 0};
  expect_program_passes(p);
}

TEST(Fsdp2Settings, GradientDivideFactorOnOneRankAndUnderHsdp) {
  Program one = settings_program(1, 1, Accumulate::kSyncLast);
  one.divide = {2.0, 0, 0, 0.25};
  expect_program_passes(one);
  Program hsdp = settings_program(4, 2, Accumulate::kSyncEvery);
  hsdp.divide = {8.0, 0, 0, 2.0};
  expect_program_passes(hsdp);
}

// set_requires_gradient_sync decides collectives (a synced backward reduces, an unsynced one
// does not), so ranks that set it differently, on the root or on one block, stop at the
// backward's first round, every rank of the mesh, naming the setting: plain FSDP, HSDP 2 x 2 and
// 4 x 1 (whose shard groups exchange nothing).
TEST(Fsdp2Settings, GradientSyncThatDiffersBetweenRanksFailsByName) {
  for (int replicas : {1, 2, 4}) {
    for (bool on_root : {true, false}) {
      SCOPED_TRACE(detail::cat("replicas ", replicas, on_root ? ", root" : ", block"));
      Program p = settings_program(4, replicas, Accumulate::kSyncEvery);
      const Pass& pass = p.iterations[0].micro[0];
      on_each_rank_within_seconds(p, [&](Rank& r, ShardedSide& s) {
        FSDPModule& h = on_root ? s.root : s.blocks[1];
        h.set_requires_gradient_sync(r.rank != 1);
        expect_error([&] { s.model(input_for(p, r.rank, 0, 0), pass, r.rank).backward(); },
                     {"the ranks' gradient synchronisation differs", "rank 1 began a backward",
                      "set_requires_gradient_sync with the same value"});
      });
    }
  }
}

// reshard_after_forward = 2 at N=4 (hpZ): blocks keep half of their parameters after forward
// and backward gathers them within pairs of ranks. Exact against the unsharded model with calls
// that differ, activation checkpointing and accumulation (a block with k = 4 is plain true).
TEST(Fsdp2Settings, ReshardAfterForwardToASmallerWorld) {
  Program p = settings_program(4, 1, Accumulate::kSyncLast);
  p.child_reshard = {2, 2, 4};
  p.root_reshard = 2;
  p.checkpointed = {false, true, false};
  p.iterations[1].micro[1] = per_rank_pass({{2, 0}, {1}, {0, 1, 2}, {2}});
  p.iterations[1].clip = 0.5;
  expect_program_passes(p);

  // What stays between forward and backward: half of each block (2 of the 4 ranks' padded rows),
  // all three blocks at once at the end of forward, nothing once backward is done.
  Program q = settings_program(4, 1, Accumulate::kSyncEvery);
  q.child_reshard = {2, 2, 2};
  run_ranks(4, [&](Rank& r) {
    torch::manual_seed(static_cast<int64_t>(q.seed));
    Reference ref(q);
    torch::manual_seed(static_cast<int64_t>(q.seed));
    ShardedSide s(q, r);
    int64_t half = 0;
    for (const auto& b : s.blocks)
      for (const auto& sh : b.shards()) {
        int64_t inner = 1;
        for (size_t d = 1; d < sh.global_shape.size(); ++d) inner *= sh.global_shape[d];
        half += 2 * sh.rows_per_rank * inner * static_cast<int64_t>(sizeof(double));
      }
    for (int it = 0; it < static_cast<int>(q.iterations.size()); ++it) {
      run_iteration(q, r, s, ref, it);
      EXPECT_EQ(s.root.memory_stats().post_forward_bytes, 0);
    }
    EXPECT_EQ(s.root.memory_stats().peak_post_forward_bytes, half);
  });
}

// set_keep_unsharded_storage(true): a full parameter has the same address every time its group
// is gathered, across steps, and training stays exact (the fuzzer draws it too). Switched off,
// the kept storage goes back to the pool.
TEST(Fsdp2Settings, KeepUnshardedStorageKeepsEachParametersAddress) {
  Program p = settings_program(2, 1, Accumulate::kSyncEvery);
  p.child_reshard = {1, 1, 2};
  p.keep_storage = {1, 0, 1, 1};
  p.iterations[1].micro[1] = per_rank_pass({{2, 0}, {1}});
  expect_program_passes(p);
  run_ranks(2, [&](Rank& r) {
    Sides both(p, r, p.seed);
    auto& ref = both.ref;
    auto& s = both.sharded;
    auto address = [&](int b) {
      s.blocks[b].unshard();
      const void* at = s.model->blocks[b]->parameters()[0].data_ptr();
      s.blocks[b].reshard();
      return at;
    };
    const void* first0 = address(0);
    const void* first2 = address(2);
    for (int it = 0; it < static_cast<int>(p.iterations.size()); ++it) {
      run_iteration(p, r, s, ref, it);
      EXPECT_EQ(address(0), first0);
      EXPECT_EQ(address(2), first2);
    }
    const int64_t held = s.root.memory_stats().buffer_bytes_in_use;
    s.blocks[0].set_keep_unsharded_storage(false);
    EXPECT_LT(s.root.memory_stats().buffer_bytes_in_use, held);
  });
}

// CPUOffloadPolicy on CPU parameters: the shards are in host memory already, so training equals
// the unsharded model's and nothing is page-locked (there is no CUDA driver here to pin with: an
// attempt throws). With CUDA parameters bench/gpu_check.cpp checks the offloaded shards.
TEST(Fsdp2Settings, CpuOffloadPolicyOnCpuParametersChangesNothing) {
  for (int offload : {1, 2}) {
    Program p = settings_program(2, 1, Accumulate::kSyncEvery);
    p.offload = offload;
    expect_program_passes(p);
  }
}

// set_custom_all_gather / set_custom_reduce_scatter: that group's gathers and reductions, and only
// its, go through the user's collectives (exact ones: training stays exact). Six synced backwards:
// six reductions each.
TEST(Fsdp2Settings, CustomCollectivesCarryTheirGroupsGathersAndReductions) {
  Program p = settings_program(2, 1, Accumulate::kSyncEvery);
  p.custom = {3, 0, 1, 2};  // block 0 both, block 1 none, block 2 the gather, the root the reduce
  expect_program_passes(p);
  run_ranks(2, [&](Rank& r) {
    Sides both(p, r, p.seed);
    auto& ref = both.ref;
    auto& s = both.sharded;
    for (int it = 0; it < static_cast<int>(p.iterations.size()); ++it)
      run_iteration(p, r, s, ref, it);
    ASSERT_EQ(s.custom_gathers.size(), 2u);
    ASSERT_EQ(s.custom_reduces.size(), 2u);
    EXPECT_GE(s.custom_gathers[0]->calls, 6);  // block 0: a gather per forward at least
    EXPECT_GE(s.custom_gathers[1]->calls, 6);  // block 2
    EXPECT_EQ(s.custom_reduces[0]->calls, 6);  // block 0
    EXPECT_EQ(s.custom_reduces[1]->calls, 6);  // the root
  });
}

// A post-forward world that does not divide the shard group, or is not positive (-1 too, which
// once meant true inside), fails at
// fully_shard naming the option and the fix, with nothing sharded; so does one on elements
// gathered on use, which cannot reshard after forward at all.
TEST(Fsdp2Settings, ReshardAfterForwardWorldsThatCannotWorkAreRefused) {
  run_ranks(4, [&](Rank& r) {
    auto comm = r.world();
    torch::manual_seed(1);
    fsdp::Sharded<torch::nn::Linear> lin{torch::nn::Linear(4, 4)};
    for (int k : {3, 0, -1, -2, 8}) {
      ShardOptions o;
      o.reshard_after_forward = k;
      expect_error([&] { fully_shard(lin, comm, o); },
                   {detail::cat("reshard_after_forward = ", k), "divides the shard group's 4",
                    "Fix: pass a divisor of 4"});
    }
    EXPECT_FALSE(lin.is_sharded());  // nothing was claimed: it can be sharded now
    ShardOptions two;
    two.reshard_after_forward = 2;
    fully_shard(lin, comm, two);
    EXPECT_TRUE(lin.is_sharded());
    torch::nn::Sequential seq(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
    expect_error([&] { fully_shard_elements(seq, comm, two); },
                 {"reshard_after_forward (true, or a smaller world) cannot be honoured"});
  });
}

// set_all_reduce_hook: the hook (a collective of its own, then a scale) runs on each reduced
// block, on 2 ranks with ranks whose calls differ, on one rank, and under HSDP at the backward
// that all-reduces.
TEST(Fsdp2Settings, AllReduceHookRunsOnEachReducedBlock) {
  Program two = settings_program(2, 1, Accumulate::kSyncEvery);
  two.hook = {2.0, 0, 0.5, 1.5};
  two.divide = {0, 3.0, 0, 0};
  two.iterations[1].micro[1] = per_rank_pass({{2, 0}, {1}});
  expect_program_passes(two);
  Program one = settings_program(1, 1, Accumulate::kSyncLast);
  one.hook = {0, 2.5, 0, 0.5};
  expect_program_passes(one);
  Program hsdp = settings_program(4, 2, Accumulate::kAllReduceLast);
  hsdp.hook = {1.5, 0, 2.0, 0};
  expect_program_passes(hsdp);
}

// HSDP 2x2: every micro-batch reduce-scatters, only the last all-reduces across replicas; the
// blocks set aside are added in before it (FSDP2's set_requires_all_reduce).
TEST(Fsdp2Settings, AllReduceOnlyOnTheLastMicroBatchUnderHsdp) {
  Program p = settings_program(4, 2, Accumulate::kAllReduceLast);
  p.divide = {0, 0, 5.0, 0};
  p.audit = true;  // Complete: the blocks set aside count as reduced
  expect_program_passes(p);
}

// Replicas that decide differently would leave each other waiting (or add other blocks together):
// refused on every rank when the backward begins, before any all-reduce.
TEST(Fsdp2Settings, ReplicasThatDisagreeOnTheAllReduceFailByName) {
  Program p = settings_program(4, 2, Accumulate::kSyncEvery);
  run_ranks(4, [&](Rank& r) {
    torch::manual_seed(1);
    ShardedSide s(p, r);
    s.root.set_requires_all_reduce(r.rank < 2);  // replica 0 all-reduces, replica 1 does not
    expect_error(
        [&] { s.model(input_for(p, r.rank, 0, 0), p.iterations[0].micro[0], r.rank).backward(); },
        {"set_requires_all_reduce differs between ranks", "of replica",
         "same value on every rank"});
  });
}

TEST(Fsdp2Settings, ABadDivideFactorIsRefusedByName) {
  Program p = settings_program(1, 1, Accumulate::kSyncLast);
  run_ranks(1, [&](Rank& r) {
    ShardedSide s(p, r);
    for (double bad : {0.0, -2.0, std::nan("")})
      expect_error([&] { s.root.set_gradient_divide_factor(bad); },
                   {"set_gradient_divide_factor(", "on 'root'", "positive and finite"});
  });
}

// unshard(async_op=true): gathered once waited (or by the forward), resharded by the backward's
// end; a handle waited after a reshard or twice does nothing; losses and gradients stay exact.
TEST(Fsdp2Settings, AsyncUnshardIsWaitedByItsHandleOrItsForward) {
  Program p = settings_program(2, 1, Accumulate::kSyncLast);
  p.iterations[0].async_unshard = 1;
  p.iterations[0].async_wait = true;
  p.iterations[1].async_unshard = 2;  // left to the forward
  expect_program_passes(p);
  run_ranks(2, [&](Rank& r) {
    Sides both(p, r, 1);
    auto& ref = both.ref;
    auto& s = both.sharded;
    auto handle = s.blocks[0].unshard(/*async_op=*/true);
    handle.wait();
    // Waited: the full parameters hold the gathered values (read outside any forward).
    EXPECT_TRUE(torch::equal(s.model->blocks[0]->wb, ref.net(r.rank)->blocks[0]->wb));
    const auto gathered = s.root.memory_stats().unsharded_bytes;
    EXPECT_GT(gathered, 0);
    handle.wait();  // again: nothing
    s.blocks[0].reshard();
    EXPECT_EQ(s.root.memory_stats().unsharded_bytes, 0);
    auto late = s.blocks[1].unshard(/*async_op=*/true);
    s.blocks[1].reshard();  // the gather in flight is discarded
    late.wait();            // nothing in flight: nothing to do
    EXPECT_EQ(s.root.memory_stats().unsharded_bytes, 0);
    UnshardHandle().wait();  // the empty handle of a blocking unshard
  });
}

// set_unshard_in_backward(false) on a block whose backward reads no weight: exact, without its
// backward all-gather; on one whose backward reads one: an error naming the setting.
TEST(Fsdp2Settings, UnshardInBackwardOffSkipsTheGatherOrFailsByName) {
  Program p = base_program(2, {BlockKind::kIgnoresInput, BlockKind::kTied});
  p.child_reshard = {1, 1};
  p.no_backward_unshard = {1, 0};
  for (int it = 0; it < 2; ++it) {
    Iteration iter;
    iter.micro.push_back(same_pass(2, {{0, 0}, {1, 1}}, {2, 4}));
    p.iterations.push_back(iter);
  }
  run_ranks(2, [&](Rank& r) {
    auto collectives = [&](const Program& q) {
      r.world()->reset_stats();
      EXPECT_TRUE(run_program(r, q));
      return r.world()->total_stats().collectives;
    };
    Program gathered = p;
    gathered.no_backward_unshard = {0, 0};
    // b0 reshards after forward: one backward all-gather per iteration, two in all, skipped.
    EXPECT_EQ(collectives(gathered) - collectives(p), 2);
  });
  Program bad = p;
  bad.no_backward_unshard = {0, 1};  // the tied block's backward reads wb
  run_ranks(2, [&](Rank& r) {
    torch::manual_seed(1);
    ShardedSide s(bad, r);
    expect_error(
        [&] {
          s.model(input_for(bad, r.rank, 0, 0), bad.iterations[0].micro[0], r.rank).backward();
        },
        {"of sharded module 'b1'", "set_unshard_in_backward(false)",
         "leave unshard_in_backward on"});
  });
}

TEST(Fsdp2Settings, UnshardInBackwardOffWithActivationCheckpointingIsRefused) {
  Program p = base_program(1, {BlockKind::kIgnoresInput});
  p.checkpointed = {true};
  run_ranks(1, [&](Rank& r) {
    ShardedSide s(p, r);
    expect_error([&] { s.blocks[0].set_unshard_in_backward(false); },
                 {"set_unshard_in_backward(false) on 'b0'", "checkpoints its activations"});
  });
}

// Sharded::call (FSDP2's register_fsdp_forward_method): another method, called as forward is, is
// gathered first and resharded after, checkpointed too; gradients exact.
TEST(Fsdp2Settings, AnotherMethodCalledAsForwardIsGatheredAndExact) {
  Program p = settings_program(2, 1, Accumulate::kSyncLast);
  p.encode = {1, 0, 1};
  p.checkpointed = {false, false, true};
  p.child_reshard = {1, 1, 1};
  p.audit = true;
  expect_program_passes(p);
}
}  // namespace
}  // namespace fsdp::testing::guarantee_fuzz_test
