// Mixed precision (MixedPrecisionPolicy): the GPT trained with bf16/fp16 gathered parameters and
// low-precision or fp32 reductions on N ranks matches an unsharded model that casts the same way
// (FSDP2's test pattern): an fp32 master copy, a compute copy cast to param_dtype for each step,
// each rank's slice run on it, the slice gradients averaged in fp32 and rounded to reduce_dtype,
// AdamW stepping the fp32 master. Also: the shards stay fp32, the all-gather moves half the
// bytes, and bad policies fail by message.
#include <fsdp/models/gpt.h>

#include "compat.h"
#include "fsdp_test_util.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::mixed_precision_test {
namespace {

using fsdp::models::GPT;

constexpr int kSteps = 4;
constexpr int64_t kGlobalBatch = 12;

// The GPT, whose forward can leave out one block: with `skip` set per rank, the ranks call
// different sharded modules ([Note: calls that differ between ranks]).
struct SkippingGPTImpl : fsdp::models::GPTImpl {
  explicit SkippingGPTImpl(const fsdp::models::GPTConfig& c) : GPTImpl(c) {}
  torch::Tensor forward(const torch::Tensor& idx, const torch::Tensor& targets) {
    if (skip < 0) return GPTImpl::forward(idx, targets);
    auto x = wte(idx) + wpe(torch::arange(idx.size(1), torch::kLong));
    for (size_t b = 0; b < blocks.size(); ++b)
      if (static_cast<int64_t>(b) != skip) x = blocks[b](x);
    auto logits = ln_f(x).matmul(wte->weight.t());
    return torch::nn::functional::cross_entropy(logits.view({-1, cfg.vocab_size}),
                                                targets.reshape({-1}));
  }
  int64_t skip = -1;
};
TORCH_MODULE(SkippingGPT);

fsdp::Sharded<SkippingGPT> build() {
  torch::manual_seed(0);
  return fsdp::Sharded<SkippingGPT>{SkippingGPT(tiny_gpt())};
}

FSDPModule shard(fsdp::Sharded<SkippingGPT>& model, std::shared_ptr<Communicator> comm,
                 const ShardOptions& blocks, const ShardOptions& root) {
  for (auto& b : model->blocks) fully_shard(b, comm, blocks);
  return fully_shard(model, comm, root);
}

// The block rank k leaves out: none, or block k % layers when the ranks' calls differ.
int64_t skipped_block(bool differ, int k) { return differ ? k % tiny_gpt().n_layer : -1; }

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(900 + step);
  auto tokens = torch::randint(0, tiny_gpt().vocab_size, {kGlobalBatch, tiny_gpt().seq_len + 1},
                               torch::kLong);
  return {tokens.narrow(1, 0, tiny_gpt().seq_len), tokens.narrow(1, 1, tiny_gpt().seq_len)};
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

struct Policy {
  torch::Dtype param;
  std::optional<torch::Dtype> reduce;  // unset: the shards' fp32
  torch::Dtype reduce_or_fp32() const { return reduce.value_or(torch::kFloat); }
};

ShardOptions with_policy(const Policy& p, bool root) {
  ShardOptions o = audited();
  o.mixed_precision.param_dtype = p.param;
  o.mixed_precision.reduce_dtype = p.reduce;
  if (root) o.mixed_precision.output_dtype = torch::kFloat;  // the loss comes back in fp32
  return o;
}

// The reference: returns the mean slice loss per step; `master` ends with the trained values.
// With `micro` > 1 each rank's slice runs as that many micro-batches, each loss divided by
// `micro`; a rank's gradients sum in reduce_dtype, the first cast to it and each next one added
// (FSDP2's accumulation without gradient sync), before the reduction. In the first micro-batch
// autograd casts each use of a parameter (the tied embedding's two) to reduce_dtype before
// summing them, where LibTorch can (Tensor::set_grad_dtype, 2.15), as FSDP2 has it do.
std::vector<double> reference_run(fsdp::Sharded<SkippingGPT>& master, int world, const Policy& p,
                                  bool differ, int micro = 1) {
  torch::optim::AdamW opt(master->parameters(), adamw());
  auto params = master->parameters();
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    const int64_t per = kGlobalBatch / world, rows = per / micro;
    std::vector<std::vector<torch::Tensor>> slice_grads(params.size());
    double loss_sum = 0;
    for (int k = 0; k < world; ++k) {
      auto compute = build();  // same structure; values from the master, cast
      {
        torch::NoGradGuard ng;
        auto cp = compute->parameters();
        for (size_t i = 0; i < cp.size(); ++i) cp[i].set_data(params[i].detach().to(p.param));
      }
      compute->skip = skipped_block(differ, k);
      std::vector<torch::Tensor> sums(params.size());
      for (int m = 0; m < micro; ++m) {
        const bool widen =
            micro > 1 && m == 0 && c10::elementSize(p.reduce_or_fp32()) > c10::elementSize(p.param);
        for (auto& cp : compute->parameters())
          compat::set_grad_dtype(cp, widen ? p.reduce_or_fp32() : p.param);
        const int64_t row0 = k * per + m * rows;
        auto loss = compute->forward(x.narrow(0, row0, rows), y.narrow(0, row0, rows));
        auto loss32 = loss.to(torch::kFloat);
        (loss32 / micro).backward();
        loss_sum += loss32.item<double>() / micro;
        auto cp = compute->parameters();
        for (size_t i = 0; i < cp.size(); ++i) {
          auto g = (cp[i].grad().defined() ? cp[i].grad() : torch::zeros_like(cp[i]))
                       .to(p.reduce_or_fp32());
          sums[i] = m == 0 ? g : sums[i] + g;
          cp[i].mutable_grad() = torch::Tensor();
        }
      }
      for (size_t i = 0; i < params.size(); ++i) slice_grads[i].push_back(sums[i]);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      // As the reduce-scatter does it: blocks in reduce_dtype, summed in rank order in fp32 for
      // low precision, divided by the world, rounded to reduce_dtype.
      const auto reduce = p.reduce_or_fp32();
      auto blocks = torch::stack(slice_grads[i]).to(reduce);
      auto sum = reduce == torch::kFloat || reduce == torch::kDouble
                     ? blocks.sum(0)
                     : blocks.to(torch::kFloat).sum(0);
      params[i].mutable_grad() = sum.div_(world).to(reduce).to(params[i].scalar_type());
    }
    opt.step();
    opt.zero_grad();
    losses.push_back(loss_sum / world);
  }
  return losses;
}

