// fully_shard_elements: the containers LibTorch users already have (Sequential, ModuleList of
// blocks, the built-in TransformerEncoder / TransformerDecoder), one group per element, trained
// at world 2 and 3 against the unsharded model (fp64, AdamW, audit on), including blocks whose
// path depends on each rank's data. The lines a user changes are marked "// fsdp:".
#include <fsdp/containers.h>

#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::containers_test {
namespace {

using torch::nn::Linear;

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.01); }

torch::nn::Sequential make_mlp() {
  torch::nn::Sequential s(Linear(6, 16), torch::nn::Functional(torch::tanh), Linear(16, 16),
                          torch::nn::ReLU(), Linear(16, 3));
  s->to(torch::kDouble);
  return s;
}

// A block whose path depends on its input: ranks with different data use different parameters
// of the same element.
struct PathBlockImpl : torch::nn::Module {
  PathBlockImpl() : a(register_module("a", Linear(8, 8))), b(register_module("b", Linear(8, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (x.sum().item<double>() > 0) return torch::tanh(a(x));
    return torch::relu(b(x)) + x;
  }
  Linear a, b;
};
TORCH_MODULE(PathBlock);

struct ListNetImpl : torch::nn::Module {
  ListNetImpl() {
    for (int i = 0; i < 3; ++i) blocks->push_back(PathBlock());
    register_module("blocks", blocks);
    register_module("head", head);
    to(torch::kDouble);
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& m : *blocks) x = m->as<PathBlockImpl>()->forward(x);
    return head(x);
  }
  torch::nn::ModuleList blocks;
  Linear head{Linear(8, 3)};
};
TORCH_MODULE(ListNet);

// LibTorch's own transformer stacks: encoder over x, decoder over y attending to it.
struct Seq2SeqImpl : torch::nn::Module {
  Seq2SeqImpl() {
    using namespace torch::nn;
    enc = register_module(
        "enc", TransformerEncoder(TransformerEncoderOptions(
                   TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).dropout(0.0), 2)));
    dec = register_module(
        "dec", TransformerDecoder(TransformerDecoderOptions(
                   TransformerDecoderLayerOptions(8, 2).dim_feedforward(16).dropout(0.0), 2)));
    register_module("in_x", in_x);
    register_module("in_y", in_y);
    register_module("head", head);
    to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& y) {
    auto memory = enc(in_x(x));
    return head(dec(in_y(y), memory));
  }
  torch::nn::TransformerEncoder enc{nullptr};
  torch::nn::TransformerDecoder dec{nullptr};
  Linear in_x{Linear(4, 8)}, in_y{Linear(4, 8)}, head{Linear(8, 2)};
};
TORCH_MODULE(Seq2Seq);

// Every full parameter that fully_shard_elements manages holds no bytes (resharded).
int64_t gathered_bytes(torch::nn::Module& m) {
  int64_t b = 0;
  for (auto& p : m.parameters()) b += static_cast<int64_t>(p.storage().nbytes());
  return b;
}

// Trains the sharded model and the unsharded reference on every rank's batches for `steps` AdamW
// steps: the shards follow the reference's parameters, and after each backward the elements are
// resharded. `forward(model_or_ref, input)` calls either.
template <class Model, class Ref, class Forward, class Batch>
void train_against_reference(int world, Rank& r, Model& model, const FSDPModule& root, Ref& ref,
                             Forward forward, Batch batch, int steps) {
  torch::optim::AdamW opt(root.parameters(), adamw());  // fsdp: was model->parameters()
  torch::optim::AdamW ref_opt(ref->parameters(), adamw());
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    opt.zero_grad();
    auto [in, target] = batch(r.rank, step);
    torch::mse_loss(forward(model, in), target).backward();
    opt.step();
    EXPECT_EQ(gathered_bytes(*model.ptr()), 0) << "an element stayed gathered after backward";
    ref_opt.zero_grad();
    for (int k = 0; k < world; ++k) {
      auto [rin, rt] = batch(k, step);
      torch::mse_loss(forward(ref, rin), rt).backward();
    }
    // A parameter no rank used this step keeps no gradient in both (AdamW skips it).
    for (auto& p : ref->parameters())
      if (p.grad().defined()) p.mutable_grad().div_(world);
    ref_opt.step();
    expect_shards_equal(root, *ref, 1e-9, 1e-12);
  }
}

std::pair<torch::Tensor, torch::Tensor> mlp_batch(int rank, int step) {
  torch::manual_seed(100 + 10 * step + rank);
  return {torch::randn({5, 6}, torch::kDouble), torch::randn({5, 3}, torch::kDouble)};
}

void sequential_trains(int world) {
  run_ranks(world, [&](Rank& r) {
    torch::manual_seed(0);
    auto ref = make_mlp();
    torch::manual_seed(0);
    fsdp::Sharded<torch::nn::Sequential> model{make_mlp()};  // fsdp: was torch::nn::Sequential
    auto elements = fully_shard_elements(model, r.world(), audited());  // fsdp
    EXPECT_EQ(elements.size(), 3u);  // the three Linear layers; Functional and ReLU have none
    auto root = fully_shard(model, r.world(), audited());  // fsdp
    train_against_reference(
        world, r, model, root, ref,
        [](auto& m, const torch::Tensor& x) -> torch::Tensor {
          // ModuleHolder's operator() cannot deduce Sequential's templated forward.
          if constexpr (std::is_same_v<std::decay_t<decltype(m)>, torch::nn::Sequential>) {
            return m->forward(x);
          } else {
            return m(x);
          }
        },
        mlp_batch, 3);
    // Evaluation without grad mode: the elements are resharded when the root's forward returns.
    torch::NoGradGuard no_grad;
    auto [x, t] = mlp_batch(r.rank, 9);
    EXPECT_TRUE(torch::allclose(model(x), ref->forward(x), 1e-9, 1e-12));
    EXPECT_EQ(gathered_bytes(*model.ptr()), 0);
  });
}

