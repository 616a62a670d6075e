// Misuse made loud (issue 10, item 4): an optimizer or torch's clip_grad_norm_ built on the full
// parameters instead of the shards, and blocks sharded without a sharded root, each fail by their
// message instead of training wrongly; the legitimate habits around them keep working.
#include <fsdp/models/gpt.h>

#include "fsdp_test_util.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::misuse_test {
namespace {

using fsdp::models::GPT;

fsdp::Sharded<GPT> build() {
  torch::manual_seed(0);
  return fsdp::Sharded<GPT>{GPT(tiny_gpt())};
}

std::pair<torch::Tensor, torch::Tensor> batch(int rank) {
  torch::manual_seed(40 + rank);
  auto t = torch::randint(0, tiny_gpt().vocab_size, {2, tiny_gpt().seq_len + 1}, torch::kLong);
  return {t.narrow(1, 0, tiny_gpt().seq_len), t.narrow(1, 1, tiny_gpt().seq_len)};
}

TEST(Misuse, OptimizerOnTheFullParametersFailsByMessage) {
  run_ranks(2, [](Rank& r) {
    auto model = build();
    auto root = fsdp::models::shard_gpt(model, r.world());
    torch::optim::AdamW wrong(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto [x, y] = batch(r.rank);
    model(x, y).backward();
    // Zeroing gradients on the model or through the wrong optimizer is harmless and allowed.
    model->zero_grad();
    model(x, y).backward();
    wrong.zero_grad();
    model(x, y).backward();
    // AdamW's decoupled decay touches the (resharded) parameter first, SGD the gradient first:
    // either message names the optimizer fix.
    expect_error([&] { wrong.step(); }, {"build the optimizer on", "parameters()"});
    expect_error([&] { torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0); },
                 {"gradient of the full parameter", "fsdp::clip_grad_norm_"});
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).weight_decay(0.1));
    expect_error([&] { sgd.step(); }, {"gradient of the full parameter"});
    // detach() and .data() of a resharded parameter are guarded too (no crash).
    auto w = model->blocks[0]->c_fc->weight;
    expect_error([&] { (void)w.detach().sum(); }, {"was called on", "resharded"});
    expect_error([&] { (void)w.data().sum(); }, {"was called on", "resharded"});
    // The right optimizer trains on: the shards hold the gradients.
    torch::optim::AdamW right(root.parameters(), torch::optim::AdamWOptions(1e-2));
    right.zero_grad();
    model(x, y).backward();
    for (const auto& s : root.shards()) {
      if (s.shard.numel() > 0) {
        EXPECT_TRUE(s.shard.grad().defined()) << s.name;
      }
    }
    right.step();
    model(x, y).backward();  // the next backward accumulates afresh into the full parameters
    right.step();
  });
}

TEST(Misuse, BlocksShardedWithoutARootFailByMessage) {
  run_ranks(2, [](Rank& r) {
    auto model = build();
    for (auto& b : model->blocks) fully_shard(b, r.world());  // the root is forgotten
    auto [x, y] = batch(r.rank);
    expect_error([&] { model(x, y).backward(); }, {"two separately sharded models",
                                                   "call fully_shard on the module that holds "
                                                   "them all"});
  });
}

// LibTorch's mutable_grad() takes a gradient of any shape; the reduction would add the reduced
// rows past the end of one too small (or broadcast them into one too large), so a gradient of
// another shape than its shard's is refused by name, on the host copies' path and ATen's.
TEST(Misuse, AShardGradientOfAnotherShapeFailsByMessage) {
  for (const bool bf16_reduction : {false, true}) {  // host copies / ATen's add_
    run_ranks(2, [bf16_reduction](Rank& r) {
      auto model = build();
      ShardOptions o;
      if (bf16_reduction) o.mixed_precision.reduce_dtype = torch::kBFloat16;
      auto root = fsdp::models::shard_gpt(model, r.world(), o, o);
      auto [x, y] = batch(r.rank);
      model(x, y).backward();
      const auto shards = root.shards();
      const auto& s = shards[0];
      ASSERT_GT(s.shard.numel(), 1);
      s.shard.mutable_grad() = torch::zeros({1}, s.shard.options());  // every rank alike
      expect_error([&] { model(x, y).backward(); },
                   {"the gradient of shard '" + s.name + "' has shape [1]",
                    "a gradient of the tensor's own shape"});
    });
  }
}