void run_mixed(int world, Policy p, bool differ = false, int micro = 1) {
  run_ranks(world, [&](Rank& r) {
    auto ref = build();
    auto ref_losses = reference_run(ref, world, p, differ, micro);

    auto model = build();
    model->skip = skipped_block(differ, r.rank);
    auto comm = r.world();
    auto root = shard(model, comm, with_policy(p, false), with_policy(p, true));
    // Ranks leaving out different blocks: the declared region ([Note: calls that differ
    // between ranks]).
    if (differ) root.set_calls_may_differ(true);
    for (const auto& s : root.shards()) ASSERT_EQ(s.shard.scalar_type(), torch::kFloat) << s.name;
    torch::optim::AdamW opt(root.parameters(), adamw());
    const int64_t per = kGlobalBatch / world, rows = per / micro;
    for (int s = 0; s < kSteps; ++s) {
      auto [gx, gy] = batch(s);
      auto mean = torch::zeros({}, torch::kFloat);
      for (int m = 0; m < micro; ++m) {
        root.set_requires_gradient_sync(m + 1 == micro);
        const int64_t row0 = r.rank * per + m * rows;
        auto loss = model(gx.narrow(0, row0, rows), gy.narrow(0, row0, rows));
        ASSERT_EQ(loss.scalar_type(), torch::kFloat) << "output_dtype casts the root's result";
        (loss / micro).backward();
        mean += loss.detach() / micro;
      }
      for (const auto& sh : root.shards())
        if (sh.shard.grad().defined()) {
          ASSERT_EQ(sh.shard.grad().scalar_type(), torch::kFloat) << sh.name;
        }
      opt.step();
      opt.zero_grad();
      comm->all_reduce(mean, ReduceOp::kAvg).wait();
      EXPECT_NEAR(mean.item<double>(), ref_losses[s], 1e-6 * std::abs(ref_losses[s]))
          << "step " << s;
    }
    // Each rank's compute and the reduction's arithmetic are those of the reference: the fp32
    // shards after AdamW agree to fp32 rounding.
    expect_shards_equal(root, *ref.ptr(), 1e-6, 1e-7);
    if (r.rank == 0) {
      double worst = 0;
      std::map<std::string, torch::Tensor> want;
      for (auto& item : ref->named_parameters()) want[item.key()] = item.value().detach();
      for (const auto& sh : root.shards()) {
        if (sh.shard.numel() == 0) continue;
        auto full =
            want.at(sh.name).reshape({sh.global_shape.empty() ? 1 : sh.global_shape[0], -1});
        auto w = full.narrow(0, sh.row_offset, sh.shard.size(0));
        worst =
            std::max(worst, (sh.shard.detach().reshape(w.sizes()) - w).abs().max().item<double>());
      }
      std::cout << "mixed precision world " << world << " param " << p.param << " reduce "
                << p.reduce_or_fp32() << ": max shard error vs reference " << worst << "\n";
    }
  });
}

