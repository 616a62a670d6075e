// fully_shard of several modules as one group (FSDP2's fully_shard([a, b])): the final norm and the
// output layer, or an embedding and the output layer that share its weight. One all-gather per
// forward and one per backward for the whole list, resharded when the forward ends; training
// equals unsharded training; names, state dicts and checkpoints are the model's own; misuse is an
// error naming the fix.
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad_norm.h>
#include <fsdp/state_dict.h>

#include <set>

#include "fsdp_test_util.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::module_list_test {
namespace {

constexpr int64_t kVocab = 11, kWidth = 6;

struct NormImpl : torch::nn::Module {
  torch::Tensor gain, bias;
  NormImpl() {
    gain = register_parameter("gain", torch::ones({kWidth}) + 0.1 * torch::randn({kWidth}));
    bias = register_parameter("bias", 0.1 * torch::randn({kWidth}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto c = x - x.mean(-1, true);
    return c / (c.pow(2).mean(-1, true) + 1e-5).sqrt() * gain + bias;
  }
};
TORCH_MODULE(Norm);

struct BlockImpl : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  BlockImpl() { lin = register_module("lin", torch::nn::Linear(kWidth, kWidth)); }
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::tanh(lin(x)); }
};
TORCH_MODULE(Block);

// The output layer; with `tied` its weight is the embedding's (set by the model).
struct HeadImpl : torch::nn::Module {
  torch::Tensor weight;
  explicit HeadImpl(bool tied) {
    if (!tied) weight = register_parameter("weight", torch::randn({kVocab, kWidth}) * 0.3);
  }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(weight.t()); }
};
TORCH_MODULE(Head);

struct NetImpl : torch::nn::Module {
  fsdp::Sharded<torch::nn::Embedding> embed{torch::nn::Embedding(kVocab, kWidth)};
  std::vector<fsdp::Sharded<Block>> blocks;
  fsdp::Sharded<Norm> norm{Norm()};
  fsdp::Sharded<Head> head;
  explicit NetImpl(bool tied) : head(Head(tied)) {
    register_module("embed", embed.ptr());
    for (int i = 0; i < 2; ++i) {
      blocks.emplace_back(Block());
      register_module("b" + std::to_string(i), blocks.back().ptr());
    }
    register_module("norm", norm.ptr());
    register_module("head", head.ptr());
    if (tied) head->weight = head->register_parameter("weight", embed->weight);
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto h = embed(ids);
    for (auto& b : blocks) h = b(h);
    return head(norm(h));
  }
};
TORCH_MODULE(Net);

// The model's parameters, a tied one once (as the shards list it), by name.
std::vector<std::pair<std::string, at::Tensor>> unique_params(torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : m.named_parameters())
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) out.emplace_back(p.key(), p.value());
  return out;
}
std::vector<at::Tensor> tensors(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : named) out.push_back(t);
  return out;
}

at::Tensor ids(int step, int micro, int rank) {
  torch::manual_seed(1000 * step + 10 * micro + rank);
  return torch::randint(kVocab, {3, 4});
}
at::Tensor loss_of(const at::Tensor& logits, int step, int micro, int rank) {
  torch::manual_seed(7 + 1000 * step + 10 * micro + rank);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}),
                                              torch::randint(kVocab, {12}));
}

struct Sharded {
  fsdp::Sharded<Net> m;
  FSDPModule list, root;
  std::shared_ptr<AllReduceAllGather> gathers = std::make_shared<AllReduceAllGather>();
  Sharded(Rank& r, bool tied, std::optional<ReshardAfterForward> reshard, bool checkpointed)
      : m(Net(tied)) {
    m->to(torch::kDouble);
    ShardOptions o = audited();
    o.runtime.activation_checkpointing = checkpointed;
    for (auto& b : m->blocks) fully_shard(b, r.world(), o);
    ShardOptions lo = audited();
    lo.reshard_after_forward = reshard;
    list = tied ? fully_shard({m->embed, m->head}, r.world(), lo)
                : fully_shard({m->norm, m->head}, r.world(), lo);
    list.set_custom_all_gather(gathers);
    root = fully_shard(m, r.world(), audited());
  }
};