// A forward that writes its own parameter in place (a weight constraint under NoGradGuard,
// Embedding's max_norm) writes a gathered copy that resharding drops: refused by name when the
// module reshards, after forward or (kept gathered) after backward; on one rank the full
// parameter is the shard itself and the write persists, as unsharded.
struct ClampedImpl : torch::nn::Module {
  explicit ClampedImpl(bool embedding) {
    if (embedding)
      emb = register_module("emb",
                            torch::nn::Embedding(torch::nn::EmbeddingOptions(6, 4).max_norm(0.5)));
    else
      w = register_parameter("w", torch::randn({4, 4}) * 3);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (emb) return emb(torch::tensor({0, 3, 5})) * x;
    {
      torch::NoGradGuard no_grad;
      w.clamp_(-0.3, 0.3);
    }
    return x.matmul(w);
  }
  torch::nn::Embedding emb{nullptr};
  torch::Tensor w;
};
TORCH_MODULE(Clamped);
struct ClampedNetImpl : torch::nn::Module {
  explicit ClampedNetImpl(bool embedding) {
    block = register_module("block", fsdp::Sharded<Clamped>{Clamped(embedding)});
  }
  torch::Tensor forward(const torch::Tensor& x) { return block(x).sum(); }
  fsdp::Sharded<Clamped> block{nullptr};
};
TORCH_MODULE(ClampedNet);

TEST(Misuse, AForwardWritingItsParameterInPlaceFailsByMessage) {
  for (const bool embedding : {false, true})
    for (const bool keep_gathered : {false, true})
      run_ranks(2, [&](Rank& r) {
        torch::manual_seed(0);
        fsdp::Sharded<ClampedNet> model{ClampedNet(embedding)};
        ShardOptions o;
        o.reshard_after_forward = !keep_gathered;
        fully_shard(model->block, r.world(), o);
        fully_shard(model, r.world());
        const auto x = torch::randn({3, 4});
        const std::string param = embedding ? "emb.weight" : "w";
        auto expect_refused = [&](auto&& fn) {
          expect_error(fn, {"sharded module 'block'",
                            "wrote its parameter '" + param + "' in place while it was gathered",
                            "apply such writes to the shards"});
        };
        if (keep_gathered) {
          auto loss = model(x);
          expect_refused([&] { loss.backward(); });
        } else {
          expect_refused([&] { model(x); });
        }
      });
  run_ranks(1, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<ClampedNet> model{ClampedNet(false)};
    fully_shard(model->block, r.world());
    auto root = fully_shard(model, r.world());
    model(torch::randn({3, 4})).backward();
    EXPECT_LE(root.parameters()[0].abs().max().item<float>(), 0.3f);  // the write persisted
  });
}

// A sparse gradient (Embedding with sparse(true)) cannot be reduce-scattered by rows: refused by
// name, with the fix, instead of LibTorch's "Cannot access storage of SparseTensorImpl".
struct SparseNetImpl : torch::nn::Module {
  SparseNetImpl() {
    emb = register_module("emb", fsdp::Sharded<torch::nn::Embedding>{torch::nn::Embedding(
                                     torch::nn::EmbeddingOptions(6, 4).sparse(true))});
  }
  torch::Tensor forward(const torch::Tensor& idx) { return emb(idx).sum(); }
  fsdp::Sharded<torch::nn::Embedding> emb{nullptr};
};
TORCH_MODULE(SparseNet);

TEST(Misuse, ASparseGradientFailsByMessage) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<SparseNet> model{SparseNet()};
    fully_shard(model->emb, r.world());
    fully_shard(model, r.world());
    auto loss = model(torch::tensor({0, 3, 5}));
    expect_error([&] { loss.backward(); },
                 {"parameter 'weight' got a Sparse gradient", "sparse(false)", "ignored_params"});
  });
}

// Two models, each with its own root, trained in one process (a backward per model) is fine.
TEST(Misuse, TwoRootedModelsInOneProcessTrainSeparately) {
  run_ranks(2, [](Rank& r) {
    auto a = build();
    auto b = build();
    auto ra = fsdp::models::shard_gpt(a, r.world());
    auto rb = fsdp::models::shard_gpt(b, r.world()->split("b"));
    auto [x, y] = batch(r.rank);
    for (int i = 0; i < 2; ++i) {
      a(x, y).backward();
      b(x, y).backward();
    }
    for (size_t i = 0; i < ra.shards().size(); ++i)
      EXPECT_TRUE(torch::equal(ra.shards()[i].shard.grad(), rb.shards()[i].shard.grad()));
  });
}

}  // namespace
}  // namespace fsdp::testing::misuse_test