class MixedPrecisionBf16 : public ::testing::TestWithParam<int> {};
TEST_P(MixedPrecisionBf16, MatchesUnshardedModelCastingTheSameWay) {
  run_mixed(GetParam(), {torch::kBFloat16, torch::kBFloat16});
}
INSTANTIATE_TEST_SUITE_P(World, MixedPrecisionBf16, ::testing::Values(1, 2, 3, 4));

TEST(MixedPrecision, Bf16ParamsFp32ReduceWorld2) {
  run_mixed(2, {torch::kBFloat16, torch::kFloat});
}
TEST(MixedPrecision, Bf16ParamsFp32ReduceWorld3) {
  run_mixed(3, {torch::kBFloat16, torch::kFloat});
}
// fp16 on the wire. (fp16 compute needs CUDA: LibTorch 1.13's CPU kernels lack LayerNorm and
// matmul in Half.)
TEST(MixedPrecision, Bf16ParamsFp16ReduceWorld2) { run_mixed(2, {torch::kBFloat16, torch::kHalf}); }
// Micro-batches without gradient sync: each rank's gradients sum in reduce_dtype (fp32), not in
// the bf16 of the compute, as FSDP2 accumulates them; summed in bf16 they would differ from the
// reference's by bf16 roundings (about 1e-3 relative), and the shards after AdamW by far more
// than the bound.
TEST(MixedPrecision, UnsyncedMicroBatchesAccumulateInReduceDtypeWorld2) {
  run_mixed(2, {torch::kBFloat16, torch::kFloat}, /*differ=*/false, /*micro=*/3);
}
TEST(MixedPrecision, UnsyncedMicroBatchesAccumulateInReduceDtypeOneRank) {
  run_mixed(1, {torch::kBFloat16, torch::kFloat}, /*differ=*/false, /*micro=*/3);
}
TEST(MixedPrecision, UnsyncedMicroBatchesAccumulateInReduceDtypeRanksCallingDifferentBlocks) {
  run_mixed(3, {torch::kBFloat16, torch::kFloat}, /*differ=*/true, /*micro=*/2);
}
// reduce_dtype unset: the parameters' fp32 (torch 2.15's FSDP2), for the reduction and for the
// micro-batches' sum.
TEST(MixedPrecision, UnsetReduceDtypeReducesAndAccumulatesInTheParametersDtype) {
  run_mixed(2, {torch::kBFloat16, std::nullopt}, /*differ=*/false, /*micro=*/2);
}
// Accumulated in bf16 where bf16 is also the reduction's dtype.
TEST(MixedPrecision, UnsyncedMicroBatchesInBf16World2) {
  run_mixed(2, {torch::kBFloat16, torch::kBFloat16}, /*differ=*/false, /*micro=*/2);
}
// Each rank leaves out another block: the gathers agreed in rounds carry bf16 parameters.
TEST(MixedPrecision, RanksCallingDifferentBlocksWorld3) {
  run_mixed(3, {torch::kBFloat16, torch::kFloat}, /*differ=*/true);
}