TEST(Containers, SequentialTrainsLikeUnshardedWorld2) { sequential_trains(2); }
TEST(Containers, SequentialTrainsLikeUnshardedWorld3) { sequential_trains(3); }

TEST(Containers, ModuleListOfBlocksWithRankDependentPaths) {
  const int world = 2;
  run_ranks(world, [&](Rank& r) {
    // The ranks' inputs have opposite signs, which swap at every step: each rank uses a
    // different Linear of the same block, and a Linear used at one step is unused at the next.
    auto batch = [](int rank, int step) {
      torch::manual_seed(200 + 10 * step + rank);
      auto x = torch::rand({4, 8}, torch::kDouble) * ((rank + step) % 2 == 0 ? 1.0 : -1.0);
      return std::make_pair(x, torch::randn({4, 3}, torch::kDouble));
    };
    torch::manual_seed(0);
    ListNet ref;
    torch::manual_seed(0);
    fsdp::Sharded<ListNet> model{ListNet()};                    // fsdp: was ListNet model;
    fully_shard_elements(model->blocks, r.world(), audited());  // fsdp
    auto root = fully_shard(model, r.world(), audited());       // fsdp
    train_against_reference(
        world, r, model, root, ref, [](auto& m, const torch::Tensor& x) { return m(x); }, batch, 3);
  });
}

TEST(Containers, BuiltInTransformerEncoderAndDecoderLayers) {
  const int world = 2;
  run_ranks(world, [&](Rank& r) {
    auto batch = [](int rank, int step) {
      torch::manual_seed(300 + 10 * step + rank);
      auto x = torch::randn({5, 2, 4}, torch::kDouble);  // (source length, batch, features)
      auto y = torch::randn({3, 2, 4}, torch::kDouble);
      return std::make_pair(std::make_pair(x, y), torch::randn({3, 2, 2}, torch::kDouble));
    };
    torch::manual_seed(0);
    Seq2Seq ref;
    torch::manual_seed(0);
    fsdp::Sharded<Seq2Seq> model{Seq2Seq()};                            // fsdp: was Seq2Seq
    auto enc = fully_shard_elements(model->enc, r.world(), audited());  // fsdp
    auto dec = fully_shard_elements(model->dec, r.world(), audited());  // fsdp
    EXPECT_EQ(enc.size() + dec.size(), 4u);                             // one group per layer
    auto root = fully_shard(model, r.world(), audited());               // fsdp
    train_against_reference(
        world, r, model, root, ref,
        [](auto& m, const std::pair<torch::Tensor, torch::Tensor>& in) {
          return m(in.first, in.second);
        },
        batch, 3);
  });
}

// Kept gathered after backward, the elements are not gathered again on use: the root's next
// forward drops their values when the optimizer stepped since (else training would silently use
// the old weights).
TEST(Containers, ElementsKeptGatheredSeeTheOptimizerStep) {
  const int world = 2;
  run_ranks(world, [&](Rank& r) {
    torch::manual_seed(0);
    auto ref = make_mlp();
    torch::manual_seed(0);
    fsdp::Sharded<torch::nn::Sequential> model{make_mlp()};
    fully_shard_elements(model, r.world(), audited());
    auto root = fully_shard(model, r.world(), audited());
    root.set_reshard_after_backward(false);
    torch::optim::AdamW opt(root.parameters(), adamw());
    torch::optim::AdamW ref_opt(ref->parameters(), adamw());
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad();
      auto [x, t] = mlp_batch(r.rank, step);
      torch::mse_loss(model(x), t).backward();
      opt.step();
      EXPECT_GT(gathered_bytes(*model.ptr()), 0);  // kept, as asked
      ref_opt.zero_grad();
      for (int k = 0; k < world; ++k) {
        auto [rx, rt] = mlp_batch(k, step);
        torch::mse_loss(ref->forward(rx), rt).backward();
      }
      for (auto& p : ref->parameters()) p.mutable_grad().div_(world);
      ref_opt.step();
      expect_shards_equal(root, *ref, 1e-9, 1e-12);
    }
  });
}

TEST(Containers, MisuseIsNamed) {
  run_ranks(2, [&](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<torch::nn::Sequential> model{make_mlp()};
    ShardOptions checkpointed;
    checkpointed.runtime.activation_checkpointing = true;
    expect_error([&] { fully_shard_elements(model, r.world(), checkpointed); },
                 {"activation_checkpointing needs the element's calls"});
    auto elements = fully_shard_elements(model, r.world());
    expect_error([&] { elements[0].set_reshard_after_forward(true); },
                 {"nothing marks the end of its forward"});
    fully_shard(model, r.world());
    // An element's weight read outside the root's forward: the guard names the way out.
    auto w = model->ptr(0)->as<torch::nn::LinearImpl>()->weight;
    expect_error([&] { (void)w.sum(); },
                 {"aten::sum", "'0.weight'", "gathered when a forward of the sharded root begins"});
  });
}

}  // namespace
}  // namespace fsdp::testing::containers_test
