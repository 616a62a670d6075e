// Quantized collectives (fsdp/quantized.h): the wire's encoding against its definition, the
// quantized reduce-scatter bit for bit against a reference that decodes and sums the same way (and
// its wire digests matching across ranks), Communicator::all_to_all on every transport, and the
// tiny GPT trained with each quantized setting within its tolerance of the exact run, its shards
// fp32 and its bytes on the wire cut as stated. The 500-step figures of the default fsdp-train
// job are docs/verified_collectives.md's.
#include <fsdp/models/gpt.h>
#include <fsdp/quantized.h>

#include <cmath>

#include "fsdp_test_util.h"
#include "tiny_gpt.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::quantized_test {
namespace {

using fsdp::models::GPT;

// ---------------------------------------------------------------------------------------------
// The encoding
// ---------------------------------------------------------------------------------------------
TEST(QuantizedWire, Bf16IsRoundingToBfloat16) {
  torch::manual_seed(1);
  auto x = torch::randn({300}) * 3;
  QuantizedGather g(Quantization::kBf16, torch::kFloat);
  EXPECT_EQ(g.wire_bytes(300), 600);
  auto wire = torch::empty({600}, torch::kByte);
  g.pre_all_gather(x, wire);
  auto rows = torch::empty({1, 300});
  g.post_all_gather(wire.view({1, 600}), rows);
  EXPECT_TRUE(torch::equal(rows[0], x.to(torch::kBFloat16).to(torch::kFloat)));
  EXPECT_TRUE(torch::equal(quantize_round_trip(x, Quantization::kBf16), rows[0]));
}

TEST(QuantizedWire, Int8HasOneScalePerBlock) {
  torch::manual_seed(2);
  for (int block : {64, 128, 256}) {
    SCOPED_TRACE("block " + std::to_string(block));
    // Blocks of very different magnitudes, a block of zeros, and a partial last block.
    auto x = torch::randn({4 * block + 37});
    x.narrow(0, 0, block).mul_(1e-3);
    x.narrow(0, block, block).mul_(1e3);
    x.narrow(0, 2 * block, block).zero_();
    QuantizedGather g(Quantization::kInt8, torch::kFloat, block);
    const int64_t n = x.numel(), blocks = (n + block - 1) / block;
    EXPECT_EQ(g.wire_bytes(n), n + 4 * blocks);
    const auto y = quantize_round_trip(x, Quantization::kInt8, block);
    for (int64_t b = 0; b < blocks; ++b) {
      const auto xs = x.narrow(0, b * block, std::min<int64_t>(block, n - b * block));
      const auto ys = y.narrow(0, b * block, xs.numel());
      const double scale = xs.abs().max().item<double>() / 127;
      // Each value within half a step of its block's scale; the block's largest exactly +-127.
      EXPECT_LE((xs - ys).abs().max().item<double>(), scale * 0.5 * (1 + 1e-5) + 1e-30);
      if (scale == 0) {
        EXPECT_TRUE(torch::equal(ys, torch::zeros_like(ys)));
      }
    }
  }
  EXPECT_HAS(error_of([] { QuantizedGather(Quantization::kInt8, torch::kFloat, 32); }),
             "int8 blocks of 32 values; use 64 to 256");
  EXPECT_HAS(error_of([] { QuantizedGather(Quantization::kBf16, torch::kLong); }),
             "cannot be quantized");
  EXPECT_HAS(error_of([] { parse_quantization("int4"); }), "is not one of none, bf16, int8");
  // A block that is not finite stays so (0 * NaN), instead of passing as zeros.
  auto bad = torch::ones({128});
  bad[3] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(torch::isnan(quantize_round_trip(bad, Quantization::kInt8)).all().item<bool>());
}

// ---------------------------------------------------------------------------------------------
// all_to_all and the quantized reduce-scatter
// ---------------------------------------------------------------------------------------------
// Rank r's input on every rank: a function of (seed, r), so each rank can compute the reference.
torch::Tensor input_of(int rank, int world, int64_t n, at::ScalarType dtype) {
  torch::manual_seed(100 + rank);
  return (torch::randn({world * n}) * (1 + rank)).to(dtype);
}

TEST(QuantizedReduceScatter, MatchesTheSameDecodingSummedInRankOrder) {
  for (int world : {2, 3})
    run_ranks(world, [](Rank& r) {
      for (const std::string transport : {"shm", "tcp", "collective"}) {
        std::shared_ptr<Communicator> comm;
        {
          ScopedTransport t(transport);
          comm = r.world()->split("q-" + transport);
        }
        const int n_ranks = comm->size(), me = comm->rank();
        for (auto q : {Quantization::kBf16, Quantization::kInt8})
          for (auto dtype : {torch::kFloat, torch::kBFloat16})
            for (auto op : {ReduceOp::kAvg, ReduceOp::kSum}) {
              SCOPED_TRACE(transport + " " + to_string(q) + " " + c10::toString(dtype) +
                           (op == ReduceOp::kAvg ? " mean" : " sum"));
              const int64_t n = 1000;  // not a multiple of the block: a partial block each
              auto in = input_of(me, n_ranks, n, dtype);
              auto out = in.narrow(0, me * n, n);  // in place, as fully_shard reduces
              QuantizedReduceScatter rs(q);
              Work w = rs(out, in, op, *comm);
              w.wait();
              auto acc = torch::zeros({n});
              for (int k = 0; k < n_ranks; ++k)
                acc += quantize_round_trip(input_of(k, n_ranks, n, dtype).narrow(0, me * n, n), q)
                           .to(torch::kFloat);
              if (op == ReduceOp::kAvg) acc /= n_ranks;
              EXPECT_TRUE(torch::equal(out, acc.to(dtype)));
              // What each rank sent to another is what that one received, digest for digest.
              const auto d = w.digests();
              ASSERT_TRUE(d != nullptr);
              auto mine = torch::empty({2 * n_ranks}, torch::kLong);
              for (int k = 0; k < n_ranks; ++k) {
                mine[k] = static_cast<int64_t>(d->sent[k]);
                mine[n_ranks + k] = static_cast<int64_t>(d->received[k]);
              }
              auto all = torch::empty({n_ranks, 2 * n_ranks}, torch::kLong);
              comm->all_gather(all, mine).wait();
              for (int s = 0; s < n_ranks; ++s)
                for (int x = 0; x < n_ranks; ++x)
                  if (s != x) {
                    EXPECT_EQ(all[s][x].item<int64_t>(), all[x][n_ranks + s].item<int64_t>());
                  }
            }
        // all_to_all itself: block j of rank s lands as block s on rank j.
        auto send = torch::arange(n_ranks * 5, torch::kFloat) + 100 * me;
        auto recv = torch::empty_like(send);
        comm->all_to_all(recv, send).wait();
        for (int s = 0; s < n_ranks; ++s)
          EXPECT_TRUE(torch::equal(recv.narrow(0, s * 5, 5),
                                   torch::arange(me * 5, me * 5 + 5, torch::kFloat) + 100 * s));
        EXPECT_HAS(error_of([&] { comm->all_to_all(send, send); }), "shares storage");
        EXPECT_HAS(error_of([&] { comm->all_to_all(recv, torch::zeros({n_ranks * 5 + 1})); }),
                   "equal blocks");
      }
    });
}

// ---------------------------------------------------------------------------------------------
// The quantized gather against a reference that quantizes the same way
// ---------------------------------------------------------------------------------------------
// `p`'s values as the quantized gather delivers them at world size n: each rank's part (a dim-0
// chunk of ceil(d / n) rows, zero-padded to that size, as fully_shard lays out a shard) encoded
// and decoded on its own.
torch::Tensor quantized_per_rank_part(const torch::Tensor& p, int n, Quantization q) {
  if (p.dim() == 0) return quantize_round_trip(p, q).view({});
  const int64_t d = p.size(0), row = p.numel() / std::max<int64_t>(d, 1), c = (d + n - 1) / n;
  std::vector<torch::Tensor> parts;
  for (int k = 0; k < n; ++k) {
    const int64_t lo = std::min(d, k * c), hi = std::min(d, lo + c);
    if (hi == lo) continue;
    auto padded = torch::zeros({c * row});
    padded.narrow(0, 0, (hi - lo) * row).copy_(p.narrow(0, lo, hi - lo).reshape({-1}));
    parts.push_back(quantize_round_trip(padded, q).narrow(0, 0, (hi - lo) * row));
  }
  return torch::cat(parts).view(p.sizes());
}

// The sharded tiny GPT's loss with weights gathered on a quantized wire equals an unsharded
// copy's on weights quantized per rank part (the same values: the same loss, to fp32 rounding),
// and differs from the exact model's.
TEST(QuantizedGather, EqualsTheUnshardedModelOnWeightsQuantizedPerRankPart) {
  for (int world : {2, 3})
    run_ranks(world, [](Rank& r) {
      const int n = r.world()->size();
      torch::manual_seed(900 + r.rank);
      auto tokens = torch::randint(0, tiny_gpt().vocab_size, {2, tiny_gpt().seq_len + 1});
      const auto x = tokens.narrow(1, 0, tiny_gpt().seq_len),
                 y = tokens.narrow(1, 1, tiny_gpt().seq_len);
      torch::manual_seed(0);
      GPT exact(tiny_gpt());
      const double exact_loss = exact->forward(x, y).item<double>();
      for (auto q : {Quantization::kBf16, Quantization::kInt8}) {
        SCOPED_TRACE(std::string(to_string(q)) + " at N = " + std::to_string(n));
        torch::manual_seed(0);
        GPT reference(tiny_gpt());
        {
          torch::NoGradGuard no_grad;
          for (auto& item : reference->named_parameters())
            item.value().copy_(quantized_per_rank_part(item.value().detach(), n, q));
        }
        torch::manual_seed(0);
        fsdp::Sharded<GPT> gpt{GPT(tiny_gpt())};
        ShardOptions o;
        o.gather_transform_fn = quantized_gather(q);
        for (auto& b : gpt->blocks) fully_shard(b, r.world(), o);
        fully_shard(gpt, r.world(), o);
        const double loss = gpt(x, y).item<double>(),
                     want = reference->forward(x, y).item<double>();
        EXPECT_NEAR(loss, want, 1e-6 * std::abs(want));
        EXPECT_GT(std::abs(loss - exact_loss), 1e-6 * std::abs(exact_loss)) << "not quantized";
      }
    });
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------
constexpr int kSteps = 40;

struct Trained {
  std::vector<double> losses;
  int64_t gather_bytes = 0, reduce_bytes = 0;  // this rank's bytes on the wire over the steps
  bool shards_fp32 = true;
};

Trained train(Rank& r, Quantization gather, Quantization reduce) {
  torch::manual_seed(0);
  fsdp::Sharded<GPT> gpt{GPT(tiny_gpt())};
  auto comm = r.world()->split(std::string("train-") + to_string(gather) + to_string(reduce));
  ShardOptions o;
  o.gather_transform_fn = quantized_gather(gather);
  std::vector<FSDPModule> groups;
  for (auto& b : gpt->blocks) groups.push_back(fully_shard(b, comm, o));
  FSDPModule root = fully_shard(gpt, comm, o);
  groups.push_back(root);
  set_quantized_reduce_scatter(groups, reduce);
  torch::optim::AdamW opt(root.parameters(), torch::optim::AdamWOptions(3e-3));
  Trained t;
  for (const char* lane : {"fsdp.all_gather", "fsdp.reduce_scatter"})
    comm->lane(lane)->reset_stats();
  for (int s = 0; s < kSteps; ++s) {
    // A learnable stream (each row counts up by a stride from a random start), one batch per
    // step, each rank its half: the loss falls far below a uniform guess's, so that what the
    // quantized wire changes shows.
    torch::manual_seed(700 + s);
    auto starts = torch::randint(0, tiny_gpt().vocab_size, {8, 1});
    auto strides = torch::randint(1, 4, {8, 1});
    auto tokens = (starts + strides * torch::arange(tiny_gpt().seq_len + 1).unsqueeze(0))
                      .remainder(tiny_gpt().vocab_size);
    auto mine = tokens.narrow(0, 4 * r.rank, 4);
    auto loss = gpt(mine.narrow(1, 0, tiny_gpt().seq_len), mine.narrow(1, 1, tiny_gpt().seq_len));
    loss.backward();
    opt.step();
    opt.zero_grad();
    t.losses.push_back(loss.item<double>());
  }
  // The lanes the root's all-gathers and reduce-scatters travel on (core/comm_context.cpp).
  t.gather_bytes = comm->lane("fsdp.all_gather")->stats().bytes_sent;
  t.reduce_bytes = comm->lane("fsdp.reduce_scatter")->stats().bytes_sent;
  for (const auto& s : root.shards()) t.shards_fp32 &= s.shard.scalar_type() == torch::kFloat;
  return t;
}

// The loss of the last steps (their mean: one step's loss is noisy) within `tol` of the exact
// run's, relatively; each lane's bytes on the wire at most `gather` and `reduce` of the exact
// run's (the tiny GPT's int8 gathers pay more for their scales than a large model's: its shards
// are a few dozen values each).
TEST(QuantizedTraining, StaysWithinItsToleranceOfTheExactRun) {
  run_ranks(2, [](Rank& r) {
    const Trained exact = train(r, Quantization::kNone, Quantization::kNone);
    auto tail = [](const Trained& t) {
      double s = 0;
      for (int k = kSteps - 10; k < kSteps; ++k) s += t.losses[k];
      return s / 10;
    };
    struct Case {
      Quantization gather, reduce;
      double tol, gather_bytes, reduce_bytes;
    };
    for (const Case& c : {Case{Quantization::kBf16, Quantization::kNone, 0.002, 0.55, 1},
                          Case{Quantization::kInt8, Quantization::kNone, 0.005, 0.4, 1},
                          Case{Quantization::kNone, Quantization::kBf16, 0.002, 1, 0.5},
                          Case{Quantization::kNone, Quantization::kInt8, 0.005, 1, 0.3},
                          Case{Quantization::kInt8, Quantization::kInt8, 0.005, 0.4, 0.3}}) {
      SCOPED_TRACE(std::string("gather ") + to_string(c.gather) + ", reduce " +
                   to_string(c.reduce));
      const Trained q = train(r, c.gather, c.reduce);
      EXPECT_TRUE(q.shards_fp32);
      EXPECT_NE(q.losses.back(), exact.losses.back()) << "quantized, yet exactly the same";
      EXPECT_LE(std::abs(tail(q) - tail(exact)), c.tol * tail(exact))
          << "last losses " << tail(q) << " against " << tail(exact);
      EXPECT_LE(q.gather_bytes, c.gather_bytes * exact.gather_bytes);
      EXPECT_LE(q.reduce_bytes, c.reduce_bytes * exact.reduce_bytes);
    }
  });
}

}  // namespace
}  // namespace fsdp::testing::quantized_test