// The all-gather moves half the bytes in bf16, the reduce-scatter too when it reduces in bf16;
// with reduce_dtype unset it reduces in the parameters' fp32 (torch 2.15's FSDP2), so only the
// gathers shrink.
TEST(MixedPrecision, Bf16HalvesTheBytesOnTheWire) {
  run_ranks(2, [&](Rank& r) {
    auto bytes_of_one_step = [&](std::optional<torch::Dtype> param_dtype,
                                 std::optional<torch::Dtype> reduce_dtype) {
      auto model = build();
      auto comm = r.world()->split(param_dtype ? (reduce_dtype ? "bf16" : "bf16_fp32") : "fp32");
      ShardOptions o;
      o.mixed_precision.param_dtype = param_dtype;
      o.mixed_precision.reduce_dtype = reduce_dtype;
      auto root = shard(model, comm, o, o);
      auto [x, y] = batch(0);
      model(x.narrow(0, r.rank * 6, 6), y.narrow(0, r.rank * 6, 6)).backward();
      comm->reset_stats();
      model(x.narrow(0, r.rank * 6, 6), y.narrow(0, r.rank * 6, 6)).backward();
      return comm->total_stats().bytes_sent;
    };
    const double fp32 = bytes_of_one_step(std::nullopt, std::nullopt);
    const double bf16 = bytes_of_one_step(torch::kBFloat16, torch::kBFloat16);
    const double unset = bytes_of_one_step(torch::kBFloat16, std::nullopt);
    if (r.rank == 0)
      std::cout << "bytes per step: fp32 " << fp32 << ", bf16 " << bf16 << " (ratio " << bf16 / fp32
                << "), bf16 with reduce_dtype unset " << unset << " (ratio " << unset / fp32
                << ")\n";
    EXPECT_NEAR(bf16 / fp32, 0.5, 0.01);
    EXPECT_GT(unset / fp32, 0.6);
    EXPECT_LT(unset / fp32, 0.9);
  });
}

// The full parameters are in param_dtype while gathered; the optimizer never sees them.
TEST(MixedPrecision, GatheredParametersAreInParamDtype) {
  run_ranks(2, [&](Rank& r) {
    auto model = build();
    ShardOptions o;
    o.mixed_precision.param_dtype = torch::kBFloat16;
    auto root = shard(model, r.world(), o, o);
    root.unshard();
    for (auto& p : model->named_parameters(/*recurse=*/false))
      EXPECT_EQ(p.value().scalar_type(), torch::kBFloat16) << p.key();
    root.reshard();
  });
}

// MixedPrecisionPolicy::param_dtype_override_fn (FSDP2's): parameters for which it returns their
// own dtype stay in it (full parameter, compute, gradient) while the rest take param_dtype; the
// group gathers in the widest of its dtypes, each parameter its own bytes of the full block.
namespace override_fn {

// fp64 parameters; forward casts each weight to its input's dtype, so that any mix computes.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    w1 = register_parameter("w1", torch::randn({6, 5}, torch::kDouble) * 0.4);
    b1 = register_parameter("b1", torch::randn({6}, torch::kDouble) * 0.1);
    w2 = register_parameter("w2", torch::randn({3, 6}, torch::kDouble) * 0.4);
    b2 = register_parameter("b2", torch::randn({3}, torch::kDouble) * 0.1);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::tanh(x.matmul(w1.to(x.scalar_type()).t()) + b1);  // b1 may promote h
    return h.matmul(w2.to(h.scalar_type()).t()) + b2;
  }
  torch::Tensor w1, b1, w2, b2;
};
TORCH_MODULE(Net);

struct TopImpl : torch::nn::Module {
  TopImpl() {
    torch::manual_seed(3);
    a = register_module("a", Net());
    head = register_parameter("head", torch::randn({3}, torch::kDouble));
  }
  torch::Tensor forward(torch::Tensor x) { return (a(x) * head).pow(2).mean(); }
  fsdp::Sharded<Net> a{nullptr};
  torch::Tensor head;
};
TORCH_MODULE(Top);

// Keeps the parameters whose name contains `kept` in their own dtype (fp64).
ShardOptions keeping(const std::string& kept) {
  ShardOptions o = audited();
  o.mixed_precision.param_dtype = torch::kFloat;
  o.mixed_precision.param_dtype_override_fn =
      [kept](const std::string& name, const at::Tensor& p) -> std::optional<at::ScalarType> {
    if (name.find(kept) != std::string::npos) return p.scalar_type();
    return std::nullopt;
  };
  return o;
}

torch::Tensor input(int rank, int step) {
  torch::manual_seed(100 + 10 * step + rank);
  return torch::randn({4, 5}, torch::kDouble);
}

// Shards `top` on `r`'s world (`a`, then the root); returns their handles.
std::pair<FSDPModule, FSDPModule> shard(Rank& r, fsdp::Sharded<Top>& top, const ShardOptions& o) {
  auto a = fully_shard(top->a, r.world(), o);
  return {a, fully_shard(top, r.world(), o)};
}