// Two micro-batches per step (the first without gradient sync), clipping and AdamW, against the
// unsharded model trained on every rank's data, in fp64. Each forward and each backward gathers
// the list once (twice per micro-batch when it reshards after forward, once when it does not).
void trains_as_unsharded(int world, bool tied, std::optional<ReshardAfterForward> reshard,
                         bool checkpointed) {
  run_ranks(world, [&](Rank& r) {
    torch::manual_seed(0);
    Sharded s(r, tied, reshard, checkpointed);
    torch::manual_seed(0);
    Net ref(tied);
    ref->to(torch::kDouble);
    std::vector<std::string> list_names, root_names;
    for (const auto& i : s.list.shards()) list_names.push_back(i.name);
    for (const auto& i : s.root.shards()) root_names.push_back(i.name);
    const std::vector<std::string> want =
        tied ? std::vector<std::string>{"0.weight"}
             : std::vector<std::string>{"0.gain", "0.bias", "1.weight"};
    EXPECT_EQ(list_names, want);
    const auto ref_params = unique_params(*ref);
    std::vector<std::string> ref_names;
    for (const auto& [name, t] : ref_params) ref_names.push_back(name);
    EXPECT_EQ(root_names, ref_names);
    EXPECT_TRUE(s.m->head.is_sharded() &&
                (tied ? s.m->embed.is_sharded() : s.m->norm.is_sharded()));
    torch::optim::AdamW opt(s.root.parameters(), torch::optim::AdamWOptions(0.05));
    torch::optim::AdamW ref_opt(tensors(ref_params), torch::optim::AdamWOptions(0.05));
    const bool regathers = reshard.value_or(true).world() != 1;
    for (int step = 0; step < 3; ++step) {
      double loss = 0, ref_loss = 0;
      for (int micro = 0; micro < 2; ++micro) {
        const int before = s.gathers->calls;
        s.root.set_requires_gradient_sync(micro == 1);
        auto l = loss_of(s.m(ids(step, micro, r.rank)), step, micro, r.rank);
        EXPECT_EQ(s.gathers->calls - before, 1) << "the forward gathers the list once";
        // Resharded when the forward ended (hpZ: keeping a chunk), or kept for backward.
        EXPECT_EQ(s.root.memory_stats().unsharded_groups, regathers ? 0 : 1);
        l.backward();
        EXPECT_EQ(s.gathers->calls - before, regathers ? 2 : 1);
        loss += l.item<double>();
        for (int k = 0; k < world; ++k) {
          auto rl = loss_of(ref(ids(step, micro, k)), step, micro, k) / world;
          rl.backward();
          if (k == r.rank) ref_loss += rl.item<double>() * world;
        }
      }
      EXPECT_NEAR(loss, ref_loss, 1e-12);
      expect_shard_grads(s.root, full_grads(*ref), 0, 1e-12);
      EXPECT_NEAR(clip_grad_norm_(s.root, 0.5),
                  torch::nn::utils::clip_grad_norm_(tensors(ref_params), 0.5), 1e-12);
      opt.step();
      ref_opt.step();
      opt.zero_grad();
      ref_opt.zero_grad();
    }
    expect_shards_equal(s.root, *ref, 0, 1e-12);
    auto full = full_state_dict(s.root, {/*rank0_only=*/false});
    for (const auto& [name, t] : ref_params) {
      ASSERT_NE(full.find(name), nullptr) << name;
      EXPECT_TRUE(torch::allclose(*full.find(name), t, 0, 1e-12)) << name;
    }
  });
}

TEST(ModuleList, NormAndOutputInOneGroupTrainAsUnsharded) {
  trains_as_unsharded(2, false, std::nullopt, false);
  trains_as_unsharded(3, false, false, true);
}
TEST(ModuleList, TiedEmbeddingAndOutputInOneGroupTrainAsUnsharded) {
  trains_as_unsharded(2, true, std::nullopt, false);
  trains_as_unsharded(4, true, 2, true);  // hpZ: backward gathers within pairs of ranks
}

// A tied weight split over two groups is refused, naming the list as a fix.
TEST(ModuleList, ATiedWeightInTwoGroupsNamesTheList) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Net> m(Net(true));
    fully_shard(m->head, r.world());
    std::string err = error_of([&] { fully_shard(m, r.world()); });
    EXPECT_HAS(err, "is also a parameter of sharded submodule 'head'");
    EXPECT_HAS(err, "pass both modules to one fully_shard call");
    // Tied to a module outside a list: the list's member holding it is named.
    torch::manual_seed(0);
    fsdp::Sharded<Net> t(Net(true));
    fully_shard({t->norm, t->head}, r.world());
    err = error_of([&] { fully_shard(t, r.world()); });
    EXPECT_HAS(err, "'embed.weight' of module");
    EXPECT_HAS(err, "is also a parameter of sharded submodule 'head' (in ModuleList(");
  });
}

TEST(ModuleList, MisuseIsAnErrorNamingTheFix) {
  run_ranks(2, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<Net> m(Net(false));
    EXPECT_HAS(error_of([&] {
                 fully_shard({m->norm, m->norm}, r.world());
               }),
               "is in the list twice (#0 and #1)");
    fsdp::Sharded<Net> outer(Net(false));
    EXPECT_HAS(error_of([&] {
                 fully_shard({outer->norm, outer}, r.world());
               }),
               "lies inside module #1");
    EXPECT_FALSE(m->norm.is_sharded());
    fully_shard(m->head, r.world());
    EXPECT_HAS(error_of([&] {
                 fully_shard({m->norm, m->head}, r.world());
               }),
               "HeadImpl': apply it once per module");
    EXPECT_FALSE(m->norm.is_sharded());
    // A list whose model is not sharded: its first forward names the root.
    fsdp::Sharded<Net> n(Net(false));
    fully_shard({n->norm, n->head}, r.world());
    EXPECT_HAS(error_of([&] {
                 n->norm(torch::randn({2, kWidth}, torch::kDouble));
               }),
               "cannot be its root");
    EXPECT_HAS(error_of([&] { fully_shard(n->norm, r.world()); }), "applied twice");
    // The model sharded before its list.
    fsdp::Sharded<Net> early(Net(false));
    fully_shard(early, r.world());
    EXPECT_HAS(error_of([&] {
                 fully_shard({early->norm, early->head}, r.world());
               }),
               "was called after its parent");
    // A parent holding only part of the list.
    fsdp::Sharded<Net> p(Net(false)), q(Net(false));
    fully_shard({p->norm, q->head}, r.world());
    EXPECT_HAS(error_of([&] { fully_shard(p, r.world()); }), "lies partly outside");
  });
}

}  // namespace
}  // namespace fsdp::testing::module_list_test
