#include "verify_bench.h"

#include <fsdp/fsdp.h>
#include <fsdp/models/gpt.h>
#include <torch/torch.h>

#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/content_faults.h"
#include "util/checksum.h"

namespace fsdp::bench {
// Its own namespace: the unity build compiles this file in one unit with the other benches.
namespace verify_detection {
namespace {

using detail::content_faults::Fault;
using detail::content_faults::Where;

models::GPTConfig model_config() {
  models::GPTConfig c;
  c.vocab_size = 256;
  c.seq_len = 32;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  return c;
}

struct FlipCase {
  std::string name, transport;
  Where where;
  bool bf16 = false, int8_gather = false;
  int bit = -1;  // -1: drawn
};

// Per step of the model (every block resharded after forward, the root kept): the root and the
// blocks gathered in forward, the blocks again in backward, every group reduced once.
int64_t collectives_per_step(Where w) {
  const int64_t blocks = model_config().n_layer;
  return w == Where::kGatheredBlock ? 2 * blocks + 1 : blocks + 1;
}

// Bits of the element the wire carries: fp32 32, bf16 16, an int8 gather's wire 8.
int bits_of(const FlipCase& c) {
  if (c.where == Where::kGatheredBlock && c.int8_gather) return 8;
  return c.bf16 ? 16 : 32;
}

// The class of bit `b` in an element of `bits` bits: sign, exponent, the high half of the
// mantissa, or its low half (an int8 wire byte: "int8").
std::string bit_class(int bits, int b) {
  if (bits == 8) return "int8/scale byte";
  const int mantissa = bits == 32 ? 23 : 7;
  if (b == bits - 1) return "sign";
  if (b >= mantissa) return "exponent";
  return b >= mantissa / 2 ? "mantissa high" : "mantissa low";
}

std::shared_ptr<Communicator> lane(const std::shared_ptr<Communicator>& world,
                                   const std::string& transport) {
  static std::map<std::string, std::shared_ptr<Communicator>> lanes;
  auto& c = lanes[transport];
  if (!c) {
    const char* before = std::getenv("FSDP_TRANSPORT");
    const std::string saved = before ? before : "";
    ::setenv("FSDP_TRANSPORT", transport.c_str(), 1);
    c = world->split("verify-" + transport);
    if (before)
      ::setenv("FSDP_TRANSPORT", saved.c_str(), 1);
    else
      ::unsetenv("FSDP_TRANSPORT");
  }
  return c;
}

// One step of a fresh model with `f` injected; the error it ended with ("" when none).
std::string faulty_step(const std::shared_ptr<Communicator>& comm, const FlipCase& c,
                        const Fault& f) {
  torch::manual_seed(0);
  fsdp::Sharded<models::GPT> gpt{models::GPT(model_config())};
  ShardOptions o;
  o.runtime.verify_period = 1;  // the full check: every byte
  if (c.bf16) {
    o.mixed_precision.param_dtype = torch::kBFloat16;
    o.mixed_precision.reduce_dtype = torch::kBFloat16;
  }
  if (c.int8_gather) o.gather_transform_fn = quantized_gather(Quantization::kInt8);
  for (auto& b : gpt->blocks) fully_shard(b, comm, o);
  fully_shard(gpt, comm, o);
  torch::manual_seed(1000 + comm->rank());
  auto tokens = torch::randint(0, 256, {2, model_config().seq_len + 1});
  detail::content_faults::inject(f);
  std::string error;
  try {
    gpt(tokens.narrow(1, 0, model_config().seq_len), tokens.narrow(1, 1, model_config().seq_len))
        .backward();
  } catch (const fsdp::Error& e) {
    error = e.what();
  }
  detail::content_faults::inject(Fault{});
  return error;
}

// Whether every rank's `error` is the same (compared through checksums).
bool same_everywhere(Communicator& comm, const std::string& error) {
  const int64_t mine = static_cast<int64_t>(detail::checksum_bytes(error.data(), error.size()));
  auto all = torch::empty({comm.size()}, torch::kLong);
  comm.all_gather(all, torch::full({1}, mine, torch::kLong)).wait();
  return (all == mine).all().item<bool>();
}

}  // namespace
}  // namespace verify_detection

int run_verify_detection(const VerifyDetectionOptions& o) {
  using namespace verify_detection;
  auto world = init_process_group();
  const int rank = world->rank(), n = world->size();
  FSDP_CHECK(n >= 2, "--verify-detection needs at least 2 ranks (--nproc 2)");
  std::vector<FlipCase> cases;
  for (const std::string t : {"shm", "tcp"})
    for (bool bf16 : {false, true}) {
      const std::string p = std::string(bf16 ? "bf16" : "fp32") + ", " + t;
      cases.push_back({"all-gather, " + p, t, Where::kGatheredBlock, bf16});
      cases.push_back(
          {"reduce-scatter wire (block as it arrives), " + p, t, Where::kReceivedBlock, bf16});
      cases.push_back(
          {"reduce-scatter sender's buffer (before the wire), " + p, t, Where::kSentBlock, bf16});
      cases.push_back({"reduce-scatter reduced value, " + p, t, Where::kReducedValue, bf16});
    }
  cases.push_back({"all-gather int8 wire (qwZ), shm", "shm", Where::kGatheredBlock, false, true});
  cases.push_back({"reduced value, lowest mantissa bit, fp32, shm", "shm", Where::kReducedValue,
                   false, false, 0});
  std::mt19937_64 draw(o.seed);  // the same draws on every rank
  std::ostringstream table;
  table << "| case | injected | caught | missed | caught by bit: sign / exponent / mantissa high "
           "/ mantissa low (int8 wire: any byte) |\n|---|---|---|---|---|\n";
  for (const FlipCase& c : cases) {
    auto comm = lane(world, c.transport);
    int caught = 0, missed = 0, fired = 0;
    std::map<std::string, std::pair<int, int>> by_class;  // caught, injected
    for (int i = 0; i < o.injections; ++i) {
      Fault f;
      f.where = c.where;
      f.rank = static_cast<int>(draw() % n);
      f.collective = static_cast<int64_t>(draw() % collectives_per_step(c.where));
      f.element = static_cast<int64_t>(draw() % (1 << 30));
      const int bits = bits_of(c);
      f.bit = c.bit >= 0 ? c.bit : static_cast<int>(draw() % bits);
      const int64_t flips_before = detail::content_faults::flips();
      const std::string e = faulty_step(comm, c, f);
      // The flip took effect on some rank (the sender's receivers, or the rank itself).
      auto any = torch::full({1}, detail::content_faults::flips() - flips_before, torch::kLong);
      world->all_reduce(any, ReduceOp::kSum).wait();
      FSDP_CHECK(any.item<int64_t>() > 0, "--verify-detection: injection ", i, " of '", c.name,
                 "' flipped nothing (collective ", f.collective, " of its kind not reached)");
      ++fired;
      const bool ok = !e.empty() && e.find("Verified collectives: ") != std::string::npos &&
                      e.find("iteration 1 ") != std::string::npos;
      FSDP_CHECK(same_everywhere(*world, e), "--verify-detection: the ranks ended injection ", i,
                 " of '", c.name, "' differently: ", e);
      auto& cls = by_class[bit_class(bits, f.bit)];
      ++cls.second;
      if (ok) {
        ++caught;
        ++cls.first;
      } else {
        FSDP_CHECK(e.empty(), "--verify-detection: injection ", i, " of '", c.name,
                   "' ended with another error: ", e);
        ++missed;
      }
    }
    nlohmann::ordered_json j;
    j["case"] = c.name;
    j["world"] = n;
    j["injected"] = fired;
    j["caught"] = caught;
    j["missed"] = missed;
    std::string classes;
    const bool int8 = by_class.count("int8/scale byte") > 0;
    for (const char* k : {"sign", "exponent", "mantissa high", "mantissa low", "int8/scale byte"}) {
      if (int8 != (std::string(k) == "int8/scale byte")) continue;
      const auto [got, of] = by_class.count(k) ? by_class[k] : std::pair<int, int>{0, 0};
      if (of > 0) j["by_bit"][k] = {got, of};
      classes += (classes.empty() ? "" : " / ") +
                 (of > 0 ? std::to_string(got) + " of " + std::to_string(of) : std::string("-"));
    }
    if (rank == 0) {
      std::cout << j.dump() << std::endl;
      table << "| " << c.name << " | " << fired << " | " << caught << " | " << missed << " | "
            << classes << " |\n";
    }
  }
  if (rank == 0) std::cout << table.str() << std::flush;
  return 0;
}

}  // namespace fsdp::bench