// Trains the sharded `top` for 3 steps of SGD; returns the mean loss over ranks per step.
std::vector<double> train(Rank& r, fsdp::Sharded<Top>& top, const FSDPModule& root) {
  torch::optim::SGD opt(root.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<double> losses;
  for (int s = 0; s < 3; ++s) {
    auto loss = top(input(r.rank, s));
    EXPECT_EQ(loss.scalar_type(), torch::kDouble);
    loss.backward();
    for (const auto& sh : root.shards()) EXPECT_TRUE(sh.shard.grad().defined()) << sh.name;
    opt.step();
    opt.zero_grad();
    auto l = loss.detach().reshape({1});
    r.world()->all_reduce(l, ReduceOp::kAvg).wait();
    losses.push_back(l.item<double>());
  }
  return losses;
}

// The unsharded reference: an fp64 master; each step a compute copy whose parameters not named
// with `kept` are the master's rounded to fp32 (the rest fp64), each rank's input cast to fp32 as
// the root casts it, the ranks' gradients averaged in rank order in fp64 (reduce_dtype unset:
// the parameters' own dtype), SGD on the master. Returns the mean loss per step.
std::vector<double> reference(TopImpl& master, int world, const std::string& kept) {
  torch::optim::SGD opt(master.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto params = master.named_parameters();
  std::vector<double> losses;
  for (int s = 0; s < 3; ++s) {
    double sum = 0;
    std::vector<torch::Tensor> grads(params.size());
    for (int k = 0; k < world; ++k) {
      TopImpl compute;
      auto cp = compute.named_parameters();
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < cp.size(); ++i) {
          const bool keep = cp[i].key().find(kept) != std::string::npos;
          cp[i].value().set_data(keep ? params[i].value().detach().clone()
                                      : params[i].value().detach().to(torch::kFloat));
        }
      }
      auto loss = compute.forward(input(k, s).to(torch::kFloat));
      loss.backward();
      sum += loss.item<double>();
      for (size_t i = 0; i < cp.size(); ++i) {
        auto g = cp[i].value().grad().to(torch::kDouble);
        grads[i] = grads[i].defined() ? grads[i] + g : g;
      }
    }
    for (size_t i = 0; i < params.size(); ++i)
      params[i].value().mutable_grad() = (grads[i] / world).to(torch::kDouble);
    opt.step();
    opt.zero_grad();
    losses.push_back(sum / world);
  }
  return losses;
}

}  // namespace override_fn

// Every parameter kept in its own dtype: the policy's param_dtype applies to none, so training
// equals the unsharded fp64 model to fp64's rounding, and the full parameters are fp64.
TEST(MixedPrecision, ParamDtypeOverrideKeepingEveryParameterTrainsInItsOwnDtype) {
  run_ranks(2, [&](Rank& r) {
    override_fn::TopImpl ref;
    const auto want = override_fn::reference(ref, 2, "");
    fsdp::Sharded<override_fn::Top> top{override_fn::Top()};
    auto [a, root] = override_fn::shard(r, top, override_fn::keeping(""));
    const auto got = override_fn::train(r, top, root);
    for (size_t s = 0; s < want.size(); ++s) EXPECT_NEAR(got[s], want[s], 1e-12) << "step " << s;
    expect_shards_equal(root, ref, 1e-12, 1e-14);
    root.unshard();
    a.unshard();
    for (auto& p : top->named_parameters()) EXPECT_EQ(p.value().scalar_type(), torch::kDouble);
    root.reshard();
    a.reshard();
  });
}

