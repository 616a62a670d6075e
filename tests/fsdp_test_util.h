// Helpers for fully_shard tests: an unsharded reference (mean of per-rank full gradients, computed
// in-process from every rank's seeded data) and comparisons against the shards.
#pragma once

#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "harness.h"

namespace fsdp::testing {

using GradMap = std::map<std::string, torch::Tensor>;

// Full gradients of `m` by original name (undefined when none).
inline GradMap full_grads(torch::nn::Module& m) {
  GradMap out;
  for (auto& item : m.named_parameters())
    if (item.value().grad().defined()) out[item.key()] = item.value().grad().clone();
  return out;
}

// Mean over ranks of the full gradients produced by `step(model, k)` on a fresh model per rank.
template <class Build, class Step>
GradMap reference_mean_grads(int world, Build build, Step step) {
  GradMap sum;
  for (int k = 0; k < world; ++k) {
    auto model = build();
    step(model, k);
    for (auto& [name, g] : full_grads(*model.ptr())) {
      auto v = g.defined() ? g : torch::Tensor();
      if (!v.defined()) continue;
      sum[name] = sum.count(name) ? sum[name] + v : v.clone();
    }
  }
  for (auto& [name, g] : sum) g.div_(world);
  return sum;
}

// The reference's gradients after every rank's backward ran on it (accumulated), over `world`:
// the mean over ranks that sharded training must reproduce.
inline GradMap mean_of_accumulated_grads(torch::nn::Module& ref, int world) {
  GradMap out;
  for (auto& item : ref.named_parameters())
    if (item.value().grad().defined()) out[item.key()] = item.value().grad() / world;
  return out;
}

// The part of the full tensor `full` (the parameter's shape) that shard `s` holds: its rows of
// dim s.dim, shaped like the shard.
inline torch::Tensor rows_of(const ShardInfo& s, const torch::Tensor& full) {
  const torch::Tensor t = full.dim() == 0 ? full.reshape({1}) : full;
  return t.narrow(s.dim, s.row_offset, s.shard.dim() == 0 ? 1 : s.shard.size(s.dim))
      .reshape(s.shard.sizes());
}

// Every trainable shard's grad equals its rows of the reference; an ignored parameter's gradient
// is this rank's own, equal to the reference's where that has one and absent where it has none.
// Where the reference has no entry, `absent_means_none` asks for no gradient (a parameter no rank
// gave a gradient keeps none, as in the unsharded model), else for none or zeros. Returns the
// number of parameters compared.
// `normwise`: each element may also differ by rtol times the largest value of its parameter's
// reference (rounding in a lower precision, relative to the tensor's scale rather than to an
// element that cancellation made small).
inline int expect_shard_grads(const FSDPModule& root, const GradMap& ref, double rtol = 1e-5,
                              double atol = 1e-6, bool normwise = false,
                              bool absent_means_none = false) {
  int compared = 0;
  for (const auto& s : root.shards()) {
    if (!s.requires_grad) {
      EXPECT_FALSE(s.shard.grad().defined()) << "frozen parameter " << s.name << " got a gradient";
      continue;
    }
    SCOPED_TRACE("parameter " + s.name);
    auto it = ref.find(s.name);
    if (s.ignored && (it == ref.end() || !s.shard.grad().defined())) {
      EXPECT_EQ(s.shard.grad().defined(), it != ref.end())
          << "ignored parameter " << s.name << ": a gradient where the reference "
          << (it == ref.end() ? "has none" : "has one");
      ++compared;
      continue;
    }
    if (it == ref.end() && (absent_means_none || !s.shard.grad().defined())) {
      EXPECT_FALSE(s.shard.grad().defined())
          << s.name << ": a gradient where the reference has none (no rank gave it one)";
      ++compared;
      continue;
    }
    if (!s.shard.grad().defined()) {
      ADD_FAILURE() << s.name << ": shard has no gradient";
      continue;
    }
    torch::Tensor expect;
    double scale_atol = atol;
    if (it != ref.end()) {
      expect = rows_of(s, it->second);
      if (normwise && it->second.numel() > 0)
        scale_atol += rtol * it->second.abs().max().item<double>();
    } else {
      expect = torch::zeros_like(s.shard);
    }
    auto got = s.shard.grad().reshape(expect.sizes());
    EXPECT_TRUE(torch::allclose(got, expect, rtol, scale_atol))
        << s.name << ": max abs diff " << (got - expect).abs().max().item<double>()
        << " (largest reference value " << expect.abs().max().item<double>() << ")";
    ++compared;
  }
  return compared;
}

// Every shard equals its rows of the full reference tensor (`normwise`: as for
// expect_shard_grads).
inline void expect_shards_equal(const FSDPModule& root, torch::nn::Module& reference,
                                double rtol = 1e-5, double atol = 1e-7, bool normwise = false) {
  std::map<std::string, torch::Tensor> ref;
  for (auto& item : reference.named_parameters()) ref[item.key()] = item.value().detach();
  for (const auto& s : root.shards()) {
    const auto& full = ref.at(s.name);
    auto expect = rows_of(s, full);
    auto got = s.shard.detach().reshape(expect.sizes());
    const double scale_atol =
        atol + (normwise && full.numel() > 0 ? rtol * full.abs().max().item<double>() : 0);
    EXPECT_TRUE(torch::allclose(got, expect, rtol, scale_atol))
        << s.name << ": max abs diff " << (got - expect).abs().max().item<double>();
  }
}

// The message of the exception f throws, or "<no error>".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

// A custom all-gather (FSDPModule::set_custom_all_gather), exact and asynchronous as the contract
// asks: an all-reduce of the output, zero but for this rank's place (x + 0 = x). Counts its calls.
struct AllReduceAllGather : AllGather {
  int calls = 0;
  Work operator()(const at::Tensor& out, const at::Tensor& in, Communicator& g) override {
    ++calls;
    out.zero_();
    out.narrow(0, g.rank() * in.numel(), in.numel()).copy_(in);
    return g.all_reduce(out, ReduceOp::kSum);
  }
};

inline ShardOptions audited(std::optional<bool> reshard_after_forward = std::nullopt) {
  ShardOptions o;
  o.debug.audit = true;
  o.reshard_after_forward = reshard_after_forward;
  return o;
}

}  // namespace fsdp::testing
