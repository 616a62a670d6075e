// Verified collectives (RuntimeOptions::verify_collectives, src/core/verified.h): the check rides
// every step of ordinary training without changing a value or failing where nothing is wrong
// (transports, world sizes, mixed precision, hpZ, HSDP, gather transforms, custom collectives);
// one bit flipped in a payload (src/core/content_faults.h) stops every rank in its step with the
// same error naming the collective, the module, the ranks and the step; a flip of the lowest
// mantissa bit of a reduced value is below the sum's rounding bound (not caught, as documented);
// settings that differ between ranks stop every rank by name. The table of 100 random flips per
// case is fsdp-bench --verify-detection's (docs/verified_collectives.md).
#include <fsdp/models/gpt.h>
#include <fsdp/quantized.h>

#include "core/content_faults.h"
#include "core/payload_digest.h"
#include "core/verified.h"
#include "fsdp_test_util.h"
#include "tiny_gpt.h"
#include "util/checksum.h"

// A namespace of its own: the unity build compiles this file in one unit with others.
namespace fsdp::testing::verified_collectives_test {
namespace {

using detail::content_faults::Fault;
using detail::content_faults::Where;
using fsdp::models::GPT;

constexpr int64_t kRows = 2;  // sequences per rank and step

std::pair<torch::Tensor, torch::Tensor> batch(int step, int rank) {
  torch::manual_seed(500 + 31 * step + rank);
  auto tokens =
      torch::randint(0, tiny_gpt().vocab_size, {kRows, tiny_gpt().seq_len + 1}, torch::kLong);
  return {tokens.narrow(1, 0, tiny_gpt().seq_len), tokens.narrow(1, 1, tiny_gpt().seq_len)};
}

struct Config {
  std::string transport;  // "", "shm", "tcp", "collective"
  bool bf16 = false;      // param_dtype and reduce_dtype bf16
  int period = 1;
  bool verify = true;
  int hpz = 0;       // reshard_after_forward world of the blocks (0: true)
  int replicas = 1;  // HSDP
  Quantization gather = Quantization::kNone;
  Quantization reduce = Quantization::kNone;
};

// The tiny GPT sharded per block and at the root, its AdamW.
struct Model {
  fsdp::Sharded<GPT> gpt{nullptr};
  FSDPModule root;
  std::vector<FSDPModule> groups;
  std::unique_ptr<torch::optim::AdamW> opt;
};

std::shared_ptr<Communicator> comm_for(Rank& r, const std::string& transport) {
  if (transport.empty()) return r.world();
  static std::map<std::string, std::shared_ptr<Communicator>> lanes;
  auto& c = lanes[transport];
  if (!c) c = r.lane_over(transport);
  return c;
}

std::unique_ptr<Model> build(Rank& r, const Config& s) {
  auto m = std::make_unique<Model>();
  torch::manual_seed(0);
  m->gpt = fsdp::Sharded<GPT>{GPT(tiny_gpt())};
  auto comm = comm_for(r, s.transport);
  ShardOptions o;
  o.runtime.verify_collectives = s.verify;
  o.runtime.verify_period = s.period;
  if (s.bf16) {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
  }
  o.gather_transform_fn = quantized_gather(s.gather);
  ShardOptions blocks = o;
  if (s.hpz > 0) blocks.reshard_after_forward = s.hpz;
  if (s.replicas > 1) {
    ScopedTransport t(s.transport);
    DeviceMesh mesh = init_mesh(comm, s.replicas);
    for (auto& b : m->gpt->blocks) m->groups.push_back(fully_shard(b, mesh, blocks));
    m->root = fully_shard(m->gpt, mesh, o);
  } else {
    for (auto& b : m->gpt->blocks) m->groups.push_back(fully_shard(b, comm, blocks));
    m->root = fully_shard(m->gpt, comm, o);
  }
  m->groups.push_back(m->root);
  set_quantized_reduce_scatter(m->groups, s.reduce);
  m->opt =
      std::make_unique<torch::optim::AdamW>(m->root.parameters(), torch::optim::AdamWOptions(1e-2));
  return m;
}

double step(Model& m, int s, int rank) {
  auto [x, y] = batch(s, rank);
  auto loss = m.gpt(x, y);
  loss.backward();
  m.opt->step();
  m.opt->zero_grad();
  return loss.item<double>();
}

// Every rank's `text` equal: compared through their checksums.
void expect_same_on_every_rank(Communicator& comm, const std::string& text) {
  const int64_t mine = static_cast<int64_t>(detail::checksum_bytes(text.data(), text.size()));
  auto all = torch::empty({comm.size()}, torch::kLong);
  comm.all_gather(all, torch::full({1}, mine, torch::kLong)).wait();
  for (int r = 0; r < comm.size(); ++r)
    EXPECT_EQ(all[r].item<int64_t>(), mine) << "rank " << r << " threw another error than " << text;
}

// ---------------------------------------------------------------------------------------------
// No false alarm, no change
// ---------------------------------------------------------------------------------------------

// Trains `steps` steps with the check on, then off: the same losses bit for bit, and every
// forward and backward checked while on.
void train_on_and_off(Rank& r, const Config& s, int steps = 3) {
  SCOPED_TRACE("transport '" + s.transport + "'" + (s.bf16 ? ", bf16" : "") + ", period " +
               std::to_string(s.period));
  std::vector<double> on, off;
  const int64_t before = detail::VerifiedCollectives::checks_passed();
  {
    auto m = build(r, s);
    for (int k = 0; k < steps; ++k) on.push_back(step(*m, k, r.rank));
  }
  const int64_t checked = detail::VerifiedCollectives::checks_passed() - before;
  Config unverified = s;
  unverified.verify = false;
  {
    auto m = build(r, unverified);
    for (int k = 0; k < steps; ++k) off.push_back(step(*m, k, r.rank));
  }
  EXPECT_EQ(detail::VerifiedCollectives::checks_passed() - before, checked) << "checked while off";
  EXPECT_EQ(checked, 2 * steps) << "one check at the end of every forward and every backward";
  for (int k = 0; k < steps; ++k) EXPECT_EQ(on[k], off[k]) << "step " << k;
}

TEST(VerifiedCollectives, ChecksEveryStepWithoutChangingAValue) {
  for (int world : {2, 3})
    run_ranks(world, [](Rank& r) {
      for (const std::string transport : {"shm", "tcp", "collective"}) {
        train_on_and_off(r, Config{transport});
        train_on_and_off(r, Config{transport, /*bf16=*/true, /*period=*/8});
      }
    });
}

// hpZ's post-forward lanes, quantized gathers (the wire checked) and reductions (their wire
// digests), HSDP (checked within each shard group), at N = 4.
TEST(VerifiedCollectives, CoversHpzQuantizedWiresAndHsdp) {
  RunOptions o;
  o.timeout = std::chrono::seconds(240);
  run_ranks(
      4,
      [](Rank& r) {
        Config hpz{"shm"};
        hpz.hpz = 2;
        train_on_and_off(r, hpz);
        Config quantized{"tcp"};
        quantized.gather = Quantization::kInt8;
        quantized.reduce = Quantization::kInt8;
        train_on_and_off(r, quantized);
        Config hsdp{"shm"};
        hsdp.replicas = 2;
        train_on_and_off(r, hsdp);
      },
      o);
}

// ---------------------------------------------------------------------------------------------
// Flips
// ---------------------------------------------------------------------------------------------
struct FlipCase {
  Where where;
  const char* kind;      // in the message
  const char* culprits;  // in the message, at N = 2 with rank 1 faulty
};

// A bit of the exponent (caught whatever the value): fp32's highest, bf16's highest.
int exponent_bit(bool bf16) { return bf16 ? 14 : 30; }

TEST(VerifiedCollectives, AFlipIsCaughtOnEveryRankInItsStep) {
  const std::vector<FlipCase> cases = {
      {Where::kGatheredBlock, "all-gather #", "the bytes rank 1 sent arrived different on rank 0"},
      {Where::kSentBlock, "reduce-scatter #", "the reduced gradient shard on rank 0 differs"},
      {Where::kReceivedBlock, "reduce-scatter #",
       "the bytes rank 1 sent to rank 0 arrived different"},
      {Where::kReducedValue, "reduce-scatter #", "the reduced gradient shard on rank 1 differs"}};
  run_ranks(2, [&](Rank& r) {
    for (const std::string transport : {"shm", "tcp", "collective"})
      for (bool bf16 : {false, true})
        for (const auto& c : cases)
          for (int at_step : {0, 1}) {
            SCOPED_TRACE(transport + (bf16 ? " bf16 " : " fp32 ") + c.kind + " in step " +
                         std::to_string(at_step + 1));
            auto m = build(r, Config{transport, bf16});
            // Step 1 has 3 gathers in forward (the root, both blocks), 2 in backward, and 3
            // reductions: the second of its kind, or the same one in step 2.
            // A bit of the exponent; on the wire (digested exactly) the lowest mantissa bit.
            const bool gather = c.where == Where::kGatheredBlock;
            const int bit = c.where == Where::kReceivedBlock ? 0 : exponent_bit(bf16);
            detail::content_faults::inject(
                Fault{c.where, 1, (gather ? 5 : 3) * at_step + 1, 7, bit});
            std::string e;
            for (int k = 0; k <= at_step && e.empty(); ++k) try {
                step(*m, k, r.rank);
              } catch (const fsdp::Error& err) {
                e = err.what();
                EXPECT_EQ(k, at_step) << "caught in another step";
              }
            detail::content_faults::inject(Fault{});
            EXPECT_HAS(e, "Verified collectives: ");
            EXPECT_HAS(e, c.kind);
            EXPECT_HAS(e, c.culprits);
            EXPECT_HAS(e, "iteration " + std::to_string(at_step + 1));
            EXPECT_HAS(e, gather ? "(the check at the end of its forward)"
                                 : "(the check at the end of its backward)");
            EXPECT_HAS(e, "of module '");
            EXPECT_HAS(e, "RuntimeOptions::verify_collectives = false");
            EXPECT_HAS(e, "FSDP_VERIFY_COLLECTIVES=0");
            expect_same_on_every_rank(*r.world(), e);
          }
  });
}

// The default's rotating part: in one iteration the wire digests of a reduce-scatter cover one
// eighth of each block, the slice the sketch covers. Of eight flips of the lowest bit of a received
// value, one in the middle of each eighth of block 0's reduction, exactly one is caught in that
// step; with the full check (period 1) all eight are. (Whether every slice comes round within 8
// iterations is the next test's.)
TEST(VerifiedCollectives, TheDefaultChecksOneEighthOfEachReductionsWirePerIteration) {
  run_ranks(2, [](Rank& r) {
    for (int period : {8, 1}) {
      int caught = 0;
      for (int slice = 0; slice < 8; ++slice) {
        SCOPED_TRACE("period " + std::to_string(period) + ", slice " + std::to_string(slice));
        Config c{"shm"};
        c.period = period;
        auto m = build(r, c);
        // Reduction #1 of step 1 is block 0's: its block, the padded shards of its parameters.
        int64_t n = 0;
        for (const auto& s : m->groups[0].shards())
          n += s.rows_per_rank * (s.shard.numel() / std::max<int64_t>(s.shard.size(0), 1));
        ASSERT_GT(n, 64);
        detail::content_faults::inject(
            Fault{Where::kReceivedBlock, 1, 1, slice * n / 8 + n / 16, 0});
        try {
          step(*m, 0, r.rank);
        } catch (const fsdp::Error& e) {
          EXPECT_HAS(e.what(), "the bytes rank 1 sent to rank 0 arrived different");
          ++caught;
        }
        detail::content_faults::inject(Fault{});
      }
      EXPECT_EQ(caught, period == 8 ? 1 : 8);
    }
  });
}

// Any `period` consecutive iterations check every unit of every group's payload exactly once.
TEST(VerifiedCollectives, TheRotatingPartCoversEveryByteWithinThePeriod) {
  for (int period : {1, 3, 8})
    for (int64_t units : {1, 7, 64, 1001})
      for (int64_t group : {0, 5})
        for (int64_t first : {0, 13}) {
          std::vector<int> seen(static_cast<size_t>(units), 0);
          for (int64_t step = first; step < first + period; ++step) {
            const auto part = detail::rotating_part(units, step, group, period);
            for (int64_t u = part.lo; u < part.hi; ++u) ++seen[static_cast<size_t>(u)];
          }
          for (int64_t u = 0; u < units; ++u)
            EXPECT_EQ(seen[static_cast<size_t>(u)], 1)
                << "unit " << u << " of " << units << ", period " << period;
        }
}

// One ulp of one reduced value is below the sum's rounding bound: not caught, and the flip is
// real (that element of the shard's gradient differs from a clean run's, by one ulp).
TEST(VerifiedCollectives, TheLowestMantissaBitOfAReducedValueIsBelowTheBound) {
  run_ranks(2, [](Rank& r) {
    auto grads = [&](bool flip) {
      auto m = build(r, Config{"shm"});
      if (flip) detail::content_faults::inject(Fault{Where::kReducedValue, r.rank, 0, 5, 0});
      auto [x, y] = batch(0, r.rank);
      m->gpt(x, y).backward();
      detail::content_faults::inject(Fault{});
      std::vector<torch::Tensor> out;
      for (const auto& s : m->root.shards())
        if (s.shard.grad().defined()) out.push_back(s.shard.grad().reshape({-1}).clone());
      return torch::cat(out);
    };
    const auto clean = grads(false), flipped = grads(true);
    EXPECT_EQ((clean != flipped).sum().item<int64_t>(), 1) << "one element flipped, uncaught";
  });
}

// With the check off, nothing is digested, and faults are not applied by it.
TEST(VerifiedCollectives, SettingsThatDifferStopEveryRankByName) {
  run_ranks(2, [](Rank& r) {
    Config s{"shm"};
    s.verify = r.rank == 0;
    auto m = build(r, s);
    const std::string e = error_of([&] { step(*m, 0, r.rank); });
    EXPECT_HAS(e, "verified collectives are on for ranks 0 but off for ranks 1");
    EXPECT_HAS(e, "RuntimeOptions::verify_collectives");
  });
  run_ranks(2, [](Rank& r) {
    Config s{"shm"};
    s.period = 1 + 7 * r.rank;
    auto m = build(r, s);
    EXPECT_HAS(error_of([&] { step(*m, 0, r.rank); }),
               "RuntimeOptions::verify_period differs between ranks");
  });
}

// A custom reduce-scatter is checked by the digests of its wire it attaches to its Work: one
// whose rank 1 reports another digest for what rank 0 sent stops every rank, naming both.
struct MisreportingReduceScatter : ReduceScatter {
  Work operator()(const at::Tensor& out, const at::Tensor& in, ReduceOp op,
                  Communicator& g) override {
    auto d = std::make_shared<Work::Digests>();
    d->sent.assign(g.size(), 11);
    d->received.assign(g.size(), g.rank() == 1 ? 12 : 11);
    d->sent[g.rank()] = d->received[g.rank()] = 0;
    return g.reduce_scatter(out, in, op).with_digests(d);
  }
};

TEST(VerifiedCollectives, ACustomReductionIsCheckedByItsWireDigests) {
  run_ranks(2, [](Rank& r) {
    auto m = build(r, Config{"shm"});
    m->groups[0].set_custom_reduce_scatter(std::make_shared<MisreportingReduceScatter>());
    const std::string e = error_of([&] { step(*m, 0, r.rank); });
    EXPECT_HAS(e, "a custom collective): the bytes rank 0 sent to rank 1 arrived different");
    expect_same_on_every_rank(*r.world(), e);
  });
}

TEST(VerifiedCollectives, RejectsAPeriodBelowOne) {
  run_ranks(1, [](Rank& r) {
    torch::manual_seed(0);
    fsdp::Sharded<GPT> gpt{GPT(tiny_gpt())};
    ShardOptions o;
    o.runtime.verify_period = 0;
    EXPECT_HAS(error_of([&] { fully_shard(gpt, r.world(), o); }),
               "RuntimeOptions::verify_period is 0; it must be at least 1");
  });
}

}  // namespace
}  // namespace fsdp::testing::verified_collectives_test