// Biases kept in fp64, weights computed in fp32: while gathered, each full parameter is in its
// dtype with the shards' values (the biases bit for bit, the weights rounded once), the group
// gathers in fp64, and training matches the reference casting the same way to fp32's rounding.
TEST(MixedPrecision, ParamDtypeOverrideKeepsTheChosenParametersInTheirDtype) {
  run_ranks(2, [&](Rank& r) {
    override_fn::TopImpl ref;
    fsdp::Sharded<override_fn::Top> top{override_fn::Top()};
    const auto o = override_fn::keeping("b");
    auto [a, root] = override_fn::shard(r, top, o);
    root.unshard();
    a.unshard();
    const auto want = ref.named_parameters();
    for (auto& p : top->named_parameters()) {
      const bool kept = p.key().find('b') != std::string::npos;
      EXPECT_EQ(p.value().scalar_type(), kept ? torch::kDouble : torch::kFloat) << p.key();
      EXPECT_TRUE(torch::equal(p.value(), want[p.key()].to(p.value().scalar_type()))) << p.key();
    }
    root.reshard();
    a.reshard();
    // Training: the same arithmetic as the reference casting the same way, so fp64's rounding.
    override_fn::TopImpl master;
    // Every group reduces in the parameters' fp64 (reduce_dtype unset), `head` computed in fp32
    // too.
    const auto expected = override_fn::reference(master, 2, "b");
    const auto losses = override_fn::train(r, top, root);
    for (size_t s = 0; s < losses.size(); ++s)
      EXPECT_NEAR(losses[s], expected[s], 1e-12) << "step " << s;
    expect_shards_equal(root, master, 1e-12, 1e-14);
    // And not the arithmetic of keeping every parameter: the weights' rounding shows.
    override_fn::TopImpl all_kept;
    const auto unrounded = override_fn::reference(all_kept, 2, "");
    EXPECT_GT(std::abs(unrounded.back() - expected.back()), 1e-9);
  });
}

// Bad answers of the function fail at fully_shard on every rank, naming the parameter and the fix.
TEST(MixedPrecision, ParamDtypeOverrideErrorsNameTheParameter) {
  run_ranks(2, [&](Rank& r) {
    auto bad_dtype = [&](const std::string&, const at::Tensor&) -> std::optional<at::ScalarType> {
      return torch::kHalf;
    };
    torch::manual_seed(0);  // the same weights on every rank
    fsdp::Sharded<override_fn::Net> a{override_fn::Net()};
    ShardOptions o = audited();
    o.mixed_precision.param_dtype = torch::kFloat;
    o.mixed_precision.param_dtype_override_fn = bad_dtype;
    const auto msg = error_of([&] { fully_shard(a, r.world(), o); });
    EXPECT_HAS(msg, "param_dtype_override_fn gave Half for 'w1', a Double parameter");
    EXPECT_HAS(msg, "return the parameter's own dtype (Double) to keep it");
    // Throwing on one rank only: every rank raises, none waits for the others.
    const int rank = r.rank;
    o.mixed_precision.param_dtype_override_fn =
        [rank](const std::string& name, const at::Tensor&) -> std::optional<at::ScalarType> {
      if (rank == 1 && name == "b2") throw std::runtime_error("no rule for b2");
      return std::nullopt;
    };
    const auto thrown = error_of([&] { fully_shard(a, r.world(), o); });
    EXPECT_HAS(thrown, "param_dtype_override_fn");
    if (rank == 1) {
      EXPECT_HAS(thrown, "threw for parameter 'b2'");
    }
    // Answers that differ between ranks.
    o.mixed_precision.param_dtype_override_fn =
        [rank](const std::string& name, const at::Tensor& p) -> std::optional<at::ScalarType> {
      if (rank == 1 && name == "w2") return p.scalar_type();
      return std::nullopt;
    };
    const auto differ = error_of([&] { fully_shard(a, r.world(), o); });
    EXPECT_HAS(differ, "the model differs across ranks at parameter #2");
    EXPECT_HAS(differ, "param_dtype_override_fn");
    // The function on one rank only: its answers are compared like any other; one that keeps
    // nothing is what no function gives, and the module is sharded on both ranks.
    o.mixed_precision.param_dtype_override_fn =
        [](const std::string& name, const at::Tensor& p) -> std::optional<at::ScalarType> {
      if (name == "b1") return p.scalar_type();
      return std::nullopt;
    };
    if (rank == 1) o.mixed_precision.param_dtype_override_fn = nullptr;
    const auto one_sided = error_of([&] { fully_shard(a, r.world(), o); });
    EXPECT_HAS(one_sided, "the model differs across ranks at parameter #1");
    o.mixed_precision.param_dtype_override_fn =
        [](const std::string&, const at::Tensor&) -> std::optional<at::ScalarType> {
      return std::nullopt;
    };
    if (rank == 1) o.mixed_precision.param_dtype_override_fn = nullptr;
    EXPECT_EQ(error_of([&] { fully_shard(a, r.world(), o); }), "<no error>");
  });
}

}  // namespace
}  // namespace fsdp::testing::mixed_precision_test
